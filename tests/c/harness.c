/* C harness: every exported function's success and error paths, through the
 * header only. Each test is one argv[1] name, registered with ctest.
 * Built with -Wall -Wextra -Werror, and again with AddressSanitizer. */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "fixture.h"
#include "weight_manager.h"

static int failures = 0, checks = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    checks++;                                                                  \
    if (!(cond)) {                                                             \
      failures++;                                                              \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

#define CHECK_RC(call, want)                                                         \
  do {                                                                               \
    wm_result rc_ = (call);                                                          \
    checks++;                                                                        \
    if (rc_ != (want)) {                                                             \
      failures++;                                                                    \
      fprintf(stderr, "%s:%d: %s returned %u (%s), wanted %s\n", __FILE__, __LINE__, \
              #call, (unsigned)rc_, wm_result_text(rc_), #want);                     \
    }                                                                                \
  } while (0)

static char last_error_buf[1024];
static const char *last_error(wm_manager *m) {
  size_t n = 0;
  last_error_buf[0] = 0;
  wm_last_error(m, last_error_buf, sizeof last_error_buf, &n);
  return last_error_buf;
}

static char tmpdir[256];
static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/wm_c_harness_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    exit(2);
  }
}
static void remove_tmpdir(void) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
}

static wm_manager *new_manager(const char *model_dir) {
  wm_config c;
  wm_config_init(&c);
  c.model_dir = model_dir;
  c.fallback_dir = "";
  wm_manager *m = NULL;
  CHECK_RC(wm_init(&c, &m), WM_OK);
  return m;
}

static uint64_t w_shape[2] = {4, 4}, b_shape[1] = {4};

static void desc_w(wm_param_desc *d) {
  wm_param_desc_init(d);
  d->name = "w";
  d->dtype = WM_DTYPE_F32;
  d->shape = w_shape;
  d->ndim = 2;
}
static void desc_b(wm_param_desc *d) {
  wm_param_desc_init(d);
  d->name = "b";
  d->dtype = WM_DTYPE_F32;
  d->shape = b_shape;
  d->ndim = 1;
}

/* A manager with "w" engine-owned (in `w`) and "b" library-owned (*b). */
static wm_manager *example_engine(const char *dir, float *w, float **b) {
  wm_manager *m = new_manager(dir);
  wm_param_desc d;
  desc_w(&d);
  CHECK_RC(wm_register_param(m, &d, w, 16 * sizeof(float)), WM_OK);
  desc_b(&d);
  void *p = NULL;
  size_t n = 0;
  CHECK_RC(wm_allocate_param(m, &d, &p, &n), WM_OK);
  CHECK(n == 4 * sizeof(float));
  *b = p;
  return m;
}

/* ---------------------------------------------------------------- tests */

static void test_version(void) {
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", WM_VERSION_MAJOR, WM_VERSION_MINOR, WM_VERSION_PATCH);
  CHECK(strcmp(wm_version(), want) == 0);
  for (unsigned code = 0; code <= WM_ERR_AUTH; code++) {
    CHECK(wm_result_text(code) != NULL && strlen(wm_result_text(code)) > 0);
    CHECK(strcmp(wm_result_text(code), "unknown result code") != 0);
  }
  CHECK(strcmp(wm_result_text(9999), "unknown result code") == 0);
  CHECK(strcmp(wm_result_text(WM_OK), "ok") == 0);
  CHECK(strcmp(wm_state_name(WM_STATE_NORMAL), "NORMAL") == 0);
  CHECK(strcmp(wm_state_name(WM_STATE_CLEARED), "CLEARED") == 0);
  CHECK(strcmp(wm_state_name(WM_STATE_FAILED), "FAILED") == 0);
  CHECK(strcmp(wm_state_name(42), "UNKNOWN") == 0);
  CHECK(WM_STATE_CLEARING == -1 && WM_STATE_CLEARED == -2 && WM_STATE_UPDATING == 1);
}

static void test_null_args(void) {
  wm_config c;
  wm_manager *m = NULL;
  CHECK_RC(wm_config_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_param_desc_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_update_request_init(NULL), WM_ERR_NULL_ARGUMENT);
  wm_config_init(&c);
  CHECK_RC(wm_init(NULL, &m), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_init(&c, NULL), WM_ERR_NULL_ARGUMENT);
  wm_destroy(NULL); /* no-op */

  m = new_manager(NULL);
  wm_param_desc d;
  desc_w(&d);
  float w[16];
  void *p = NULL;
  size_t n = 0, written = 0;
  CHECK_RC(wm_register_param(NULL, &d, w, sizeof w), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_register_param(m, NULL, w, sizeof w), WM_ERR_NULL_ARGUMENT);
  CHECK(strstr(last_error(m), "desc is NULL") != NULL);
  CHECK_RC(wm_register_param(m, &d, NULL, sizeof w), WM_ERR_NULL_ARGUMENT);
  CHECK(strstr(last_error(m), "'w'") != NULL);
  d.name = NULL;
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_NULL_ARGUMENT);
  desc_w(&d);
  d.shape = NULL;
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_NULL_ARGUMENT);
  desc_w(&d);
  CHECK_RC(wm_allocate_param(NULL, &d, &p, &n), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_allocate_param(m, NULL, &p, &n), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_allocate_param(m, &d, NULL, &n), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_allocate_param(m, &d, &p, NULL), WM_ERR_NULL_ARGUMENT);
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(NULL, &r, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_update(m, NULL, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_clear(NULL), WM_ERR_NULL_ARGUMENT);
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(NULL, &s), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_status(m, NULL), WM_ERR_NULL_ARGUMENT);
  int32_t sig = 77;
  CHECK_RC(wm_broadcast_signal(NULL, &sig), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_broadcast_signal(m, NULL), WM_ERR_NULL_ARGUMENT);
  char buf[8];
  CHECK_RC(wm_last_error(NULL, buf, sizeof buf, &written), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_last_error(m, NULL, sizeof buf, &written), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_last_error(m, buf, sizeof buf, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_last_error(m, buf, 0, &written), WM_ERR_INVALID_ARGUMENT);
  CHECK(sig == 77); /* outputs untouched on failure */
  wm_destroy(m);
}

static void test_struct_size(void) {
  char buf_create[256];
  size_t created_len = 0;
  wm_config c;
  wm_config_init(&c);
  CHECK(c.struct_size == sizeof c);
  /* The optional blocks: none by default, each with its own _init. */
  CHECK(c.group == NULL && c.net == NULL && c.fanout == NULL && c.memory == NULL);
  wm_group_config g;
  wm_net_config net;
  wm_fanout_config fan;
  wm_memory_config mem;
  CHECK_RC(wm_group_config_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_net_config_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_fanout_config_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_memory_config_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_group_config_init(&g), WM_OK);
  CHECK_RC(wm_net_config_init(&net), WM_OK);
  CHECK_RC(wm_fanout_config_init(&fan), WM_OK);
  CHECK_RC(wm_memory_config_init(&mem), WM_OK);
  CHECK(g.struct_size == sizeof g && g.name == NULL && g.signal_timeout_ms == 0);
  CHECK(net.struct_size == sizeof net && net.secret == NULL && net.bucket_size == 0 && net.depth == 0);
  CHECK(fan.struct_size == sizeof fan && fan.group == -1 && fan.nccl_library == NULL); /* no fan-out */
  CHECK(mem.struct_size == sizeof mem && mem.callback_staging_limit == 0); /* 0: the 4 GiB default */
  wm_manager *m = (wm_manager *)0x1;
  c.struct_size = sizeof c - 8;
  CHECK_RC(wm_init(&c, &m), WM_ERR_STRUCT_SIZE);
  CHECK(m == (wm_manager *)0x1); /* out-param untouched */
  /* A block's struct_size is checked too. */
  wm_config_init(&c);
  net.struct_size = 4;
  c.net = &net;
  CHECK_RC(wm_init(&c, &m), WM_ERR_STRUCT_SIZE);
  CHECK(m == (wm_manager *)0x1);
  CHECK_RC(wm_last_create_error(buf_create, sizeof buf_create, &created_len), WM_OK);
  CHECK(strstr(buf_create, "wm_net_config.struct_size is 4") != NULL);
  /* Fan-out needs the ranks in a group: refused at init, out-param untouched. */
  wm_config_init(&c);
  fan.group = 0;
  c.fanout = &fan;
  c.device = 0;
  CHECK_RC(wm_init(&c, &m), WM_ERR_INVALID_ARGUMENT);
  CHECK(m == (wm_manager *)0x1);
  /* Out-of-range settings are refused at init, naming them. */
  wm_config_init(&c);
  CHECK_RC(wm_net_config_init(&net), WM_OK);
  net.depth = 9;
  c.net = &net;
  CHECK_RC(wm_init(&c, &m), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_last_create_error(buf_create, sizeof buf_create, &created_len), WM_OK);
  CHECK(strstr(buf_create, "depth 9") != NULL);
  wm_config_init(&c);
  c.device = -5;
  CHECK_RC(wm_init(&c, &m), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_last_create_error(buf_create, sizeof buf_create, &created_len), WM_OK);
  CHECK(strstr(buf_create, "device -5") != NULL);
  CHECK(m == (wm_manager *)0x1);
  m = new_manager(NULL);

  wm_param_desc d;
  desc_w(&d);
  d.struct_size = 3;
  float w[16];
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_STRUCT_SIZE);
  CHECK(strstr(last_error(m), "wm_param_desc.struct_size is 3") != NULL);

  wm_update_request r;
  wm_update_request_init(&r);
  r.struct_size = sizeof r + 16;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_STRUCT_SIZE);
  CHECK(strstr(last_error(m), "wm_update_request") != NULL);

  wm_update_request_init(&r);
  wm_update_stats st;
  st.struct_size = 1;
  CHECK_RC(wm_update(m, &r, &st), WM_ERR_STRUCT_SIZE);
  CHECK(strstr(last_error(m), "wm_update_stats") != NULL);

  wm_status_info s;
  memset(&s, 0xab, sizeof s);
  s.struct_size = 0;
  CHECK_RC(wm_status(m, &s), WM_ERR_STRUCT_SIZE);
  CHECK(s.state == (int32_t)0xabababab); /* untouched */
  wm_destroy(m);
}

static void test_enums(void) {
  wm_config c;
  wm_config_init(&c);
  c.log_level = 99;
  wm_manager *m = NULL;
  CHECK_RC(wm_init(&c, &m), WM_ERR_INVALID_ARGUMENT);
  wm_config_init(&c);
  c.world_size = 2;
  c.rank = 2;
  CHECK_RC(wm_init(&c, &m), WM_ERR_INVALID_ARGUMENT);
  CHECK(m == NULL);

  m = new_manager(NULL);
  wm_param_desc d;
  float w[16];
  desc_w(&d);
  d.dtype = 99;
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "dtype 99") != NULL);
  desc_w(&d);
  d.memory = 7;
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_INVALID_ARGUMENT);
  desc_w(&d);
  d.ndim = WM_MAX_NDIM + 1;
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_INVALID_ARGUMENT);
  desc_w(&d);
  d.memory = WM_MEMORY_DEVICE;
  d.device_ordinal = 0;
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_ERR_UNSUPPORTED);
  CHECK(strstr(last_error(m), "CUDA") != NULL);
  desc_w(&d);
  CHECK_RC(wm_register_param(m, &d, w, sizeof w - 4), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "needs 64") != NULL);

  wm_update_request r;
  wm_update_request_init(&r);
  r.source = 9;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  wm_update_request_init(&r);
  r.flags = 0x80;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "0x80") != NULL);
  wm_update_request_init(&r);
  r.source = WM_SOURCE_IPC; /* needs the publisher's socket */
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "socket") != NULL);
  r.source = WM_SOURCE_RDMA; /* needs the publisher's host:port */
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "host:port") != NULL);
  wm_update_request_init(&r); /* no location and no model_dir */
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "model_dir") != NULL);
  /* A list of locations: a NULL list with a count, a NULL entry, too many. */
  wm_update_request_init(&r);
  r.source = WM_SOURCE_IPC;
  r.nlocations = 2;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK(strstr(last_error(m), "locations") != NULL);
  const char *two[2] = {"/nonexistent/a.sock", NULL};
  r.locations = two;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK(strstr(last_error(m), "locations[1]") != NULL);
  r.nlocations = WM_MAX_SOURCES + 1;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  /* Every listed source is opened: the first missing one is named. */
  r.nlocations = 1;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_NOT_FOUND);
  CHECK(strstr(last_error(m), "/nonexistent/a.sock") != NULL);
  /* Bytes per source: none before an update; NULL out with a capacity. */
  size_t count = 9;
  CHECK_RC(wm_update_source_bytes(m, NULL, 0, &count), WM_OK);
  CHECK(count == 0);
  CHECK_RC(wm_update_source_bytes(m, NULL, 1, &count), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_update_source_bytes(m, NULL, 0, NULL), WM_ERR_NULL_ARGUMENT);
  wm_destroy(m);
}

static void test_lifecycle(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  float w[16] = {0};
  float *b = NULL;
  wm_manager *m = example_engine(tmpdir, w, &b);
  float *b_addr = b;

  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && s.version[0] == 0 && s.updates == 0);
  CHECK(s.params == 2 && s.param_bytes == 80);

  wm_update_request r;
  wm_update_request_init(&r);
  wm_update_stats st;
  st.struct_size = sizeof st;
  CHECK_RC(wm_update(m, &r, &st), WM_OK);
  CHECK(strcmp(st.version, "1") == 0 && st.tensors == 2 && st.bytes == 80 && st.rank == 0);
  CHECK(st.total_ns >= st.sync_ns);
  CHECK(w[0] == 1.0f && w[15] == 16.0f && b[0] == 101.0f && b[3] == 104.0f);

  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && strcmp(s.version, "1") == 0 && s.updates == 1);
  CHECK(s.resident_bytes == 80 && s.last_result == WM_OK);
  CHECK(strcmp(s.last_update.version, "1") == 0 && s.last_update.bytes == 80);
  CHECK(st.sources == 1 && st.plan_reused == 0);
  uint64_t per_source[2] = {0, 0};
  size_t count = 0;
  CHECK_RC(wm_update_source_bytes(m, per_source, 2, &count), WM_OK);
  CHECK(count == 1 && per_source[0] == 80 && per_source[1] == 0);

  CHECK_RC(wm_clear(m), WM_OK);
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_CLEARED && s.version[0] == 0 && s.resident_bytes == 0);
  CHECK(b[0] == 0.0f); /* released pages read as zeros */
  CHECK_RC(wm_clear(m), WM_OK); /* already cleared: no-op */

  /* Register after the first update or clear: refused. */
  wm_param_desc d;
  desc_w(&d);
  d.name = "late";
  void *p;
  size_t n;
  CHECK_RC(wm_allocate_param(m, &d, &p, &n), WM_ERR_STATE);

  CHECK(fixture_example_model(tmpdir, 5.0f, "2") == 0);
  r.version = "explicit-v2";
  r.flags = WM_UPDATE_IN_PLACE;
  CHECK_RC(wm_update(m, &r, &st), WM_OK);
  CHECK(strcmp(st.version, "explicit-v2") == 0);
  CHECK(b == b_addr && b[0] == 105.0f && w[1] == 6.0f);
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && s.resident_bytes == 80 && s.updates == 2);

  /* wm_last_error truncates to the buffer. */
  r.location = "/nonexistent/model";
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_NOT_FOUND);
  char small[8];
  size_t written = 99;
  CHECK_RC(wm_last_error(m, small, sizeof small, &written), WM_OK);
  CHECK(written == 7 && small[7] == 0);
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.last_result == WM_ERR_NOT_FOUND && strcmp(s.version, "explicit-v2") == 0);
  wm_destroy(m);
  remove_tmpdir();
}

static void test_failures(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  float w[16] = {0};
  float *b = NULL;
  wm_manager *m = example_engine(tmpdir, w, &b);
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);

  /* A snapshot with a wrongly shaped "w": nothing written, state kept. */
  static float w2[8] = {9, 9, 9, 9, 9, 9, 9, 9}, b2[4] = {9, 9, 9, 9};
  fixture_tensor bad[2] = {{"w", {2, 4}, 2, w2}, {"b", {4, 0}, 1, b2}};
  char path[1024], dir2[512];
  snprintf(dir2, sizeof dir2, "%s/bad", tmpdir);
  mkdir(dir2, 0700);
  snprintf(path, sizeof path, "%s/model_state.tp0.0.safetensors", dir2);
  CHECK(fixture_write(path, bad, 2) == 0);
  r.location = dir2;
  r.version = "bad";
  r.flags = WM_UPDATE_IN_PLACE;
  wm_update_stats st;
  memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  CHECK_RC(wm_update(m, &r, &st), WM_ERR_MISMATCH);
  CHECK(strstr(last_error(m), "param 'w': shape mismatch: registered [4, 4], source [2, 4]") != NULL);
  CHECK(st.version[0] == 0); /* stats untouched */
  CHECK(w[0] == 1.0f && b[0] == 101.0f);
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && strcmp(s.version, "1") == 0);

  /* Verification asked, but no checksum file. */
  r.location = NULL;
  r.version = NULL;
  r.flags = WM_UPDATE_VERIFY_CHECKSUMS;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_MISMATCH);
  CHECK(strstr(last_error(m), "wm manifest") != NULL);

  /* No version anywhere. */
  snprintf(path, sizeof path, "%s/version.yaml", tmpdir);
  unlink(path);
  r.flags = 0;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_NO_VERSION);
  CHECK(strstr(last_error(m), "version.yaml") != NULL);

  /* More pieces than WM_MAX_PIECES: refused before any is read (under
     AddressSanitizer a read past the one piece given would be caught). */
  wm_piece one;
  wm_piece_init(&one);
  wm_param_desc d;
  wm_param_desc_init(&d);
  uint64_t shape[1] = {4};
  float mem[4];
  d.name = "many";
  d.dtype = WM_DTYPE_F32;
  d.shape = shape;
  d.ndim = 1;
  d.pieces = &one;
  d.npieces = (size_t)WM_MAX_PIECES + 1;
  CHECK_RC(wm_register_param(m, &d, mem, sizeof mem), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "npieces 1048577 is more than the 1048576") != NULL);
  /* A piece whose tensor is NULL: a NULL pointer field, named with its
     param and piece, as every other one. */
  d.npieces = 1;
  CHECK_RC(wm_register_param(m, &d, mem, sizeof mem), WM_ERR_NULL_ARGUMENT);
  CHECK(strstr(last_error(m), "param 'many': piece 0: tensor is NULL") != NULL);
  wm_destroy(m);
  remove_tmpdir();
}

/* Registration stays open through a first update that failed before
   writing a param (a folder that does not exist, nothing registered yet),
   and through an aborted stage; it closes at the first one that succeeds. */
static void test_register_after_failure(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  char missing[600];
  snprintf(missing, sizeof missing, "%s/no-such-folder", tmpdir);
  wm_manager *m = new_manager(tmpdir);
  wm_update_request r;
  wm_update_request_init(&r);
  r.location = missing;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_NOT_FOUND);
  r.location = NULL;
  CHECK(wm_update(m, &r, NULL) != WM_OK); /* nothing registered */
  float w[16] = {0}, b[4] = {0};
  wm_param_desc d;
  desc_w(&d);
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_OK);
  CHECK_RC(wm_stage(m, &r, NULL), WM_ERR_MISMATCH); /* "b" is not registered */
  desc_b(&d);
  CHECK_RC(wm_register_param(m, &d, b, sizeof b), WM_OK);
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  CHECK_RC(wm_abort(m), WM_OK);
  CHECK(w[0] == 0.0f);
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  CHECK(w[0] == 1.0f && b[0] == 101.0f);
  float late[4];
  d.name = "late";
  CHECK_RC(wm_register_param(m, &d, late, sizeof late), WM_ERR_STATE);
  CHECK(strstr(last_error(m), "only before the first update") != NULL);
  wm_destroy(m);
  remove_tmpdir();
}

/* wm_register_params: every param or none. "kept" registered before; a
   batch whose third shares memory with the first (or takes the second's
   name) is refused naming its index, and none of it stays: the batch
   without the clash goes through afterwards (its "a" would otherwise be
   registered already). */
static void test_register_together(void) {
  make_tmpdir();
  wm_manager *m = new_manager(tmpdir);
  static float mem[16];
  uint64_t shape[1] = {4};
  wm_param_desc d[4];
  const char *names[4] = {"kept", "a", "b", "c"};
  for (int i = 0; i < 4; i++) {
    wm_param_desc_init(&d[i]);
    d[i].name = names[i];
    d[i].dtype = WM_DTYPE_F32;
    d[i].shape = shape;
    d[i].ndim = 1;
  }
  CHECK_RC(wm_register_param(m, &d[0], mem + 12, 4 * sizeof(float)), WM_OK);
  wm_param_registration batch[3] = {
      {&d[1], mem, 4 * sizeof(float)},
      {&d[2], mem + 4, 4 * sizeof(float)},
      {&d[3], mem, 4 * sizeof(float)}, /* shares "a"'s memory */
  };
  CHECK_RC(wm_register_params(NULL, batch, 3), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_register_params(m, NULL, 3), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_register_params(m, NULL, 0), WM_OK);
  CHECK_RC(wm_register_params(m, batch, 3), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "param 2 of the 3 registered together (none was registered): param 'c'") != NULL);
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.params == 1);
  batch[2].desc = &d[2]; /* "b" twice */
  batch[2].data = mem + 8;
  CHECK_RC(wm_register_params(m, batch, 3), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "param 'b' is in the batch twice (at 1 and 2)") != NULL);
  batch[1].desc = NULL;
  CHECK_RC(wm_register_params(m, batch, 3), WM_ERR_NULL_ARGUMENT);
  CHECK(strstr(last_error(m), "param 1 of the 3 registered together") != NULL);
  d[2].struct_size = 8;
  batch[1].desc = &d[2];
  CHECK_RC(wm_register_params(m, batch, 3), WM_ERR_STRUCT_SIZE);
  d[2].struct_size = sizeof d[2];
  batch[2].desc = &d[3];
  CHECK_RC(wm_register_params(m, batch, 3), WM_OK);
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.params == 4);
  CHECK_RC(wm_register_param(m, &d[1], mem + 13, 0), WM_ERR_INVALID_ARGUMENT); /* now registered */
  /* Closed after the first clear: an empty batch is refused as any. */
  CHECK_RC(wm_clear(m), WM_OK);
  CHECK_RC(wm_register_params(m, NULL, 0), WM_ERR_STATE);
  CHECK_RC(wm_register_params(m, batch, 0), WM_ERR_STATE);
  wm_destroy(m);
  remove_tmpdir();
}

/* ---------------------------------------------------------- callbacks */

static int log_calls = 0;
static char log_seen[512];
static void on_log(void *user, uint32_t level, const char *message) {
  (void)user;
  if (level == WM_LOG_LEVEL_WARN) {
    log_calls++;
    snprintf(log_seen, sizeof log_seen, "%s", message);
  }
}

typedef struct {
  int calls;
  uint64_t last_done, total;
  int cancel;
} progress_state;
static int32_t on_progress(void *user, const wm_progress *p) {
  progress_state *s = user;
  s->calls++;
  s->last_done = p->bytes_done;
  s->total = p->bytes_total;
  return s->cancel;
}

typedef struct {
  int count;
  float sum;
  int fail_on_b;
} tensor_state;
static int32_t on_tensor(void *user, const wm_tensor_view *t) {
  tensor_state *s = user;
  s->count++;
  if (t->dtype != WM_DTYPE_F32) return 5;
  const float *f = t->data;
  for (size_t i = 0; i < t->len / 4; i++) s->sum += f[i];
  if (s->fail_on_b && strcmp(t->name, "b") == 0) return 3;
  return 0;
}

static int released = 0;
static float spare[16];
static void on_release(void *user, const char *name, void *data, size_t len) {
  (void)user;
  (void)data;
  if (strcmp(name, "w") == 0 && len == 64) released++;
}
static void *on_acquire(void *user, const char *name, void *old, size_t len) {
  (void)user;
  (void)old;
  return (strcmp(name, "w") == 0 && len == 64) ? spare : NULL;
}

static void test_callbacks(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  /* Log callback: an unknown tensor skipped with a warning. */
  wm_config c;
  wm_config_init(&c);
  c.model_dir = tmpdir;
  c.fallback_dir = "";
  c.log_callback = on_log;
  wm_memory_config mem;
  wm_memory_config_init(&mem);
  mem.release_callback = on_release;
  mem.acquire_callback = on_acquire;
  c.memory = &mem;
  wm_manager *m = NULL;
  CHECK_RC(wm_init(&c, &m), WM_OK);
  wm_param_desc d;
  desc_w(&d);
  float w[16];
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_OK);
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_MISMATCH); /* "b" is not registered */
  r.flags = WM_UPDATE_SKIP_UNKNOWN;
  progress_state ps = {0, 0, 0, 0};
  r.progress_callback = on_progress;
  r.progress_user_data = &ps;
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  CHECK(log_calls >= 1 && strstr(log_seen, "'b'") != NULL);
  CHECK(ps.calls >= 1 && ps.last_done == 64 && ps.total == 64);
  ps.cancel = 1;
  r.version = "cancelled";
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_CANCELLED);
  ps.cancel = 0;

  /* Release and acquire callbacks for engine-owned memory. */
  CHECK_RC(wm_clear(m), WM_OK);
  CHECK(released == 1);
  r.version = "after-clear";
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  CHECK(spare[3] == 4.0f); /* written into the memory the acquire callback gave */
  wm_destroy(m);

  /* Tensor callback: every tensor, no registered params needed. */
  m = new_manager(tmpdir);
  tensor_state ts = {0, 0.0f, 0};
  wm_update_request_init(&r);
  r.tensor_callback = on_tensor;
  r.tensor_user_data = &ts;
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  CHECK(ts.count == 2);
  CHECK(ts.sum == (136.0f + 101.0f + 102.0f + 103.0f + 104.0f));
  ts.fail_on_b = 1;
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_CALLBACK);
  CHECK(strstr(last_error(m), "callback returned 3") != NULL);
  wm_destroy(m);
  remove_tmpdir();
}

/* ------------------------------------------------------------ threads */

typedef struct {
  wm_manager *m;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int in_update, release;
  wm_result rc;
} hold_state;

static int32_t hold_progress(void *user, const wm_progress *p) {
  (void)p;
  hold_state *h = user;
  pthread_mutex_lock(&h->mu);
  h->in_update = 1;
  pthread_cond_broadcast(&h->cv);
  while (!h->release) pthread_cond_wait(&h->cv, &h->mu);
  pthread_mutex_unlock(&h->mu);
  return 0;
}

static void *updater(void *arg) {
  hold_state *h = arg;
  wm_update_request r;
  wm_update_request_init(&r);
  r.progress_callback = hold_progress;
  r.progress_user_data = h;
  h->rc = wm_update(h->m, &r, NULL);
  return NULL;
}

/* `h` for an update of `m`, not started. */
static void hold_init(hold_state *h, wm_manager *m) {
  memset(h, 0, sizeof *h);
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  h->m = m;
}

static void hold_done(hold_state *h) {
  pthread_mutex_destroy(&h->mu);
  pthread_cond_destroy(&h->cv);
}

/* Start `updater` for `h` on `t`; returns once its update is held in its
 * progress callback. */
static void hold_update(hold_state *h, pthread_t *t) {
  pthread_create(t, NULL, updater, h);
  pthread_mutex_lock(&h->mu);
  while (!h->in_update) pthread_cond_wait(&h->cv, &h->mu);
  pthread_mutex_unlock(&h->mu);
}

/* Let the update held by `hold_update` go on. */
static void release_update(hold_state *h) {
  pthread_mutex_lock(&h->mu);
  h->release = 1;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

static void test_threads(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  float w[16];
  float *b;
  hold_state h;
  hold_init(&h, example_engine(tmpdir, w, &b));
  pthread_t t;
  hold_update(&h, &t);

  /* While one thread updates: a second update and a clear are refused,
   * status still answers and says UPDATING. */
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(h.m, &r, NULL), WM_ERR_BUSY);
  CHECK_RC(wm_clear(h.m), WM_ERR_BUSY);
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(h.m, &s), WM_OK);
  CHECK(s.state == WM_STATE_UPDATING);

  release_update(&h);
  pthread_join(t, NULL);
  CHECK(h.rc == WM_OK);
  CHECK_RC(wm_status(h.m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && strcmp(s.version, "1") == 0);
  wm_destroy(h.m);
  hold_done(&h);
  remove_tmpdir();
}

static void test_destroyed(void) {
  wm_manager *m = new_manager(NULL);
  wm_destroy(m);
  /* The stale handle is detected, never dereferenced. */
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(m, &s), WM_ERR_INVALID_HANDLE);
  CHECK_RC(wm_clear(m), WM_ERR_INVALID_HANDLE);
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_INVALID_HANDLE);
  int32_t sig;
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_ERR_INVALID_HANDLE);
  wm_destroy(m); /* double destroy: no-op */
  int not_a_manager = 0;
  CHECK_RC(wm_status((const wm_manager *)&not_a_manager, &s), WM_ERR_INVALID_HANDLE);
}

/* The control cell `name` a manager made (one int32 in /dev/shm), mapped;
 * its shm name ("/name", for shm_unlink) goes to `shm_name`. */
static int32_t *map_cell(const char *name, char *shm_name, size_t len) {
  snprintf(shm_name, len, "/%s", name);
  int fd = shm_open(shm_name, O_RDWR, 0);
  CHECK(fd >= 0);
  int32_t *cell = mmap(NULL, 4, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  CHECK(cell != MAP_FAILED);
  close(fd);
  return cell;
}

static void test_signal(void) {
  wm_manager *m = new_manager(NULL);
  int32_t sig = 99;
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_OK);
  CHECK(sig == WM_STATE_NORMAL);
  wm_destroy(m);

  /* A FastDeploy-style control cell: one int32 in /dev/shm. */
  char name[64];
  snprintf(name, sizeof name, "wm_c_harness_cell_%d", (int)getpid());
  wm_config c;
  wm_config_init(&c);
  c.control_cell = name;
  CHECK_RC(wm_init(&c, &m), WM_OK);
  char shm_name[80];
  int32_t *cell = map_cell(name, shm_name, sizeof shm_name);
  CHECK(*cell == 0);
  *cell = WM_STATE_UPDATING;
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_OK);
  CHECK(sig == WM_STATE_UPDATING);
  *cell = 5;
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_ERR_FORMAT);
  CHECK(sig == WM_STATE_UPDATING);
  munmap(cell, 4);
  shm_unlink(shm_name);
  wm_destroy(m);

  /* Several ranks without a group can update but not signal; a group that
   * never meets its peers times out. */
  wm_config_init(&c);
  c.world_size = 4;
  c.rank = 1;
  m = NULL;
  CHECK_RC(wm_init(&c, &m), WM_OK);
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_ERR_STATE);
  CHECK(strstr(last_error(m), "wm_group_config") != NULL);
  wm_destroy(m);
  m = NULL;
  char group[64];
  snprintf(group, sizeof group, "wm_c_lonely_%d", (int)getpid());
  wm_config_init(&c);
  c.world_size = 2;
  wm_group_config g;
  wm_group_config_init(&g);
  g.name = group;
  g.signal_timeout_ms = 200;
  c.group = &g;
  CHECK_RC(wm_init(&c, &m), WM_ERR_TIMEOUT);
  CHECK(m == NULL);
}

/* Two ranks (one per thread) in a group, driven by a controller. */
#define GROUP_STEPS 1500
typedef struct {
  int rank;
  const char *group, *cell;
  int32_t seen[GROUP_STEPS];
  wm_result rc;
  int updates, clears;
} rank_state;

static void *rank_loop(void *arg) {
  rank_state *r = arg;
  wm_config c;
  wm_config_init(&c);
  c.rank = (uint32_t)r->rank;
  c.world_size = 2;
  wm_group_config g;
  wm_group_config_init(&g);
  g.name = r->group;
  g.signal_timeout_ms = 5000;
  c.group = &g;
  c.control_cell = r->cell;
  c.model_dir = tmpdir;
  c.fallback_dir = "";
  wm_manager *m = NULL;
  r->rc = wm_init(&c, &m);
  if (r->rc != WM_OK) return NULL;
  wm_param_desc d;
  desc_w(&d);
  void *p;
  size_t n;
  wm_allocate_param(m, &d, &p, &n);
  desc_b(&d);
  wm_allocate_param(m, &d, &p, &n);
  wm_update_request req;
  wm_update_request_init(&req);
  for (int step = 0; step < GROUP_STEPS && r->rc == WM_OK; step++) {
    int32_t sig;
    r->rc = wm_broadcast_signal(m, &sig);
    r->seen[step] = sig;
    if (sig == WM_STATE_UPDATING) {
      r->updates++;
      r->rc = wm_update(m, &req, NULL);
    } else if (sig == WM_STATE_CLEARING) {
      r->clears++;
      r->rc = wm_clear(m);
    } else {
      nanosleep(&(struct timespec){0, 200000}, NULL);
    }
  }
  if (r->rc != WM_OK) fprintf(stderr, "rank %d: %s\n", r->rank, last_error(m));
  wm_destroy(m);
  return NULL;
}

static void test_group(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  { /* rank 1 reads its own file */
    char a[1024], b[1024], cmd[2200];
    snprintf(a, sizeof a, "%s/model_state.tp0.0.safetensors", tmpdir);
    snprintf(b, sizeof b, "%s/model_state.tp1.0.safetensors", tmpdir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", a, b);
    CHECK(system(cmd) == 0);
  }
  char group[64], cell[64];
  snprintf(group, sizeof group, "wm_c_group_%d", (int)getpid());
  snprintf(cell, sizeof cell, "wm_c_group_cell_%d", (int)getpid());
  static rank_state ranks[2];
  pthread_t threads[2];
  for (int i = 0; i < 2; i++) {
    memset(&ranks[i], 0, sizeof ranks[i]);
    ranks[i].rank = i;
    ranks[i].group = group;
    ranks[i].cell = cell;
    pthread_create(&threads[i], NULL, rank_loop, &ranks[i]);
  }
  wm_controller *ctl = NULL;
  CHECK_RC(wm_controller_open(cell, &ctl), WM_OK);
  uint32_t outcome = 99;
  CHECK_RC(wm_controller_request(ctl, WM_STATE_CLEARING, 5000, &outcome), WM_OK);
  CHECK(outcome == WM_REQUEST_OUTCOME_DONE);
  int32_t state = 99;
  CHECK_RC(wm_controller_get(ctl, &state), WM_OK);
  CHECK(state == WM_STATE_CLEARED);
  CHECK_RC(wm_controller_request(ctl, WM_STATE_CLEARING, 5000, &outcome), WM_OK);
  CHECK(outcome == WM_REQUEST_OUTCOME_ALREADY_DONE);
  CHECK_RC(wm_controller_request(ctl, WM_STATE_UPDATING, 5000, &outcome), WM_OK);
  CHECK(outcome == WM_REQUEST_OUTCOME_DONE);
  CHECK_RC(wm_controller_wait(ctl, WM_STATE_NORMAL, 1000), WM_OK);
  CHECK_RC(wm_controller_request(ctl, 7, 10, &outcome), WM_ERR_INVALID_ARGUMENT);
  char buf[256];
  size_t n = 0;
  CHECK_RC(wm_controller_last_error(ctl, buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "7") != NULL);
  for (int i = 0; i < 2; i++) pthread_join(threads[i], NULL);
  for (int i = 0; i < 2; i++) {
    CHECK(ranks[i].rc == WM_OK);
    CHECK(ranks[i].updates == 1 && ranks[i].clears == 1);
  }
  CHECK(memcmp(ranks[0].seen, ranks[1].seen, sizeof ranks[0].seen) == 0);
  wm_controller_destroy(ctl);
  wm_controller_destroy(ctl); /* no-op */
  CHECK_RC(wm_controller_get(ctl, &state), WM_ERR_INVALID_HANDLE);
  CHECK_RC(wm_controller_open(NULL, &ctl), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_controller_open("bad/name", &ctl), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_controller_open(".", &ctl), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_controller_open("..", &ctl), WM_ERR_INVALID_ARGUMENT);
  shm_unlink(cell[0] == '/' ? cell : (snprintf(buf, sizeof buf, "/%s", cell), buf));
  snprintf(buf, sizeof buf, "/%s.wm_report", cell);
  shm_unlink(buf);
  remove_tmpdir();
}


static void test_publisher(void) {
  make_tmpdir();
  char sock[512];
  snprintf(sock, sizeof sock, "%s/pub.sock", tmpdir);
  wm_publisher_config cfg;
  CHECK_RC(wm_publisher_config_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_config_init(&cfg), WM_OK);
  CHECK(cfg.struct_size == sizeof cfg && cfg.buffers == 2 && cfg.socket_mode == 0600);
  wm_publisher *p = NULL;
  CHECK_RC(wm_publisher_create(NULL, &cfg, &p), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_create(sock, &cfg, NULL), WM_ERR_NULL_ARGUMENT);
  cfg.struct_size = 4;
  CHECK_RC(wm_publisher_create(sock, &cfg, &p), WM_ERR_STRUCT_SIZE);
  wm_publisher_config_init(&cfg);
  cfg.buffers = 0;
  CHECK_RC(wm_publisher_create(sock, &cfg, &p), WM_ERR_INVALID_ARGUMENT);
  CHECK(p == NULL);
  /* Settings out of range, each named; a bucket timeout of 0 is the default. */
  const char *named[] = {"keep_versions", "socket_mode", "bucket_timeout"};
  for (int i = 0; i < 3; i++) {
    wm_publisher_config_init(&cfg);
    if (i == 0) cfg.keep_versions = 0;
    if (i == 1) cfg.socket_mode = 01000777;
    if (i == 2) cfg.bucket_timeout_ms = 8ull * 24 * 3600 * 1000;
    CHECK_RC(wm_publisher_create(sock, &cfg, &p), WM_ERR_INVALID_ARGUMENT);
    char why[256];
    size_t n = 0;
    CHECK_RC(wm_last_create_error(why, sizeof why, &n), WM_OK);
    CHECK(strstr(why, named[i]) != NULL);
  }
  wm_publisher_config_init(&cfg);
  cfg.bucket_timeout_ms = 0;
  CHECK_RC(wm_publisher_create(sock, &cfg, &p), WM_OK);
  wm_publisher_destroy(p);
  p = NULL;
  CHECK_RC(wm_publisher_create(sock, NULL, &p), WM_OK);

  static float w[16];
  uint64_t shape[2] = {4, 4};
  wm_tensor_desc t;
  CHECK_RC(wm_tensor_desc_init(NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_tensor_desc_init(&t), WM_OK);
  CHECK(t.struct_size == sizeof t && t.name == NULL && t.dtype == WM_DTYPE_F32 && t.rank == -1);
  CHECK(t.memory == WM_MEMORY_HOST && t.device_ordinal == -1 && t.global_shape == NULL && t.offset == NULL);
  t.name = "w";
  t.shape = shape;
  t.ndim = 2;
  t.data = w;
  t.len = sizeof w;
  wm_tensor_desc bad = t;
  CHECK_RC(wm_publisher_add(NULL, &t), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add(p, NULL), WM_ERR_NULL_ARGUMENT);
  bad.struct_size = 8;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_STRUCT_SIZE);
  bad = t;
  bad.name = NULL;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_NULL_ARGUMENT);
  bad = t;
  bad.dtype = 99;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_INVALID_ARGUMENT);
  char why[256];
  size_t why_n = 0;
  bad = t;
  bad.shape = NULL; /* a NULL pointer like every other: NULL_ARGUMENT, named */
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_last_error(p, why, sizeof why, &why_n), WM_OK);
  CHECK(strstr(why, "tensor 'w': shape is NULL with ndim 2") != NULL);
  bad = t;
  bad.ndim = 9;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_last_error(p, why, sizeof why, &why_n), WM_OK);
  CHECK(strstr(why, "ndim 9 is more than 8") != NULL);
  bad = t;
  bad.len = sizeof w - 4;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_INVALID_ARGUMENT);
  bad = t;
  bad.data = NULL;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_NULL_ARGUMENT);
  bad = t;
  bad.memory = 7;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_INVALID_ARGUMENT);
  bad = t;
  bad.rank = -2;
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_INVALID_ARGUMENT);
  uint64_t glob[2] = {8, 4};
  bad = t;
  bad.global_shape = glob; /* a shard needs its offset too */
  CHECK_RC(wm_publisher_add(p, &bad), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add(p, &t), WM_OK);
  t.rank = 3;
  CHECK_RC(wm_publisher_add(p, &t), WM_ERR_INVALID_ARGUMENT);
  char buf[256];
  size_t n = 0;
  CHECK_RC(wm_publisher_last_error(p, buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "already published") != NULL);
  /* The deprecated positional calls still work (wrappers of wm_publisher_add). */
  CHECK_RC(wm_publisher_add_tensor(NULL, "w", WM_DTYPE_F32, shape, 2, w, sizeof w, -1), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add_tensor(p, NULL, WM_DTYPE_F32, shape, 2, w, sizeof w, -1), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add_tensor(p, "w", 99, shape, 2, w, sizeof w, -1), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_add_tensor(p, "w2", WM_DTYPE_F32, shape, 2, w, sizeof w, -1), WM_OK);
  CHECK_RC(wm_publisher_add_tensor(p, "w2", WM_DTYPE_F32, shape, 2, w, sizeof w, 3), WM_ERR_INVALID_ARGUMENT);
  wm_shard_placement pl;
  CHECK_RC(wm_shard_placement_init(&pl), WM_OK);
  CHECK_RC(wm_publisher_add_shard(p, "s", WM_DTYPE_F32, shape, 2, NULL, w, sizeof w, -1), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add_shard(p, "s", WM_DTYPE_F32, shape, 2, &pl, w, sizeof w, -1), WM_ERR_NULL_ARGUMENT);
  pl.global_shape = glob;
  uint64_t off[2] = {4, 0};
  pl.offset = off;
  CHECK_RC(wm_publisher_add_shard(p, "s", WM_DTYPE_F32, shape, 2, &pl, w, sizeof w, -1), WM_OK);
  /* The same through the descriptor: another offset of the same global tensor. */
  wm_tensor_desc sh = t;
  uint64_t off0[2] = {0, 0};
  sh.name = "s";
  sh.rank = -1;
  sh.global_shape = glob;
  sh.offset = off0;
  CHECK_RC(wm_publisher_add(p, &sh), WM_OK);
  CHECK_RC(wm_publisher_add(p, &sh), WM_ERR_INVALID_ARGUMENT); /* same offset twice */
  CHECK_RC(wm_publisher_clear(p), WM_OK);
  /* wm_publisher_add_all: every descriptor or none. "kept" published
     before; a batch whose third clashes with it (or with the first) is
     refused naming its index, and none of it stays: the batch without the
     clash goes through afterwards (its "a" would otherwise be there). */
  wm_tensor_desc kept = t, batch[4];
  kept.name = "kept";
  CHECK_RC(wm_publisher_add(p, &kept), WM_OK);
  const char *names[4] = {"a", "b", "kept", "c"};
  for (int i = 0; i < 4; i++) {
    batch[i] = t;
    batch[i].name = names[i];
  }
  CHECK_RC(wm_publisher_add_all(NULL, batch, 4), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add_all(p, NULL, 4), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_add_all(p, NULL, 0), WM_OK);
  CHECK_RC(wm_publisher_add_all(p, batch, 4), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_last_error(p, why, sizeof why, &why_n), WM_OK);
  CHECK(strstr(why, "tensor 2 of the 4 added together (none was added): tensor 'kept': already published") != NULL);
  batch[2].name = "a";
  CHECK_RC(wm_publisher_add_all(p, batch, 4), WM_ERR_INVALID_ARGUMENT);
  batch[1].struct_size = 8; /* read in order: the first bad one is named */
  CHECK_RC(wm_publisher_add_all(p, batch, 4), WM_ERR_STRUCT_SIZE);
  CHECK_RC(wm_publisher_last_error(p, why, sizeof why, &why_n), WM_OK);
  CHECK(strstr(why, "tensor 1 of the 4 added together") != NULL);
  batch[1].struct_size = sizeof batch[1];
  batch[2].name = "d";
  CHECK_RC(wm_publisher_add_all(p, batch, 4), WM_OK);
  CHECK_RC(wm_publisher_add(p, &batch[0]), WM_ERR_INVALID_ARGUMENT); /* now published */
  CHECK_RC(wm_publisher_clear(p), WM_OK);
  /* prepare: nothing added yet is an error naming why; then the buffers of
     keep_versions + 1 (default 2 + 1) versions of the tensors added. */
  uint64_t made = 7;
  CHECK_RC(wm_publisher_prepare(NULL, 0, &made), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_prepare(p, 0, &made), WM_ERR_INVALID_ARGUMENT);
  CHECK(made == 7);
  CHECK_RC(wm_publisher_last_error(p, buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "add the tensors") != NULL);
  t.rank = -1;
  CHECK_RC(wm_publisher_add(p, &t), WM_OK);
  CHECK_RC(wm_publisher_prepare(p, 65, &made), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_prepare(p, 0, &made), WM_OK);
  CHECK(made >= 3 * sizeof w && made % 3 == 0); /* buffers are at least 256 bytes */
  CHECK_RC(wm_publisher_prepare(p, 1, NULL), WM_OK);
  CHECK_RC(wm_publisher_last_error(p, NULL, sizeof buf, &n), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_last_error(p, buf, 0, &n), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_set_version(p, "3"), WM_OK);
  CHECK_RC(wm_publisher_set_version(p, NULL), WM_OK);
  CHECK_RC(wm_publisher_set_dir(p, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_publisher_address(p, buf, sizeof buf, &n), WM_OK);
  CHECK(strcmp(buf, sock) == 0 && n == strlen(sock));
  { /* Too small a buffer: truncated, and the full length says what it needs. */
    char small[8];
    CHECK_RC(wm_publisher_address(p, small, sizeof small, &n), WM_OK);
    CHECK(n == strlen(sock) && strlen(small) == sizeof small - 1 && strncmp(small, sock, 7) == 0);
  }
  { /* len 0: the length alone (buf may be NULL); a NULL buf with room is
       refused, said in the publisher's last error. */
    size_t need = 0;
    CHECK_RC(wm_publisher_address(p, NULL, 0, &need), WM_OK);
    CHECK(need == strlen(sock));
    CHECK_RC(wm_publisher_address(p, NULL, 16, &need), WM_ERR_NULL_ARGUMENT);
    CHECK_RC(wm_publisher_last_error(p, buf, sizeof buf, &n), WM_OK);
    CHECK(strstr(buf, "wm_publisher_address: buf is NULL") != NULL);
    CHECK_RC(wm_publisher_address(p, buf, sizeof buf, NULL), WM_ERR_NULL_ARGUMENT);
  }
  CHECK_RC(wm_publisher_publish(p), WM_ERR_NO_VERSION); /* no version set */

  /* GPU tensors: a host address is never device memory. Without a driver
     the call is unsupported, with one the pointer is refused; either way
     the message names the tensor. */
  CHECK_RC(wm_publisher_add_device_tensor(p, NULL, WM_DTYPE_F32, shape, 2, 1, sizeof w, 0, -1),
           WM_ERR_NULL_ARGUMENT);
  wm_result on_gpu = wm_publisher_add_device_tensor(p, "g", WM_DTYPE_F32, shape, 2,
                                                    (uint64_t)(uintptr_t)w, sizeof w, 0, -1);
  CHECK(on_gpu == WM_ERR_UNSUPPORTED || on_gpu == WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_last_error(p, buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "tensor 'g'") != NULL);
  wm_tensor_desc gd = t;
  gd.name = "g2";
  gd.memory = WM_MEMORY_DEVICE;
  gd.device_ordinal = 0;
  on_gpu = wm_publisher_add(p, &gd);
  CHECK(on_gpu == WM_ERR_UNSUPPORTED || on_gpu == WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_last_error(p, buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "tensor 'g2'") != NULL);

  /* Network publisher: a shared secret is required; the bound port is reported. */
  wm_publisher *np = NULL;
  wm_publisher_config ncfg;
  wm_publisher_config_init(&ncfg);
  CHECK(ncfg.keep_versions == 2 && ncfg.secret == NULL);
  CHECK_RC(wm_publisher_create_net(NULL, &ncfg, &np), WM_ERR_NULL_ARGUMENT);
  if (getenv("WM_NET_SECRET") == NULL) {
    wm_result no_secret = wm_publisher_create_net("127.0.0.1:0", &ncfg, &np);
    CHECK(no_secret == WM_ERR_AUTH || no_secret == WM_ERR_UNSUPPORTED);
  }
  ncfg.secret = "short"; /* a caller's bad value, as wm_init says of the engine's */
  CHECK_RC(wm_publisher_create_net("127.0.0.1:0", &ncfg, &np), WM_ERR_INVALID_ARGUMENT);
  CHECK(np == NULL);
  ncfg.secret = "harness-secret-0123456789";
  /* A malformed address: refused as such (not an I/O failure). */
  CHECK_RC(wm_publisher_create_net("127.0.0.1:99999", &ncfg, &np), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_publisher_create_net("127.0.0.1", &ncfg, &np), WM_ERR_INVALID_ARGUMENT);
  CHECK(np == NULL);
  ncfg.secret = "harness-secret-0123456789";
  wm_result net = wm_publisher_create_net("127.0.0.1:0", &ncfg, &np);
  CHECK(net == WM_OK || net == WM_ERR_UNSUPPORTED); /* UNSUPPORTED: no UCX installed */
  if (net == WM_OK) {
    CHECK_RC(wm_publisher_address(np, buf, sizeof buf, &n), WM_OK);
    CHECK(strncmp(buf, "127.0.0.1:", 10) == 0 && strcmp(buf, "127.0.0.1:0") != 0);
    CHECK_RC(wm_publisher_add(np, &t), WM_OK);
    CHECK_RC(wm_publisher_set_version(np, "1"), WM_OK);
    CHECK_RC(wm_publisher_publish(np), WM_OK);
    wm_publisher_destroy(np);
  }

  wm_serve_stats st;
  st.struct_size = 1;
  CHECK_RC(wm_publisher_serve(p, 1, 50, &st), WM_ERR_STRUCT_SIZE);
  st.struct_size = sizeof st;
  CHECK_RC(wm_publisher_serve(p, 1, 50, &st), WM_ERR_TIMEOUT); /* nobody connects */
  CHECK_RC(wm_publisher_last_error(p, buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "0 of 1") != NULL);
  CHECK_RC(wm_publisher_serve(p, 0, 50, &st), WM_OK);
  CHECK(st.sessions == 0);
  CHECK_RC(wm_publisher_clear(p), WM_OK);
  CHECK_RC(wm_publisher_clear(NULL), WM_ERR_NULL_ARGUMENT);

  wm_publisher_destroy(p);
  CHECK(access(sock, F_OK) != 0); /* the socket file is gone */
  CHECK_RC(wm_publisher_clear(p), WM_ERR_INVALID_HANDLE);
  wm_publisher_destroy(p);
  wm_publisher_destroy(NULL);

  /* Controller NULL paths. */
  wm_controller *ctl = NULL;
  char cell[64];
  snprintf(cell, sizeof cell, "wm_c_ctl_%d", (int)getpid());
  CHECK_RC(wm_controller_open(cell, &ctl), WM_OK);
  int32_t state;
  uint32_t outcome;
  CHECK_RC(wm_controller_get(ctl, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_controller_get(NULL, &state), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_controller_request(ctl, WM_STATE_UPDATING, 10, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_controller_set(ctl, 42), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_controller_set(ctl, WM_STATE_FAILED), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_controller_set(ctl, WM_STATE_CLEARED), WM_OK);
  CHECK_RC(wm_controller_wait(ctl, WM_STATE_NORMAL, 20), WM_ERR_TIMEOUT);
  CHECK_RC(wm_controller_request(ctl, WM_STATE_UPDATING, 20, &outcome), WM_ERR_TIMEOUT); /* no engine */
  CHECK_RC(wm_controller_last_error(ctl, buf, sizeof buf, NULL), WM_ERR_NULL_ARGUMENT);
  wm_controller_destroy(ctl);
  char shm_name[80];
  snprintf(shm_name, sizeof shm_name, "/%s", cell);
  shm_unlink(shm_name);
  remove_tmpdir();
}

/* Issue 15: handle values are never reused, even when the allocator hands a
 * freed manager's memory to the next one. */
static void test_handle_reuse(void) {
  wm_manager *old[8];
  wm_status_info s;
  s.struct_size = sizeof s;
  for (int i = 0; i < 8; i++) {
    old[i] = new_manager(NULL);
    wm_destroy(old[i]);
    wm_manager *fresh = new_manager(NULL);
    for (int j = 0; j <= i; j++) CHECK_RC(wm_status(old[j], &s), WM_ERR_INVALID_HANDLE);
    wm_destroy(fresh);
  }
}

typedef struct {
  wm_manager *m;
  float *w;
  volatile int destroyed;
} destroy_state;

static void *destroyer(void *arg) {
  destroy_state *d = arg;
  wm_destroy(d->m);
  /* The engine may free its memory once wm_destroy returned; poison it as
   * if freed: a later write by the library shows in the check below. */
  memset(d->w, 0xee, 16 * sizeof(float));
  __atomic_store_n(&d->destroyed, 1, __ATOMIC_SEQ_CST);
  return NULL;
}

/* Issue 15: wm_destroy while another thread's update is paused in its
 * progress callback waits for it, and the update (cancelled) writes nothing
 * into engine memory after wm_destroy returned. */
static void test_destroy_in_flight(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  float *w = calloc(16, sizeof(float));
  float *b;
  hold_state h;
  hold_init(&h, example_engine(tmpdir, w, &b));
  pthread_t t, d;
  hold_update(&h, &t);
  destroy_state ds = {h.m, w, 0};
  pthread_create(&d, NULL, destroyer, &ds);
  struct timespec pause = {0, 300 * 1000 * 1000};
  nanosleep(&pause, NULL);
  CHECK(!__atomic_load_n(&ds.destroyed, __ATOMIC_SEQ_CST)); /* still waiting */
  release_update(&h);
  pthread_join(d, NULL);
  pthread_join(t, NULL);
  CHECK(h.rc == WM_ERR_CANCELLED);
  nanosleep(&pause, NULL);
  unsigned char *bytes = (unsigned char *)w;
  int poisoned = 1;
  for (size_t i = 0; i < 16 * sizeof(float); i++) poisoned &= bytes[i] == 0xee;
  CHECK(poisoned);
  free(w);
  hold_done(&h);
  remove_tmpdir();
}

/* wm_shutdown while another thread's update is paused in its progress
 * callback: it returns at once (it does not wait for that update), the
 * update is cancelled when the callback returns and commits nothing (atomic),
 * later updates are refused, and the handle stays valid (status, the last
 * error, library-owned memory) until wm_destroy. */
static void test_shutdown(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  float w[16] = {0};
  float *b;
  hold_state h;
  hold_init(&h, example_engine(tmpdir, w, &b));
  CHECK_RC(wm_shutdown(NULL), WM_ERR_NULL_ARGUMENT);
  pthread_t t;
  hold_update(&h, &t);
  CHECK_RC(wm_shutdown(h.m), WM_OK); /* the update is still held: no wait */
  CHECK_RC(wm_shutdown(h.m), WM_OK); /* idempotent */
  release_update(&h);
  pthread_join(t, NULL);
  CHECK(h.rc == WM_ERR_CANCELLED);
  CHECK(strstr(last_error(h.m), "shut down") != NULL);
  for (int i = 0; i < 16; i++) CHECK(w[i] == 0.0f);
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(h.m, &r, NULL), WM_ERR_CANCELLED);
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(h.m, &s), WM_OK);
  CHECK(s.updates == 0 && s.params == 2);
  b[3] = 5.0f; /* library-owned memory stays mapped */
  CHECK(b[3] == 5.0f);
  wm_destroy(h.m);
  CHECK_RC(wm_shutdown(h.m), WM_ERR_INVALID_HANDLE);

  /* A staged version is dropped: its commit and later stages are refused. */
  char v2[300];
  snprintf(v2, sizeof v2, "%s/v2", tmpdir);
  CHECK(mkdir(v2, 0700) == 0);
  CHECK(fixture_example_model(v2, 5.0f, "2") == 0);
  float w2[16] = {0};
  float *b2 = NULL;
  wm_manager *m2 = example_engine(tmpdir, w2, &b2);
  CHECK_RC(wm_update(m2, &r, NULL), WM_OK);
  r.location = v2;
  CHECK_RC(wm_stage(m2, &r, NULL), WM_OK);
  CHECK_RC(wm_shutdown(m2), WM_OK);
  CHECK_RC(wm_commit(m2, NULL), WM_ERR_CANCELLED);
  CHECK_RC(wm_commit(m2, NULL), WM_ERR_CANCELLED); /* nothing staged: still shut down */
  CHECK_RC(wm_stage(m2, &r, NULL), WM_ERR_CANCELLED);
  CHECK(w2[0] == 1.0f && b2[0] == 101.0f);
  wm_destroy(m2);
  hold_done(&h);
  remove_tmpdir();
}

typedef struct {
  wm_manager *m;
  int calls;
} destroy_in_callback_state;

static int32_t destroy_on_first_tensor(void *user, const wm_tensor_view *t) {
  (void)t;
  destroy_in_callback_state *s = user;
  if (s->calls++ == 0) wm_destroy(s->m);
  return 0;
}

/* wm_destroy from inside the update's own tensor callback: the update stops
 * when that callback returns (no other tensor is handed over), in atomic
 * mode and in place, and returns WM_ERR_CANCELLED. */
static void test_destroy_in_callback(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  for (int in_place = 0; in_place < 2; in_place++) {
    destroy_in_callback_state s = {new_manager(tmpdir), 0};
    wm_update_request r;
    wm_update_request_init(&r);
    r.tensor_callback = destroy_on_first_tensor;
    r.tensor_user_data = &s;
    r.flags = in_place ? WM_UPDATE_IN_PLACE : 0;
    CHECK_RC(wm_update(s.m, &r, NULL), WM_ERR_CANCELLED);
    CHECK(s.calls == 1); /* "w" and "b" both go to the callback otherwise */
    wm_status_info st;
    st.struct_size = sizeof st;
    CHECK_RC(wm_status(s.m, &st), WM_ERR_INVALID_HANDLE);
  }
  remove_tmpdir();
}

/* Calls into the library from the acquire callback of a staged update,
 * which runs on the library's staging thread: each answers at once (they
 * waited for the staging, which waited for them, until its timeout):
 * wm_clear is WM_ERR_BUSY (as from any callback), wm_commit WM_ERR_STATE
 * (nothing staged yet), and wm_destroy returns at once and stops the
 * staging, which wm_stage reports as WM_ERR_CANCELLED. */
typedef struct {
  wm_manager *m;
  int call;
  wm_result got;
} staged_reentry_state;

static void *acquire_and_call(void *user, const char *name, void *old, size_t len) {
  (void)name;
  (void)len;
  staged_reentry_state *s = user;
  wm_update_stats st;
  st.struct_size = sizeof st;
  switch (s->call) {
    case 0: s->got = wm_clear(s->m); break;
    case 1: s->got = wm_commit(s->m, &st); break;
    default: wm_destroy(s->m); break;
  }
  return old;
}

static double seconds_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* A manager over the example snapshot in `tmpdir` with `w` registered as
 * engine-owned param "w" (16 floats), cleared: its next update or stage
 * calls `acquire` (with `user`) first, on the updating thread. */
static wm_manager *cleared_engine(void *(*acquire)(void *, const char *, void *, size_t),
                                  void *user, float *w) {
  wm_config c;
  wm_config_init(&c);
  c.model_dir = tmpdir;
  c.fallback_dir = "";
  wm_memory_config mem;
  wm_memory_config_init(&mem);
  mem.acquire_callback = acquire;
  mem.callback_user_data = user;
  c.memory = &mem;
  wm_manager *m = NULL;
  CHECK_RC(wm_init(&c, &m), WM_OK);
  wm_param_desc d;
  desc_w(&d);
  CHECK_RC(wm_register_param(m, &d, w, 16 * sizeof(float)), WM_OK);
  CHECK_RC(wm_clear(m), WM_OK);
  return m;
}

static void test_staged_acquire_reentry(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  const wm_result want[3] = {WM_ERR_BUSY, WM_ERR_STATE, WM_OK};
  for (int call = 0; call < 3; call++) {
    staged_reentry_state s = {NULL, call, WM_OK};
    float w[16] = {0};
    s.m = cleared_engine(acquire_and_call, &s, w);
    wm_update_request r;
    wm_update_request_init(&r);
    r.flags = WM_UPDATE_SKIP_UNKNOWN;
    r.timeout_ms = 20000;
    double t = seconds_now();
    wm_result staged = wm_stage(s.m, &r, NULL);
    CHECK(seconds_now() - t < 5.0);
    CHECK_RC(s.got, want[call]);
    if (call < 2) {
      CHECK_RC(staged, WM_OK);
      CHECK_RC(wm_abort(s.m), WM_OK);
      wm_destroy(s.m);
    } else {
      CHECK_RC(staged, WM_ERR_CANCELLED);
      wm_status_info st;
      st.struct_size = sizeof st;
      CHECK_RC(wm_status(s.m, &st), WM_ERR_INVALID_HANDLE);
    }
  }
  remove_tmpdir();
}

/* wm_shutdown while a wm_stage runs (held in its acquire callback, on the
 * library's staging thread) returns at once, not when the staging ends; the
 * stage then returns WM_ERR_CANCELLED and the params keep their memory. */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int in_acquire, release;
  wm_manager *m;
  wm_result staged;
} stage_hold_state;

static void *acquire_held(void *user, const char *name, void *old, size_t len) {
  (void)name;
  (void)len;
  stage_hold_state *s = user;
  pthread_mutex_lock(&s->mu);
  s->in_acquire = 1;
  pthread_cond_broadcast(&s->cv);
  while (!s->release) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return old;
}

static void *stager(void *arg) {
  stage_hold_state *s = arg;
  wm_update_request r;
  wm_update_request_init(&r);
  r.flags = WM_UPDATE_SKIP_UNKNOWN;
  r.timeout_ms = 20000;
  s->staged = wm_stage(s->m, &r, NULL);
  return NULL;
}

static void test_shutdown_during_stage(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  stage_hold_state s;
  memset(&s, 0, sizeof s);
  pthread_mutex_init(&s.mu, NULL);
  pthread_cond_init(&s.cv, NULL);
  float w[16] = {0};
  s.m = cleared_engine(acquire_held, &s, w);
  pthread_t t;
  pthread_create(&t, NULL, stager, &s);
  pthread_mutex_lock(&s.mu);
  while (!s.in_acquire) pthread_cond_wait(&s.cv, &s.mu);
  pthread_mutex_unlock(&s.mu);
  double t0 = seconds_now();
  CHECK_RC(wm_shutdown(s.m), WM_OK); /* returns while the callback still holds the stage */
  CHECK(seconds_now() - t0 < 5.0);   /* (it waited for the staging, which waited here) */
  pthread_mutex_lock(&s.mu);
  s.release = 1;
  pthread_cond_broadcast(&s.cv);
  pthread_mutex_unlock(&s.mu);
  pthread_join(t, NULL);
  CHECK_RC(s.staged, WM_ERR_CANCELLED);
  CHECK(strstr(last_error(s.m), "shutdown") != NULL);
  CHECK_RC(wm_commit(s.m, NULL), WM_ERR_CANCELLED);
  wm_destroy(s.m);
  pthread_mutex_destroy(&s.mu);
  pthread_cond_destroy(&s.cv);
  remove_tmpdir();
}

/* Issue 15: a failed create call leaves its reason for wm_last_create_error. */
static void test_create_error(void) {
  make_tmpdir();
  char path[512];
  snprintf(path, sizeof path, "%s/regular-file", tmpdir);
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (f) fclose(f);
  wm_publisher *p = NULL;
  CHECK_RC(wm_publisher_create(path, NULL, &p), WM_ERR_INVALID_ARGUMENT);
  CHECK(p == NULL);
  char buf[512];
  size_t n = 0;
  CHECK_RC(wm_last_create_error(buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "not a socket") != NULL && n == strlen(buf));
  CHECK_RC(wm_last_create_error(NULL, sizeof buf, &n), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_last_create_error(buf, 0, &n), WM_ERR_INVALID_ARGUMENT);
  /* A NULL argument is the next failure's reason, not the last one's. */
  CHECK_RC(wm_publisher_create(NULL, NULL, &p), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_last_create_error(buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "'socket_path' is NULL") != NULL);
  /* An empty socket path says so. */
  CHECK_RC(wm_publisher_create("", NULL, &p), WM_ERR_INVALID_ARGUMENT);
  CHECK_RC(wm_last_create_error(buf, sizeof buf, &n), WM_OK);
  CHECK(strstr(buf, "socket path is empty") != NULL);
  wm_manager *m = new_manager(NULL); /* a success clears it */
  CHECK_RC(wm_last_create_error(buf, sizeof buf, &n), WM_OK);
  CHECK(n == 0 && buf[0] == 0);
  wm_destroy(m);
  remove_tmpdir();
}

/* Two-phase updates: stage (params untouched), commit, abort; misuse. */
static void test_two_phase(void) {
  make_tmpdir();
  char v2[300];
  snprintf(v2, sizeof v2, "%s/v2", tmpdir);
  CHECK(mkdir(v2, 0700) == 0);
  CHECK(fixture_example_model(tmpdir, 1.0f, "1") == 0);
  CHECK(fixture_example_model(v2, 5.0f, "2") == 0);
  float w[16] = {0};
  float *b = NULL;
  wm_manager *m = example_engine(tmpdir, w, &b);
  wm_update_request r;
  wm_update_request_init(&r);
  wm_update_stats st;
  st.struct_size = sizeof st;
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);

  /* Nothing staged yet. */
  CHECK_RC(wm_commit(m, &st), WM_ERR_STATE);
  CHECK_RC(wm_abort(m), WM_ERR_STATE);
  CHECK_RC(wm_stage(NULL, &r, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_stage(m, NULL, NULL), WM_ERR_NULL_ARGUMENT);

  /* Stage: the params still hold version 1. */
  r.location = v2;
  CHECK_RC(wm_stage(m, &r, &st), WM_OK);
  CHECK(strcmp(st.version, "2") == 0 && st.tensors == 0);
  CHECK(w[0] == 1.0f && b[0] == 101.0f);
  wm_status_info s;
  s.struct_size = sizeof s;
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_UPDATING && strcmp(s.version, "1") == 0);
  CHECK_RC(wm_stage(m, &r, NULL), WM_ERR_STATE);   /* one at a time */
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_BUSY);   /* until commit or abort */
  CHECK(strstr(last_error(m), "staged") != NULL);

  /* Commit: version 2 everywhere. */
  CHECK_RC(wm_commit(m, &st), WM_OK);
  CHECK(strcmp(st.version, "2") == 0 && st.tensors == 2 && st.bytes == 80);
  CHECK(w[0] == 5.0f && b[0] == 105.0f);
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && strcmp(s.version, "2") == 0);
  CHECK_RC(wm_commit(m, NULL), WM_ERR_STATE);      /* committed already */

  /* Abort: version 2 stays. */
  r.location = NULL;
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  CHECK_RC(wm_abort(m), WM_OK);
  CHECK(w[0] == 5.0f && b[0] == 105.0f);
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.state == WM_STATE_NORMAL && strcmp(s.version, "2") == 0);

  /* Refused requests: in place, callbacks. Nothing staged after them. */
  r.flags = WM_UPDATE_IN_PLACE;
  CHECK_RC(wm_stage(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  r.flags = 0;
  r.progress_callback = on_progress;
  CHECK_RC(wm_stage(m, &r, NULL), WM_ERR_INVALID_ARGUMENT);
  r.progress_callback = NULL;
  CHECK_RC(wm_abort(m), WM_ERR_STATE);

  /* A clear drops a staged version; the commit says so. */
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  CHECK_RC(wm_clear(m), WM_OK);
  /* The clear succeeded: the dropped stage is no failed call (yet). */
  CHECK_RC(wm_status(m, &s), WM_OK);
  CHECK(s.last_result != WM_ERR_CANCELLED);
  CHECK_RC(wm_commit(m, NULL), WM_ERR_CANCELLED);
  CHECK(strstr(last_error(m), "clear") != NULL);
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  CHECK(w[0] == 1.0f && b[0] == 101.0f);
  /* Once a later update succeeded, nothing is staged (as wm_abort says),
     not "dropped by a clear". */
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  CHECK_RC(wm_clear(m), WM_OK);
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  CHECK_RC(wm_commit(m, NULL), WM_ERR_STATE);
  CHECK(strstr(last_error(m), "nothing is staged") != NULL);
  CHECK_RC(wm_abort(m), WM_ERR_STATE);

  /* Destroy with a version staged: aborted, nothing leaks (ASan). */
  r.location = v2;
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  wm_destroy(m);

  /* Shut down with a version staged: every later update, stage and
     commit is WM_ERR_CANCELLED at once (the staging ends a moment later,
     on its own thread), and the params keep version 1. */
  float w3[16] = {0};
  float *b3 = NULL;
  m = example_engine(tmpdir, w3, &b3);
  r.location = NULL;
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  r.location = v2;
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  CHECK_RC(wm_shutdown(m), WM_OK);
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_CANCELLED);
  CHECK(strstr(last_error(m), "shut down") != NULL);
  CHECK_RC(wm_stage(m, &r, NULL), WM_ERR_CANCELLED);
  CHECK_RC(wm_commit(m, NULL), WM_ERR_CANCELLED);
  CHECK(w3[0] == 1.0f && b3[0] == 101.0f);
  wm_destroy(m);
  remove_tmpdir();
}

/* Deltas over IPC: a publisher keeps versions 1 and 2 of "w" and "b"
 * (one element of "w" changed); the engine at version 1 takes version 2 as
 * deltas (wm_update_delta_stats says so), then asks for whole. */
typedef struct {
  wm_publisher *p;
  int sessions;
} serving;

static void *serve_sessions(void *arg) {
  serving *s = arg;
  CHECK_RC(wm_publisher_serve(s->p, (uint32_t)s->sessions, 30000, NULL), WM_OK);
  return NULL;
}

/* A publisher on `sock` (tmpdir/p.sock, written there). */
static wm_publisher *ipc_publisher(char *sock, size_t n) {
  snprintf(sock, n, "%s/p.sock", tmpdir);
  wm_publisher_config pc;
  wm_publisher_config_init(&pc);
  wm_publisher *p = NULL;
  CHECK_RC(wm_publisher_create(sock, &pc, &p), WM_OK);
  return p;
}

/* Add f32 tensor `name` of `shape` (`ndim` dims) at `data`, `len` bytes. */
static void add_f32(wm_publisher *p, const char *name, const uint64_t *shape, size_t ndim,
                    const float *data, size_t len) {
  wm_tensor_desc t;
  wm_tensor_desc_init(&t);
  t.name = name;
  t.dtype = WM_DTYPE_F32;
  t.shape = shape;
  t.ndim = ndim;
  t.data = data;
  t.len = len;
  CHECK_RC(wm_publisher_add(p, &t), WM_OK);
}

static void test_deltas(void) {
  make_tmpdir();
  char sock[300];
  wm_publisher *p = ipc_publisher(sock, sizeof sock);
  static float w1[16], w2[16], b1[4];
  for (int i = 0; i < 16; i++) w1[i] = w2[i] = (float)i;
  w2[5] = 55.0f;
  for (int i = 0; i < 4; i++) b1[i] = 100.0f + (float)i;
  const float *ws[2] = {w1, w2};
  for (int v = 0; v < 2; v++) {
    CHECK_RC(wm_publisher_clear(p), WM_OK);
    add_f32(p, "w", w_shape, 2, ws[v], sizeof w1);
    add_f32(p, "b", b_shape, 1, b1, sizeof b1);
    CHECK_RC(wm_publisher_set_version(p, v == 0 ? "1" : "2"), WM_OK);
    CHECK_RC(wm_publisher_publish(p), WM_OK);
  }
  serving s = {p, 3};
  pthread_t t;
  pthread_create(&t, NULL, serve_sessions, &s);
  float w[16] = {0};
  float *b = NULL;
  wm_manager *m = example_engine(NULL, w, &b);
  wm_delta_stats d;
  d.struct_size = 1;
  CHECK_RC(wm_update_delta_stats(m, &d), WM_ERR_STRUCT_SIZE);
  CHECK_RC(wm_update_delta_stats(m, NULL), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_update_delta_stats(NULL, &d), WM_ERR_NULL_ARGUMENT);
  d.struct_size = sizeof d;
  CHECK_RC(wm_update_delta_stats(m, &d), WM_OK); /* before any update: zeros */
  CHECK(d.runs_delta == 0 && d.wire_bytes == 0 && d.fallback == WM_DELTA_FALLBACK_NONE);

  wm_update_request r;
  wm_update_request_init(&r);
  r.source = WM_SOURCE_IPC;
  r.location = sock;
  r.version = "1";
  wm_update_stats st;
  st.struct_size = sizeof st;
  CHECK_RC(wm_update(m, &r, &st), WM_OK); /* IPC takes deltas when asked */
  CHECK_RC(wm_update_delta_stats(m, &d), WM_OK);
  CHECK(d.fallback == WM_DELTA_FALLBACK_NOT_ASKED && d.runs_delta == 0 && d.wire_bytes == 80);
  r.flags = WM_UPDATE_WHOLE | WM_UPDATE_DELTAS;
  CHECK_RC(wm_update(m, &r, &st), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "WM_UPDATE_WHOLE and WM_UPDATE_DELTAS") != NULL);

  r.flags = WM_UPDATE_DELTAS;
  r.version = "2";
  CHECK_RC(wm_update(m, &r, &st), WM_OK);
  CHECK(w[5] == 55.0f && w[4] == 4.0f && b[3] == 103.0f);
  CHECK_RC(wm_update_delta_stats(m, &d), WM_OK);
  CHECK(d.fallback == WM_DELTA_FALLBACK_NONE && d.runs_delta == 2 && d.runs_whole == 0);
  CHECK(d.wire_bytes < st.bytes && d.rewritten_bytes == 4 && strcmp(d.base_version, "1") == 0);

  r.version = "1";
  r.flags = WM_UPDATE_WHOLE;
  CHECK_RC(wm_update(m, &r, &st), WM_OK);
  CHECK(w[5] == 5.0f);
  CHECK_RC(wm_update_delta_stats(m, &d), WM_OK);
  CHECK(d.fallback == WM_DELTA_FALLBACK_REFUSED && d.runs_delta == 0 && d.runs_whole == 2);
  CHECK(d.wire_bytes == st.bytes);
  r.flags = 1u << 30; /* unknown flag */
  CHECK_RC(wm_update(m, &r, &st), WM_ERR_INVALID_ARGUMENT);
  pthread_join(t, NULL);
  wm_destroy(m);
  wm_publisher_destroy(p);
  remove_tmpdir();
}

/* Two-phase under a control cell: UPDATING, stage, the signal says
 * UPDATING until the vote saw the staged version, then COMMIT; the commit
 * moves the word to NORMAL. */
static void test_two_phase_signal(void) {
  make_tmpdir();
  CHECK(fixture_example_model(tmpdir, 3.0f, "7") == 0);
  char name[64];
  snprintf(name, sizeof name, "wm_c_harness_2p_%d", (int)getpid());
  wm_config c;
  wm_config_init(&c);
  c.control_cell = name;
  c.model_dir = tmpdir;
  c.fallback_dir = "";
  wm_manager *m = NULL;
  CHECK_RC(wm_init(&c, &m), WM_OK);
  float w[16] = {0};
  wm_param_desc d;
  desc_w(&d);
  CHECK_RC(wm_register_param(m, &d, w, sizeof w), WM_OK);
  char shm_name[80];
  int32_t *cell = map_cell(name, shm_name, sizeof shm_name);
  *cell = WM_STATE_UPDATING;
  int32_t sig = 99;
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_OK);
  CHECK(sig == WM_STATE_UPDATING);
  wm_update_request r;
  wm_update_request_init(&r);
  r.flags = WM_UPDATE_SKIP_UNKNOWN; /* the model's "b" is not registered */
  CHECK_RC(wm_stage(m, &r, NULL), WM_OK);
  int steps = 0;
  do {
    CHECK_RC(wm_broadcast_signal(m, &sig), WM_OK);
    steps++;
  } while (sig == WM_STATE_UPDATING && steps < 10);
  CHECK(sig == WM_STATE_COMMIT && w[0] == 0.0f);
  CHECK_RC(wm_commit(m, NULL), WM_OK);
  CHECK(w[0] == 3.0f && *cell == WM_STATE_NORMAL);
  CHECK_RC(wm_broadcast_signal(m, &sig), WM_OK);
  CHECK(sig == WM_STATE_NORMAL);
  munmap(cell, 4);
  shm_unlink(shm_name);
  wm_destroy(m);
  remove_tmpdir();
}

/* Quantized params: an f32 snapshot into an FP8 param with 128x128 block
 * scales, values chosen so the expected bytes are known exactly (amax
 * 256: factor 448/256 = 1.75, so 256 -> 448 = 0x7E, 128 -> 224 = 0x76);
 * misuse refused; a NaN fails the update naming the element, weights kept. */
static void test_quantized(void) {
  make_tmpdir();
  static float v1[130 * 129];
  memset(v1, 0, sizeof v1);
  v1[0] = 256.0f;
  v1[1] = 128.0f;
  v1[128 * 129 + 128] = -256.0f; /* block (1, 1): 2 rows by 1 column */
  fixture_tensor ts[1] = {{"w", {130, 129}, 2, v1}};
  char path[1024];
  snprintf(path, sizeof path, "%s/model_state.tp0.0.safetensors", tmpdir);
  CHECK(fixture_write(path, ts, 1) == 0);
  CHECK(fixture_write_version(tmpdir, "1") == 0);
  wm_manager *m = new_manager(tmpdir);
  uint64_t shape[2] = {130, 129}, scales_shape[2] = {2, 2};
  wm_param_desc d;
  wm_param_desc_init(&d);
  d.name = "w";
  d.dtype = WM_DTYPE_F8E4M3;
  d.shape = shape;
  d.ndim = 2;
  void *q = NULL, *s = NULL;
  size_t n = 0;
  CHECK_RC(wm_allocate_param(m, &d, &q, &n), WM_OK);
  d.name = "w.scale_inv";
  d.dtype = WM_DTYPE_F32;
  d.shape = scales_shape;
  CHECK_RC(wm_allocate_param(m, &d, &s, &n), WM_OK);
  CHECK_RC(wm_quantize_param(NULL, "w", "w.scale_inv", WM_QUANT_SCHEME_FP8_BLOCK128), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_quantize_param(m, NULL, "w.scale_inv", WM_QUANT_SCHEME_FP8_BLOCK128), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_quantize_param(m, "w", NULL, WM_QUANT_SCHEME_FP8_BLOCK128), WM_ERR_NULL_ARGUMENT);
  CHECK_RC(wm_quantize_param(m, "w", "w.scale_inv", 7), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "scheme 7 is not a wm_quant_scheme") != NULL);
  CHECK_RC(wm_quantize_param(m, "w", "w.scale_inv", WM_QUANT_SCHEME_FP8_TENSOR), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(m), "must be f32 [1], not f32 [2, 2]") != NULL);
  CHECK_RC(wm_quantize_param(m, "w", "nope", WM_QUANT_SCHEME_FP8_BLOCK128), WM_ERR_NOT_FOUND);
  CHECK_RC(wm_quantize_param(m, "w", "w.scale_inv", WM_QUANT_SCHEME_FP8_BLOCK128), WM_OK);

  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  const uint8_t *fp8 = q;
  const float *scale = s;
  size_t nonzero = 0;
  for (size_t i = 0; i < 130 * 129; i++) nonzero += fp8[i] != 0;
  CHECK(fp8[0] == 0x7E && fp8[1] == 0x76 && fp8[128 * 129 + 128] == 0xFE && nonzero == 3);
  CHECK(scale[0] == 256.0f / 448.0f && scale[3] == 256.0f / 448.0f);
  CHECK(scale[1] == 1e-4f / 448.0f && scale[2] == 1e-4f / 448.0f);
  CHECK_RC(wm_quantize_param(m, "w", "w.scale_inv", WM_QUANT_SCHEME_FP8_BLOCK128), WM_ERR_STATE);
  CHECK(strstr(last_error(m), "param 'w' (quantized, its scales in 'w.scale_inv')") != NULL);

  v1[5] = NAN;
  CHECK(fixture_write(path, ts, 1) == 0);
  CHECK(fixture_write_version(tmpdir, "2") == 0);
  CHECK_RC(wm_update(m, &r, NULL), WM_ERR_FORMAT);
  CHECK(strstr(last_error(m), "element [0, 5] of tensor 'w' is NaN") != NULL);
  CHECK(fp8[0] == 0x7E && fp8[1] == 0x76 && scale[0] == 256.0f / 448.0f);
  wm_destroy(m);
  remove_tmpdir();
}

/* MXFP8 from a snapshot: an E8M0 scale byte per 32 elements of a row (u8
 * scales; f32 ones are refused naming the dtype), a partial block at the
 * row's end, an all-zero block, saturation at 448. */
static void test_mxfp8(void) {
  make_tmpdir();
  static float v[3 * 70];
  memset(v, 0, sizeof v);
  v[0] = 1.0f;              /* block 0 of row 0: amax 1 -> e = -8, byte 119 */
  v[1] = 0.5f;
  v[2 * 70 + 65] = -500.0f; /* the partial block of row 2: e = 0, saturates */
  fixture_tensor ts[1] = {{"x", {3, 70}, 2, v}};
  char path[1024];
  snprintf(path, sizeof path, "%s/model_state.tp0.0.safetensors", tmpdir);
  CHECK(fixture_write(path, ts, 1) == 0);
  CHECK(fixture_write_version(tmpdir, "1") == 0);
  uint64_t shape[2] = {3, 70}, scales_shape[2] = {3, 3};
  wm_param_desc d;
  wm_param_desc_init(&d);
  d.shape = shape;
  d.ndim = 2;
  void *q = NULL, *s = NULL;
  size_t n = 0;

  wm_manager *f32_scales = new_manager(tmpdir);
  d.name = "x";
  d.dtype = WM_DTYPE_F8E4M3;
  CHECK_RC(wm_allocate_param(f32_scales, &d, &q, &n), WM_OK);
  d.name = "x.scale";
  d.dtype = WM_DTYPE_F32;
  d.shape = scales_shape;
  CHECK_RC(wm_allocate_param(f32_scales, &d, &s, &n), WM_OK);
  CHECK_RC(wm_quantize_param(f32_scales, "x", "x.scale", WM_QUANT_SCHEME_MXFP8), WM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(last_error(f32_scales), "must be u8 [3, 3], not f32 [3, 3]") != NULL);
  wm_destroy(f32_scales);

  wm_manager *m = new_manager(tmpdir);
  d.name = "x";
  d.dtype = WM_DTYPE_F8E4M3;
  d.shape = shape;
  CHECK_RC(wm_allocate_param(m, &d, &q, &n), WM_OK);
  d.name = "x.scale";
  d.dtype = WM_DTYPE_U8;
  d.shape = scales_shape;
  CHECK_RC(wm_allocate_param(m, &d, &s, &n), WM_OK);
  CHECK_RC(wm_quantize_param(m, "x", "x.scale", WM_QUANT_SCHEME_MXFP8), WM_OK);
  wm_update_request r;
  wm_update_request_init(&r);
  CHECK_RC(wm_update(m, &r, NULL), WM_OK);
  const uint8_t *fp8 = q, *e8m0 = s;
  size_t nonzero = 0;
  for (size_t i = 0; i < 3 * 70; i++) nonzero += fp8[i] != 0;
  /* 1.0 * 2^8 = 256 (0x78), 0.5 * 2^8 = 128 (0x70), -500 -> -448 (0xFE). */
  CHECK(fp8[0] == 0x78 && fp8[1] == 0x70 && fp8[2 * 70 + 65] == 0xFE && nonzero == 3);
  CHECK(e8m0[0] == 119 && e8m0[1] == 0 && e8m0[2] == 0);
  CHECK(e8m0[2 * 3 + 2] == 127 && e8m0[2 * 3] == 0);
  wm_destroy(m);
  remove_tmpdir();
}

/* An FP8 engine param taking deltas of its FP8 bytes from a publisher of
 * f32 versions: the second version comes as a delta (one element moved),
 * and its bytes and scales are those a whole update of it gives. */
static wm_manager *fp8_engine(void **q, void **s) {
  wm_manager *m = new_manager(tmpdir);
  uint64_t shape[2] = {130, 129}, scales_shape[2] = {2, 2};
  wm_param_desc d;
  wm_param_desc_init(&d);
  d.name = "w";
  d.dtype = WM_DTYPE_F8E4M3;
  d.shape = shape;
  d.ndim = 2;
  size_t n = 0;
  CHECK_RC(wm_allocate_param(m, &d, q, &n), WM_OK);
  d.name = "w.scale_inv";
  d.dtype = WM_DTYPE_F32;
  d.shape = scales_shape;
  CHECK_RC(wm_allocate_param(m, &d, s, &n), WM_OK);
  CHECK_RC(wm_quantize_param(m, "w", "w.scale_inv", WM_QUANT_SCHEME_FP8_BLOCK128), WM_OK);
  return m;
}

static void test_quantized_deltas(void) {
  make_tmpdir();
  char sock[300];
  wm_publisher *p = ipc_publisher(sock, sizeof sock);
  static float v1[130 * 129], v2[130 * 129];
  for (int i = 0; i < 130 * 129; i++) v1[i] = v2[i] = (float)(i % 97 - 48) * 0.5f;
  v2[7] = 10.0f; /* inside block (0, 0), below its amax (24) */
  static const uint64_t shape[2] = {130, 129};
  const float *vs[2] = {v1, v2};
  for (int v = 0; v < 2; v++) {
    CHECK_RC(wm_publisher_clear(p), WM_OK);
    add_f32(p, "w", shape, 2, vs[v], sizeof v1);
    CHECK_RC(wm_publisher_set_version(p, v == 0 ? "1" : "2"), WM_OK);
    CHECK_RC(wm_publisher_publish(p), WM_OK);
  }
  serving sv = {p, 3};
  pthread_t th;
  pthread_create(&th, NULL, serve_sessions, &sv);
  void *q = NULL, *s = NULL, *q2 = NULL, *s2 = NULL;
  wm_manager *m = fp8_engine(&q, &s);
  wm_update_request r;
  wm_update_request_init(&r);
  r.source = WM_SOURCE_IPC;
  r.location = sock;
  r.version = "1";
  r.flags = WM_UPDATE_DELTAS;
  wm_update_stats st;
  st.struct_size = sizeof st;
  wm_delta_stats d;
  d.struct_size = sizeof d;
  CHECK_RC(wm_update(m, &r, &st), WM_OK);
  CHECK(st.bytes == 130 * 129 + 2 * 2 * 4); /* the FP8 bytes (the wire's) and their 2x2 f32 scales */
  static uint8_t before[130 * 129];
  memcpy(before, q, sizeof before);
  r.version = "2";
  CHECK_RC(wm_update(m, &r, &st), WM_OK);
  CHECK_RC(wm_update_delta_stats(m, &d), WM_OK);
  CHECK(d.fallback == WM_DELTA_FALLBACK_NONE && d.runs_delta == 1 && d.runs_whole == 0);
  CHECK(d.wire_bytes < 100 && strcmp(d.base_version, "1") == 0);
  size_t moved = 0;
  for (size_t i = 0; i < sizeof before; i++) moved += before[i] != ((uint8_t *)q)[i];
  CHECK(moved == 1 && before[7] != ((uint8_t *)q)[7]);
  /* The same version taken whole by another engine: the same bytes. */
  wm_manager *whole = fp8_engine(&q2, &s2);
  r.flags = WM_UPDATE_WHOLE;
  CHECK_RC(wm_update(whole, &r, &st), WM_OK);
  CHECK(memcmp(q, q2, 130 * 129) == 0 && memcmp(s, s2, 4 * sizeof(float)) == 0);
  pthread_join(th, NULL);
  wm_destroy(whole);
  wm_destroy(m);
  wm_publisher_destroy(p);
  remove_tmpdir();
}

static void test_static_link(void) {
#ifdef WM_STATIC_BUILD
  printf("linked statically\n");
#endif
  CHECK(wm_version() != NULL);
}

int main(int argc, char **argv) {
  struct {
    const char *name;
    void (*fn)(void);
  } tests[] = {
      {"version", test_version},     {"null_args", test_null_args}, {"struct_size", test_struct_size},
      {"enums", test_enums},         {"lifecycle", test_lifecycle}, {"failures", test_failures},
      {"register_together", test_register_together},
      {"register_after_failure", test_register_after_failure},
      {"callbacks", test_callbacks}, {"threads", test_threads},     {"destroyed", test_destroyed},
      {"signal", test_signal},       {"static_link", test_static_link}, {"group", test_group}, {"publisher", test_publisher},
      {"handle_reuse", test_handle_reuse}, {"destroy_in_flight", test_destroy_in_flight},
      {"shutdown", test_shutdown},
      {"shutdown_during_stage", test_shutdown_during_stage},
      {"destroy_in_callback", test_destroy_in_callback},
      {"staged_acquire_reentry", test_staged_acquire_reentry},
      {"create_error", test_create_error}, {"two_phase", test_two_phase},
      {"two_phase_signal", test_two_phase_signal}, {"deltas", test_deltas},
      {"quantized", test_quantized}, {"quantized_deltas", test_quantized_deltas}, {"mxfp8", test_mxfp8},
  };
  size_t n = sizeof tests / sizeof tests[0];
  int ran = 0;
  for (size_t i = 0; i < n; i++) {
    if (argc < 2 || strcmp(argv[1], tests[i].name) == 0) {
      tests[i].fn();
      ran++;
    }
  }
  if (ran == 0) {
    fprintf(stderr, "unknown test '%s'\n", argv[1]);
    return 2;
  }
  printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
