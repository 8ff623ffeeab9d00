/* A C engine built with pkg-config alone (no CMake on its side): creates a
 * manager, checks it, prints the library version. */
#include <stdio.h>
#include <string.h>

#include "weight_manager.h"

int main(int argc, char **argv) {
  const char *expected = argc > 1 ? argv[1] : "";
  wm_config config;
  if (wm_config_init(&config) != WM_OK) return 1;
  wm_manager *m = NULL;
  if (wm_init(&config, &m) != WM_OK) {
    fprintf(stderr, "pkgconfig consumer: wm_init failed\n");
    return 1;
  }
  wm_status_info status;
  status.struct_size = sizeof status;
  int ok = wm_status(m, &status) == WM_OK && status.state == WM_STATE_NORMAL;
  wm_destroy(m);
  printf("pkgconfig consumer: weight_manager %s\n", wm_version());
  if (!ok || strcmp(wm_version(), expected) != 0) {
    fprintf(stderr, "pkgconfig consumer: status %s, version %s (expected %s)\n", ok ? "ok" : "wrong",
            wm_version(), expected);
    return 1;
  }
  return 0;
}
