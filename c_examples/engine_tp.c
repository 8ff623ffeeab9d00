/* An engine rank with tensor parallelism: its params are pieces of the
 * model's global tensors, and an update moves only those bytes.
 *
 *   "o.tp"       columns [4r, 4r+4) of o[4,8]             (a column split)
 *   "qkv.tp"     rows of q[8,4], k[4,4] and v[4,4] fused  (a fused QKV, row split)
 *   "experts.ep" experts [2r, 2r+2) of experts[4,2,4]     (expert parallelism)
 *
 * The source here is a whole-tensor HuggingFace-style snapshot; the same
 * params update from trainer ranks' publishers by naming their sockets or
 * addresses in `locations` (README "Sharded updates"). The second update
 * finds the layouts unchanged and reuses the plan.
 *
 * usage: engine_tp MODEL_DIR RANK      (RANK 0 or 1 of a TP=2 engine) */
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include "weight_manager.h"

/* The fixture's values (tests/c/fixture.h): tensor t, element i, step s. */
static float expected(int step, int t, size_t i) { return (float)(step * 10000 + t * 1000) + (float)i; }

static int fail(wm_manager *m, const char *what, wm_result rc) {
  char detail[512] = "";
  size_t n = 0;
  if (m) wm_last_error(m, detail, sizeof detail, &n);
  fprintf(stderr, "engine_tp: %s failed: %s: %s\n", what, wm_result_text(rc), detail);
  wm_destroy(m);
  return 1;
}

/* Register a library-owned f32 param made of `n` pieces; returns its memory. */
static float *add_param(wm_manager *m, const char *name, const uint64_t *shape, size_t ndim,
                        const wm_piece *pieces, size_t n, wm_result *rc) {
  wm_param_desc d;
  wm_param_desc_init(&d);
  d.name = name;
  d.dtype = WM_DTYPE_F32;
  d.shape = shape;
  d.ndim = ndim;
  d.pieces = pieces;
  d.npieces = n;
  void *mem = NULL;
  size_t len = 0;
  *rc = wm_allocate_param(m, &d, &mem, &len);
  return mem;
}

/* Every element of every param against the global tensors' formula. */
static int check(int step, int r, const float *o, const float *qkv, const float *ex) {
  for (size_t row = 0; row < 4; row++) /* o.tp[row][c] = o[row][4r + c] */
    for (size_t c = 0; c < 4; c++)
      if (o[row * 4 + c] != expected(step, 0, row * 8 + 4 * r + c)) return 0;
  for (size_t row = 0; row < 8; row++) { /* q rows, then k rows, then v rows */
    int t = row < 4 ? 1 : row < 6 ? 2 : 3;
    size_t src = row < 4 ? 4 * r + row : row < 6 ? 2 * r + row - 4 : 2 * r + row - 6;
    for (size_t c = 0; c < 4; c++)
      if (qkv[row * 4 + c] != expected(step, t, src * 4 + c)) return 0;
  }
  for (size_t i = 0; i < 16; i++) /* experts 2r and 2r+1: 8 elements each */
    if (ex[i] != expected(step, 4, 16 * r + i)) return 0;
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[2], "0") != 0 && strcmp(argv[2], "1") != 0)) {
    fprintf(stderr, "usage: %s MODEL_DIR RANK(0|1)\n", argv[0]);
    return 2;
  }
  int r = argv[2][0] - '0';
  wm_config config;
  wm_config_init(&config);
  config.rank = (uint32_t)r;
  config.world_size = 2;
  config.model_dir = argv[1];
  config.fallback_dir = "";
  wm_manager *m = NULL;
  wm_result rc = wm_init(&config, &m);
  if (rc != WM_OK) return fail(NULL, "wm_init", rc);

  uint64_t o_shape[2] = {4, 8}, q_shape[2] = {8, 4}, kv_shape[2] = {4, 4}, e_shape[3] = {4, 2, 4};
  wm_piece o_piece, qkv[3], e_piece;
  /* A column split: dim 1 of o, this rank's half. */
  wm_piece_narrow(&o_piece, "o", o_shape, 2, 1, 4 * (uint64_t)r, 4);
  /* Fused QKV: q's rows, then k's below them, then v's. */
  wm_piece_narrow(&qkv[0], "q", q_shape, 2, 0, 4 * (uint64_t)r, 4);
  wm_piece_narrow(&qkv[1], "k", kv_shape, 2, 0, 2 * (uint64_t)r, 2);
  qkv[1].param_offset[0] = 4;
  wm_piece_narrow(&qkv[2], "v", kv_shape, 2, 0, 2 * (uint64_t)r, 2);
  qkv[2].param_offset[0] = 6;
  /* Two of the four stacked experts. */
  wm_piece_narrow(&e_piece, "experts", e_shape, 3, 0, 2 * (uint64_t)r, 2);

  uint64_t o_tp[2] = {4, 4}, qkv_tp[2] = {8, 4}, e_ep[3] = {2, 2, 4};
  float *o = add_param(m, "o.tp", o_tp, 2, &o_piece, 1, &rc);
  if (rc != WM_OK) return fail(m, "allocate o.tp", rc);
  float *fused = add_param(m, "qkv.tp", qkv_tp, 2, qkv, 3, &rc);
  if (rc != WM_OK) return fail(m, "allocate qkv.tp", rc);
  float *ex = add_param(m, "experts.ep", e_ep, 3, &e_piece, 1, &rc);
  if (rc != WM_OK) return fail(m, "allocate experts.ep", rc);

  wm_update_request req;
  wm_update_request_init(&req); /* snapshot from config.model_dir, atomic */
  wm_update_stats stats;
  for (int round = 0; round < 2; round++) {
    stats.struct_size = sizeof stats;
    if ((rc = wm_update(m, &req, &stats)) != WM_OK) return fail(m, "update", rc);
    printf("rank %d: version %s, %llu bytes (params: %d), plan %s in %.3f ms\n", r, stats.version,
           (unsigned long long)stats.bytes, (16 + 32 + 16) * 4, stats.plan_reused ? "reused" : "made",
           stats.plan_ns / 1e6);
    if (stats.bytes != (16 + 32 + 16) * 4 || (int)stats.plan_reused != round) {
      fprintf(stderr, "engine_tp: moved %llu bytes, plan_reused %u\n", (unsigned long long)stats.bytes,
              stats.plan_reused);
      return 1;
    }
    if (!check(3, r, o, fused, ex)) {
      fprintf(stderr, "engine_tp: rank %d holds the wrong bytes\n", r);
      return 1;
    }
  }
  wm_destroy(m);
  printf("engine_tp: rank %d OK\n", r);
  return 0;
}
