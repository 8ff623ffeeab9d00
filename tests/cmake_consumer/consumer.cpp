// Links weight_manager from C++ and runs one manager through init and status.
#include <cstdio>
#include <cstring>
#include <memory>

#include "weight_manager.h"

int main() {
  wm_config config;
  wm_config_init(&config);
  wm_manager *raw = nullptr;
  if (wm_init(&config, &raw) != WM_OK) return 1;
  std::unique_ptr<wm_manager, decltype(&wm_destroy)> m(raw, &wm_destroy);
  wm_status_info status;
  status.struct_size = sizeof status;
  if (wm_status(m.get(), &status) != WM_OK || status.state != WM_STATE_NORMAL) return 1;
  std::printf("consumer: weight_manager %s, state %s\n", wm_version(), wm_state_name(status.state));
  return std::strcmp(wm_version(), "0.2.0") == 0 ? 0 : 1;
}
