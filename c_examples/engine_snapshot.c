/* A minimal engine rank: registers its two params, loads weights from a
 * snapshot, clears them (as before handing the GPU to the trainer), and loads
 * the next version. Uses only weight_manager.h.
 *
 * usage: engine_snapshot MODEL_DIR      (MODEL_DIR/next holds the next version) */
#include <stdio.h>
#include <stdlib.h>
#include "weight_manager.h"

static int fail(wm_manager *m, const char *what, wm_result rc) {
  char detail[512] = "";
  size_t n = 0;
  if (m) wm_last_error(m, detail, sizeof detail, &n);
  fprintf(stderr, "engine_snapshot: %s failed: %s: %s\n", what, wm_result_text(rc), detail);
  wm_destroy(m);
  return 1;
}

static void print_status(wm_manager *m) {
  wm_status_info s;
  s.struct_size = sizeof s;
  if (wm_status(m, &s) == WM_OK)
    printf("  state %-8s version %-4s params %llu resident %llu bytes\n", wm_state_name(s.state),
           s.version[0] ? s.version : "-", (unsigned long long)s.params,
           (unsigned long long)s.resident_bytes);
}

/* The example model (tests/c/fixture.h): w[i] = base + i, b[i] = base + 100 + i. */
static int holds(const float *w, const float *b, float base) {
  int ok = 1;
  for (int i = 0; i < 16; i++) ok &= w[i] == base + (float)i;
  for (int i = 0; i < 4; i++) ok &= b[i] == base + 100.0f + (float)i;
  return ok;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
    return 2;
  }
  wm_config config;
  wm_config_init(&config);
  config.model_dir = argv[1];
  config.fallback_dir = ""; /* no fallback directory */
  wm_manager *m = NULL;
  wm_result rc = wm_init(&config, &m);
  if (rc != WM_OK) return fail(NULL, "wm_init", rc);

  /* "w" lives in the engine's own buffer; "b" in memory the library owns
   * and can release on clear without the engine losing the pointer. */
  static float w[16];
  uint64_t w_shape[2] = {4, 4}, b_shape[1] = {4};
  wm_param_desc desc;
  wm_param_desc_init(&desc);
  desc.name = "w";
  desc.dtype = WM_DTYPE_F32;
  desc.shape = w_shape;
  desc.ndim = 2;
  if ((rc = wm_register_param(m, &desc, w, sizeof w)) != WM_OK) return fail(m, "register w", rc);
  desc.name = "b";
  desc.shape = b_shape;
  desc.ndim = 1;
  void *b_mem = NULL;
  size_t b_len = 0;
  if ((rc = wm_allocate_param(m, &desc, &b_mem, &b_len)) != WM_OK) return fail(m, "allocate b", rc);
  float *b = b_mem;

  wm_update_request req;
  wm_update_request_init(&req); /* snapshot from config.model_dir, atomic */
  wm_update_stats stats;
  stats.struct_size = sizeof stats;
  if ((rc = wm_update(m, &req, &stats)) != WM_OK) return fail(m, "update", rc);
  printf("updated to version %s: %llu tensors, %llu bytes in %.3f ms\n", stats.version,
         (unsigned long long)stats.tensors, (unsigned long long)stats.bytes, stats.total_ns / 1e6);
  print_status(m);
  if (!holds(w, b, 1.0f)) {
    fprintf(stderr, "engine_snapshot: unexpected weights w[5]=%f b[2]=%f\n", w[5], b[2]);
    return 1;
  }

  if ((rc = wm_clear(m)) != WM_OK) return fail(m, "clear", rc);
  printf("cleared\n");
  print_status(m);

  char next[1024];
  if (snprintf(next, sizeof next, "%s/next", argv[1]) >= (int)sizeof next) {
    fprintf(stderr, "engine_snapshot: %s: too long a path\n", argv[1]);
    wm_destroy(m);
    return 2;
  }
  req.location = next;
  req.flags = WM_UPDATE_IN_PLACE;
  if ((rc = wm_update(m, &req, &stats)) != WM_OK) return fail(m, "update next", rc);
  printf("updated to version %s\n", stats.version);
  print_status(m);
  /* Same pointer `b`, new bytes. */
  if (!holds(w, b, 2.0f)) {
    fprintf(stderr, "engine_snapshot: unexpected weights after second update\n");
    return 1;
  }
  wm_destroy(m);
  printf("engine_snapshot: OK\n");
  return 0;
}
