/* Test fixtures for the C harness: writes real safetensors files (f32
 * tensors only) and a version.yaml, with nothing but libc. */
#ifndef WM_TEST_FIXTURE_H
#define WM_TEST_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
  const char *name;
  uint64_t shape[3];
  size_t ndim;
  const float *data;
} fixture_tensor;

static size_t fixture_numel(const fixture_tensor *t) {
  size_t n = 1;
  for (size_t i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
  return n;
}

/* Write `n` f32 tensors to `path` as safetensors. Returns 0 on success. */
static int fixture_write(const char *path, const fixture_tensor *ts, size_t n) {
  char header[4096];
  size_t off = 0, len = 0;
  len += (size_t)snprintf(header + len, sizeof header - len, "{");
  for (size_t i = 0; i < n; i++) {
    size_t bytes = fixture_numel(&ts[i]) * 4;
    len += (size_t)snprintf(header + len, sizeof header - len,
                            "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[", i ? "," : "", ts[i].name);
    for (size_t d = 0; d < ts[i].ndim; d++)
      len += (size_t)snprintf(header + len, sizeof header - len, "%s%llu", d ? "," : "",
                              (unsigned long long)ts[i].shape[d]);
    len += (size_t)snprintf(header + len, sizeof header - len, "],\"data_offsets\":[%zu,%zu]}", off,
                            off + bytes);
    off += bytes;
  }
  len += (size_t)snprintf(header + len, sizeof header - len, "}");
  while ((8 + len) % 8 != 0) header[len++] = ' ';
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  uint64_t hlen = len;
  unsigned char le[8];
  for (int i = 0; i < 8; i++) le[i] = (unsigned char)(hlen >> (8 * i));
  int ok = fwrite(le, 1, 8, f) == 8 && fwrite(header, 1, len, f) == len;
  for (size_t i = 0; ok && i < n; i++) {
    size_t bytes = fixture_numel(&ts[i]) * 4;
    ok = fwrite(ts[i].data, 1, bytes, f) == bytes;
  }
  return (fclose(f) == 0 && ok) ? 0 : -1;
}

static int fixture_write_version(const char *dir, const char *step) {
  char path[1024];
  if (snprintf(path, sizeof path, "%s/version.yaml", dir) >= (int)sizeof path) return -1;
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "step: %s\n", step);
  return fclose(f);
}

/* The value of element `i` of tensor number `t` in the tensor-parallel
 * example model of step `step` (every byte is checkable by formula). */
static inline float fixture_tp_value(int step, int t, size_t i) {
  return (float)(step * 10000 + t * 1000) + (float)i;
}

/* The tensor-parallel example model, HuggingFace style (one
 * model.safetensors every rank reads from): "o" f32[4,8], "q" f32[8,4],
 * "k" f32[4,4], "v" f32[4,4], "experts" f32[4,2,4], in that order. */
static inline int fixture_tp_model(const char *dir, int step) {
  static float o[32], q[32], k[16], v[16], e[32];
  float *data[5] = {o, q, k, v, e};
  size_t numel[5] = {32, 32, 16, 16, 32};
  for (int t = 0; t < 5; t++)
    for (size_t i = 0; i < numel[t]; i++) data[t][i] = fixture_tp_value(step, t, i);
  fixture_tensor ts[5] = {{"o", {4, 8}, 2, o},
                          {"q", {8, 4}, 2, q},
                          {"k", {4, 4}, 2, k},
                          {"v", {4, 4}, 2, v},
                          {"experts", {4, 2, 4}, 3, e}};
  char path[1024], step_text[32];
  mkdir(dir, 0700);
  if (snprintf(path, sizeof path, "%s/model.safetensors", dir) >= (int)sizeof path) return -1;
  if (fixture_write(path, ts, 5) != 0) return -1;
  if (snprintf(step_text, sizeof step_text, "%d", step) >= (int)sizeof step_text) return -1;
  return fixture_write_version(dir, step_text);
}

/* The example model: "w" f32[4,4] and "b" f32[4], values base + index. */
static int fixture_example_model(const char *dir, float base, const char *step) {
  static float w[16], b[4];
  for (int i = 0; i < 16; i++) w[i] = base + (float)i;
  for (int i = 0; i < 4; i++) b[i] = base + 100.0f + (float)i;
  fixture_tensor ts[2] = {{"w", {4, 4}, 2, w}, {"b", {4, 0}, 1, b}};
  char path[1024];
  mkdir(dir, 0700);
  if (snprintf(path, sizeof path, "%s/model_state.tp0.0.safetensors", dir) >= (int)sizeof path)
    return -1;
  if (fixture_write(path, ts, 2) != 0) return -1;
  return fixture_write_version(dir, step);
}

#endif
