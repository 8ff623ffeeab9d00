// The header compiles on its own as C++, as an engine written in C++ uses it.
#include "weight_manager.h"

int main() {
  wm_update_request request;
  if (wm_update_request_init(&request) != WM_OK) return 1;
  return request.struct_size == sizeof request ? 0 : 1;
}
