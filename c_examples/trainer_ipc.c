/* A minimal trainer: publishes two tensors from its memory over IPC and
 * serves one engine rank (c_examples/engine_ipc.c is the engine).
 *
 * usage: trainer_ipc SOCKET_PATH */
#include <stdio.h>
#include "weight_manager.h"

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s SOCKET_PATH\n", argv[0]);
    return 2;
  }
  static float w[16], b[4];
  for (int i = 0; i < 16; i++) w[i] = 0.5f * (float)i;
  for (int i = 0; i < 4; i++) b[i] = -1.0f - (float)i;

  wm_publisher_config config;
  wm_publisher_config_init(&config);
  config.bucket_size = 256; /* tiny buckets: each tensor is its own bucket or split */
  wm_publisher *p = NULL;
  wm_result rc = wm_publisher_create(argv[1], &config, &p);
  if (rc != WM_OK) {
    fprintf(stderr, "trainer_ipc: create: %s\n", wm_result_text(rc));
    return 1;
  }
  uint64_t w_shape[2] = {4, 4}, b_shape[1] = {4};
  wm_tensor_desc t;
  wm_tensor_desc_init(&t); /* host memory, every rank, a whole tensor */
  t.dtype = WM_DTYPE_F32;
  t.name = "w";
  t.shape = w_shape;
  t.ndim = 2;
  t.data = w;
  t.len = sizeof w;
  wm_publisher_add(p, &t);
  t.name = "b";
  t.shape = b_shape;
  t.ndim = 1;
  t.data = b;
  t.len = sizeof b;
  wm_publisher_add(p, &t);
  wm_publisher_set_version(p, "7");

  wm_serve_stats stats;
  stats.struct_size = sizeof stats;
  rc = wm_publisher_serve(p, 1, 20000, &stats); /* one engine, 20 s to connect */
  if (rc != WM_OK) {
    char why[512];
    size_t n;
    wm_publisher_last_error(p, why, sizeof why, &n);
    fprintf(stderr, "trainer_ipc: serve: %s: %s\n", wm_result_text(rc), why);
    wm_publisher_destroy(p);
    return 1;
  }
  printf("trainer_ipc: served %u engine(s), %llu bytes\n", stats.sessions, (unsigned long long)stats.bytes);
  wm_publisher_destroy(p);
  return 0;
}
