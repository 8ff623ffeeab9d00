/* The header compiles on its own, as C11, with -Wall -Wextra -Werror -pedantic. */
#include "weight_manager.h"

int main(void) {
  wm_config config;
  return wm_config_init(&config) == WM_OK && config.struct_size == sizeof config ? 0 : 1;
}
