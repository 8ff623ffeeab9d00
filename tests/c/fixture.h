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
  uint64_t shape[2];
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
  snprintf(path, sizeof path, "%s/version.yaml", dir);
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "step: %s\n", step);
  return fclose(f);
}

/* The example model: "w" f32[4,4] and "b" f32[4], values base + index. */
static int fixture_example_model(const char *dir, float base, const char *step) {
  static float w[16], b[4];
  for (int i = 0; i < 16; i++) w[i] = base + (float)i;
  for (int i = 0; i < 4; i++) b[i] = base + 100.0f + (float)i;
  fixture_tensor ts[2] = {{"w", {4, 4}, 2, w}, {"b", {4, 0}, 1, b}};
  char path[1024];
  mkdir(dir, 0700);
  snprintf(path, sizeof path, "%s/model_state.tp0.0.safetensors", dir);
  if (fixture_write(path, ts, 2) != 0) return -1;
  return fixture_write_version(dir, step);
}

#endif
