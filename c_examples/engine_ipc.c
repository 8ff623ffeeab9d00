/* The engine side of c_examples/trainer_ipc.c: one rank pulls its weights
 * over IPC, verifying checksums, into its own buffers.
 *
 * usage: engine_ipc SOCKET_PATH */
#include <stdio.h>
#include <time.h>
#include "weight_manager.h"

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s SOCKET_PATH\n", argv[0]);
    return 2;
  }
  wm_config config;
  wm_config_init(&config);
  wm_manager *m = NULL;
  if (wm_init(&config, &m) != WM_OK) return 1;
  static float w[16], b[4];
  uint64_t w_shape[2] = {4, 4}, b_shape[1] = {4};
  wm_param_desc d;
  wm_param_desc_init(&d);
  d.dtype = WM_DTYPE_F32;
  d.name = "w";
  d.shape = w_shape;
  d.ndim = 2;
  wm_register_param(m, &d, w, sizeof w);
  d.name = "b";
  d.shape = b_shape;
  d.ndim = 1;
  wm_register_param(m, &d, b, sizeof b);

  wm_update_request req;
  wm_update_request_init(&req);
  req.source = WM_SOURCE_IPC;
  req.location = argv[1];
  req.flags = WM_UPDATE_VERIFY_CHECKSUMS;
  req.timeout_ms = 20000;
  wm_update_stats stats;
  stats.struct_size = sizeof stats;
  wm_result rc = WM_ERR_NOT_FOUND;
  /* The trainer may still be starting: try for a few seconds. */
  for (int attempt = 0; attempt < 200 && rc == WM_ERR_NOT_FOUND; attempt++) {
    rc = wm_update(m, &req, &stats);
    if (rc == WM_ERR_NOT_FOUND) {
      struct timespec ts = {0, 20 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  if (rc != WM_OK) {
    char why[512];
    size_t n;
    wm_last_error(m, why, sizeof why, &n);
    fprintf(stderr, "engine_ipc: update: %s: %s\n", wm_result_text(rc), why);
    wm_destroy(m);
    return 1;
  }
  /* Every value the trainer publishes (trainer_ipc.c): w[i] = i / 2, b[i] = -1 - i. */
  int ok = 1;
  for (int i = 0; i < 16; i++) ok &= w[i] == 0.5f * (float)i;
  for (int i = 0; i < 4; i++) ok &= b[i] == -1.0f - (float)i;
  printf("engine_ipc: version %s, %llu tensors, %llu bytes: %s\n", stats.version,
         (unsigned long long)stats.tensors, (unsigned long long)stats.bytes, ok ? "OK" : "WRONG BYTES");
  wm_destroy(m);
  return ok ? 0 : 1;
}
