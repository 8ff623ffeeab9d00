// One rank of the RL example's native engine: plain C++17, only
// weight_manager.h and the library. It registers one float32 buffer per
// tensor of the trainer's model (examples/rl/model.py, same names), joins a
// group of ranks on this node with a control cell, and runs the worker loop:
// every step it asks for the signal; UPDATING: pull the new version from the
// trainer (IPC or rdma, atomic); CLEARING: clear and exit; otherwise serve one
// step, i.e. run the model's forward pass on its registered params for the
// fixed probes and a greedy continuation. Updates are two-phase: on
// UPDATING the next version stages (wm_stage, on a side thread) while this
// thread keeps generating from the old weights and asking for the signal;
// when every rank staged it the signal says COMMIT, at the same step on
// every rank, and wm_commit switches before the next forward pass.
// OUT/rank<R>.updates records the staging time, the pause and the tokens
// generated while staging.
//
// Every distinct output it computes is appended to OUT/rank<R>.bin, tagged
// with the version wm_status reports for the params it computed with (see
// Record below); every update's statistics go to OUT/rank<R>.updates. Both
// ranks hold the whole model (replicated): tensor-parallel slices come with
// sharded transfer.
//
// With --weights fp8 every 2-D weight is held in FP8 E4M3 with 128x128
// block scales (an F8E4M3 param and an F32 `<name>.scale_inv` param,
// declared with wm_quantize_param): the trainer's float32 weights are
// quantized by its publisher on the way, and the forward pass computes with
// the FP8 values times their scales (dequantized once per version).
//
// usage: rl_engine --rank R --world N --group NAME --cell CELL
//                  --source ipc|rdma --location SOCKET|HOST:PORT --out DIR
//                  [--deadline-s S] [--weights f32|fp8]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "weight_manager.h"

namespace {

// The model's sizes and probes: model.py's VOCAB, D_MODEL, ... and
// probe_inputs() / PROMPT. A mismatch shows as outputs that disagree.
constexpr int kVocab = 64, kDim = 64, kLayers = 2, kHeads = 4, kContext = 32;
constexpr int kHeadDim = kDim / kHeads, kHidden = 4 * kDim;
constexpr int kProbes = 2, kPrompt = 8, kGenerate = kContext - kPrompt;
constexpr float kLnEps = 1e-5f;

// One output record, as run.py reads it (numpy structured dtype).
struct Record {
  char version[WM_VERSION_BUF];
  float logits[kProbes][kContext][kVocab];
  int32_t continuation[kGenerate];
};

struct Options {
  int rank = 0, world = 2;
  std::string group, cell, source, location, out;
  double deadline_s = 120;
  bool fp8 = false;
};

[[noreturn]] void usage(const char *why) {
  std::fprintf(stderr, "rl_engine: %s\nusage: rl_engine --rank R --world N --group NAME --cell CELL "
                       "--source ipc|rdma --location WHERE --out DIR [--deadline-s S] [--weights f32|fp8]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char **argv) {
  Options o;
  std::map<std::string, std::string> kv;
  static const char *known[] = {"--rank",     "--world", "--group",      "--cell",   "--source",
                                 "--location", "--out",   "--deadline-s", "--weights"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::find_if(std::begin(known), std::end(known),
                     [&](const char *k) { return std::strcmp(k, argv[i]) == 0; }) == std::end(known))
      usage((std::string("unknown option ") + argv[i]).c_str());
    kv[argv[i]] = argv[i + 1];
  }
  if (argc % 2 == 0) usage("options come in --name value pairs");
  auto need = [&](const char *k) {
    auto it = kv.find(k);
    if (it == kv.end()) usage((std::string("missing ") + k).c_str());
    return it->second;
  };
  // A whole number or a number, all of the text (atoi read "zero" as 0).
  auto integer = [&](const char *k) {
    std::string v = need(k);
    char *end = nullptr;
    long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < INT32_MIN || x > INT32_MAX)
      usage((std::string(k) + " " + v + ": not a whole number").c_str());
    return static_cast<int>(x);
  };
  o.rank = integer("--rank");
  o.world = integer("--world");
  o.group = need("--group");
  o.cell = need("--cell");
  o.source = need("--source");
  o.location = need("--location");
  o.out = need("--out");
  if (kv.count("--deadline-s")) {
    std::string v = kv["--deadline-s"];
    char *end = nullptr;
    o.deadline_s = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(o.deadline_s > 0) || !std::isfinite(o.deadline_s))
      usage(("--deadline-s " + v + ": not a number of seconds above 0").c_str());
  }
  if (kv.count("--weights")) {
    if (kv["--weights"] != "f32" && kv["--weights"] != "fp8") usage("--weights must be f32 or fp8");
    o.fp8 = kv["--weights"] == "fp8";
  }
  if (o.source != "ipc" && o.source != "rdma") usage("--source must be ipc or rdma");
  return o;
}

// The params, engine-owned: buffers this program allocates and registers.
struct Tensor {
  std::vector<uint64_t> shape;
  std::vector<float> data;
};

struct Layer {
  const float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attn_proj_w, *attn_proj_b;
  const float *ln2_w, *ln2_b, *fc_w, *fc_b, *mlp_proj_w, *mlp_proj_b;
};

// An FP8 weight: E4M3 bytes and one float32 scale_inv per 128x128 block.
struct Fp8 {
  std::vector<uint8_t> q;
  std::vector<uint64_t> scale_shape;
  std::vector<float> scale_inv;
};

struct Model {
  std::map<std::string, Tensor> tensors;
  // --weights fp8: the registered FP8 params of the 2-D tensors; `tensors`
  // then holds their dequantized values (of version `dequantized`).
  std::map<std::string, Fp8> fp8;
  std::string dequantized;
  const float *tok_emb, *pos_emb, *ln_f_w, *ln_f_b, *head;
  Layer layers[kLayers];

  const float *add(const std::string &name, std::vector<uint64_t> shape) {
    size_t n = 1;
    for (uint64_t d : shape) n *= d;
    Tensor &t = tensors[name];
    t.shape = std::move(shape);
    t.data.assign(n, 0.0f);
    return t.data.data();
  }

  Model() {
    const uint64_t V = kVocab, D = kDim, T = kContext, H = kHidden;
    tok_emb = add("tok_emb.weight", {V, D});
    pos_emb = add("pos_emb.weight", {T, D});
    for (int i = 0; i < kLayers; i++) {
      const std::string p = "blocks." + std::to_string(i) + ".";
      Layer &l = layers[i];
      l.ln1_w = add(p + "ln1.weight", {D});
      l.ln1_b = add(p + "ln1.bias", {D});
      l.qkv_w = add(p + "attn.qkv.weight", {3 * D, D});
      l.qkv_b = add(p + "attn.qkv.bias", {3 * D});
      l.attn_proj_w = add(p + "attn.proj.weight", {D, D});
      l.attn_proj_b = add(p + "attn.proj.bias", {D});
      l.ln2_w = add(p + "ln2.weight", {D});
      l.ln2_b = add(p + "ln2.bias", {D});
      l.fc_w = add(p + "mlp.fc.weight", {H, D});
      l.fc_b = add(p + "mlp.fc.bias", {H});
      l.mlp_proj_w = add(p + "mlp.proj.weight", {D, H});
      l.mlp_proj_b = add(p + "mlp.proj.bias", {D});
    }
    ln_f_w = add("ln_f.weight", {D});
    ln_f_b = add("ln_f.bias", {D});
    head = add("head.weight", {V, D});
  }
};

// ---- The forward pass: model.py's TinyLM, row by row. ----

// y[o] = b[o] + W[o, :] . x   (W is [out, in], as torch.nn.Linear stores it)
void linear(const float *x, const float *w, const float *b, int in, int out, float *y) {
  for (int o = 0; o < out; o++) {
    float acc = 0.0f;
    const float *row = w + static_cast<size_t>(o) * in;
    for (int i = 0; i < in; i++) acc += row[i] * x[i];
    y[o] = (b ? b[o] : 0.0f) + acc;
  }
}

void layer_norm(const float *x, const float *w, const float *b, float *y) {
  float mean = 0.0f, var = 0.0f;
  for (int i = 0; i < kDim; i++) mean += x[i];
  mean /= kDim;
  for (int i = 0; i < kDim; i++) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.0f / std::sqrt(var / kDim + kLnEps);
  for (int i = 0; i < kDim; i++) y[i] = (x[i] - mean) * inv * w[i] + b[i];
}

float gelu(float x) { return 0.5f * x * (1.0f + std::erf(x / std::sqrt(2.0f))); }

// Causal multi-head self-attention over t positions of ln1's output h [t][D],
// adding proj(attention) into the residual stream x [t][D].
void attention(const Layer &l, const std::vector<float> &h, int t, std::vector<float> &x) {
  std::vector<float> qkv(static_cast<size_t>(t) * 3 * kDim), y(kDim), out(kDim), scores(t);
  for (int p = 0; p < t; p++) linear(&h[p * kDim], l.qkv_w, l.qkv_b, kDim, 3 * kDim, &qkv[p * 3 * kDim]);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (int p = 0; p < t; p++) {
    for (int head = 0; head < kHeads; head++) {
      const float *q = &qkv[p * 3 * kDim + head * kHeadDim];
      float top = -INFINITY;
      for (int s = 0; s <= p; s++) {  // causal: position p sees 0..p
        const float *k = &qkv[s * 3 * kDim + kDim + head * kHeadDim];
        float dot = 0.0f;
        for (int i = 0; i < kHeadDim; i++) dot += q[i] * k[i];
        scores[s] = dot * scale;
        top = std::max(top, scores[s]);
      }
      float sum = 0.0f;
      for (int s = 0; s <= p; s++) sum += scores[s] = std::exp(scores[s] - top);
      for (int i = 0; i < kHeadDim; i++) {
        float acc = 0.0f;
        for (int s = 0; s <= p; s++) acc += scores[s] * qkv[s * 3 * kDim + 2 * kDim + head * kHeadDim + i];
        y[head * kHeadDim + i] = acc / sum;
      }
    }
    linear(y.data(), l.attn_proj_w, l.attn_proj_b, kDim, kDim, out.data());
    for (int i = 0; i < kDim; i++) x[p * kDim + i] += out[i];
  }
}

void mlp(const Layer &l, const std::vector<float> &h, int t, std::vector<float> &x) {
  std::vector<float> hidden(kHidden), out(kDim);
  for (int p = 0; p < t; p++) {
    linear(&h[p * kDim], l.fc_w, l.fc_b, kDim, kHidden, hidden.data());
    for (float &v : hidden) v = gelu(v);
    linear(hidden.data(), l.mlp_proj_w, l.mlp_proj_b, kHidden, kDim, out.data());
    for (int i = 0; i < kDim; i++) x[p * kDim + i] += out[i];
  }
}

// Logits [t][V] for tokens[0..t).
void forward(const Model &m, const int32_t *tokens, int t, float *logits) {
  std::vector<float> x(static_cast<size_t>(t) * kDim), h(x.size());
  for (int p = 0; p < t; p++)
    for (int i = 0; i < kDim; i++) x[p * kDim + i] = m.tok_emb[tokens[p] * kDim + i] + m.pos_emb[p * kDim + i];
  for (const Layer &l : m.layers) {
    for (int p = 0; p < t; p++) layer_norm(&x[p * kDim], l.ln1_w, l.ln1_b, &h[p * kDim]);
    attention(l, h, t, x);
    for (int p = 0; p < t; p++) layer_norm(&x[p * kDim], l.ln2_w, l.ln2_b, &h[p * kDim]);
    mlp(l, h, t, x);
  }
  for (int p = 0; p < t; p++) {
    layer_norm(&x[p * kDim], m.ln_f_w, m.ln_f_b, &h[p * kDim]);
    linear(&h[p * kDim], m.head, nullptr, kDim, kVocab, logits + p * kVocab);
  }
}

// One serving step: the probes' logits and the prompt's greedy continuation.
void serve_one_step(const Model &m, Record &r) {
  int32_t probes[kProbes][kContext];
  for (int i = 0; i < kContext; i++) {
    probes[0][i] = (3 * i + 1) % kVocab;
    probes[1][i] = (7 * i + 5) % kVocab;
  }
  for (int b = 0; b < kProbes; b++) forward(m, probes[b], kContext, &r.logits[b][0][0]);
  int32_t tokens[kContext];
  for (int i = 0; i < kPrompt; i++) tokens[i] = 1 + 3 * i;  // PROMPT = [1, 4, ..., 22]
  std::vector<float> logits(static_cast<size_t>(kContext) * kVocab);
  for (int g = 0; g < kGenerate; g++) {
    const int t = kPrompt + g;
    forward(m, tokens, t, logits.data());
    const float *last = &logits[(t - 1) * kVocab];
    tokens[t] = static_cast<int32_t>(std::max_element(last, last + kVocab) - last);  // first maximum, as argmax
    r.continuation[g] = tokens[t];
  }
}

// ---- FP8 weights ----

// An E4M3 byte's value (float8_e4m3fn: no infinities, 0x7f/0xff NaN).
float e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  const float v = (e == 15 && m == 7) ? NAN : mag;
  return (b & 0x80) ? -v : v;
}

// Every FP8 weight's values into the float buffer the forward pass reads:
// q * scale_inv of its block, in float32.
void dequantize(Model &m) {
  for (auto &[name, f] : m.fp8) {
    Tensor &t = m.tensors[name];
    const uint64_t cols = t.shape[1], scols = f.scale_shape[1];
    for (size_t i = 0; i < t.data.size(); i++) {
      const uint64_t r = i / cols, c = i % cols;
      t.data[i] = e4m3(f.q[i]) * f.scale_inv[(r / 128) * scols + c / 128];
    }
  }
}

// ---- The engine: a manager, its params, the worker loop. ----

std::string last_error(wm_manager *m) {
  char why[1024];
  size_t n = 0;
  wm_last_error(m, why, sizeof why, &n);
  return why;
}

void check(wm_manager *m, wm_result rc, const std::string &what) {
  if (rc != WM_OK) throw std::runtime_error(what + ": " + wm_result_text(rc) + ": " + last_error(m));
}

void register_param(wm_manager *m, const std::string &name, uint32_t dtype, const std::vector<uint64_t> &shape,
                    void *data, size_t bytes) {
  wm_param_desc d;
  wm_param_desc_init(&d);
  d.name = name.c_str();
  d.dtype = dtype;
  d.shape = shape.data();
  d.ndim = shape.size();
  check(m, wm_register_param(m, &d, data, bytes), "registering " + name);
}

// FP8: each 2-D tensor as an F8E4M3 param and its scales, declared
// quantized (128x128 blocks); the rest as float32.
void register_fp8_params(wm_manager *m, Model &model) {
  for (auto &[name, t] : model.tensors) {
    if (t.shape.size() != 2) {
      register_param(m, name, WM_DTYPE_F32, t.shape, t.data.data(), t.data.size() * sizeof(float));
      continue;
    }
    Fp8 &f = model.fp8[name];
    f.q.assign(t.data.size(), 0);
    f.scale_shape = {(t.shape[0] + 127) / 128, (t.shape[1] + 127) / 128};
    f.scale_inv.assign(f.scale_shape[0] * f.scale_shape[1], 0.0f);
    const std::string scales = name + ".scale_inv";
    register_param(m, name, WM_DTYPE_F8E4M3, t.shape, f.q.data(), f.q.size());
    register_param(m, scales, WM_DTYPE_F32, f.scale_shape, f.scale_inv.data(), f.scale_inv.size() * sizeof(float));
    check(m, wm_quantize_param(m, name.c_str(), scales.c_str(), WM_QUANT_SCHEME_FP8_BLOCK128),
          "declaring " + name + " quantized");
  }
}

void register_params(wm_manager *m, Model &model) {
  for (auto &[name, t] : model.tensors) {
    wm_param_desc d;
    wm_param_desc_init(&d);
    d.name = name.c_str();
    d.dtype = WM_DTYPE_F32;
    d.shape = t.shape.data();
    d.ndim = t.shape.size();
    check(m, wm_register_param(m, &d, t.data.data(), t.data.size() * sizeof(float)), "registering " + name);
  }
}

struct Files {
  FILE *records, *updates;
  ~Files() {
    if (records) std::fclose(records);
    if (updates) std::fclose(updates);
  }
};

FILE *open_out(const std::string &path) {
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("creating " + path + ": " + std::strerror(errno));
  return f;
}

int run(const Options &o) {
  wm_config config;
  wm_config_init(&config);
  config.rank = o.rank;
  config.world_size = o.world;
  wm_group_config group;  // the ranks meet under this name
  wm_group_config_init(&group);
  group.name = o.group.c_str();
  group.signal_timeout_ms = 30000;
  config.group = &group;
  config.control_cell = o.cell.c_str();
  config.copy_threads = 1;  // a tiny model: one copy thread is plenty
  // config.net NULL: network defaults, the secret from WM_NET_SECRET (rdma).
  wm_manager *m = nullptr;
  if (wm_init(&config, &m) != WM_OK) {
    char why[1024];
    size_t n = 0;
    wm_last_create_error(why, sizeof why, &n);
    throw std::runtime_error(std::string("init: ") + why);
  }
  struct Destroy {
    wm_manager *m;
    ~Destroy() { wm_destroy(m); }
  } destroy{m};

  Model model;
  if (o.fp8) {
    register_fp8_params(m, model);
  } else {
    register_params(m, model);
  }
  const std::string prefix = o.out + "/rank" + std::to_string(o.rank);
  Files files{open_out(prefix + ".bin"), open_out(prefix + ".updates")};
  std::printf("rl_engine: rank %d ready, %zu params\n", o.rank, model.tensors.size());
  std::fflush(stdout);

  wm_update_request req;
  wm_update_request_init(&req);
  req.source = o.source == "ipc" ? WM_SOURCE_IPC : WM_SOURCE_RDMA;
  req.location = o.location.c_str();  // rdma: the latest version
  req.flags = WM_UPDATE_VERIFY_CHECKSUMS;
  req.timeout_ms = 30000;

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.deadline_s);
  Record record{}, previous{};
  bool have_previous = false;
  uint64_t computations = 0, records = 0, updates = 0;
  // Serve one step with whatever the params hold now, tagged with the
  // version wm_status says they hold; false when nothing is published yet.
  auto serve_and_record = [&]() -> bool {
    wm_status_info status;
    status.struct_size = sizeof status;
    check(m, wm_status(m, &status), "status");
    if (status.version[0] == '\0') return false;
    // Only this thread commits, so the params hold `status.version` now.
    if (o.fp8 && model.dequantized != status.version) {
      dequantize(model);
      model.dequantized = status.version;
    }
    serve_one_step(model, record);
    std::memcpy(record.version, status.version, sizeof record.version);
    computations++;
    // Identical outputs under the same version are written once: the
    // comparison in run.py would find the same thing again.
    if (have_previous && std::memcmp(&record, &previous, sizeof record) == 0) return true;
    if (std::fwrite(&record, sizeof record, 1, files.records) != 1) throw std::runtime_error("writing records");
    std::fflush(files.records);
    previous = record;
    have_previous = true;
    records++;
    return true;
  };
  // Two-phase: the staging thread of the pending update, and its outcome.
  std::thread stager;
  wm_update_stats staged;
  wm_result stage_rc = WM_OK;
  auto stage_start = std::chrono::steady_clock::now();
  uint64_t steps_while_staging = 0;
  struct JoinAtExit {
    std::thread &t;
    ~JoinAtExit() {
      if (t.joinable()) t.join();
    }
  } join_at_exit{stager};
  for (;;) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("no CLEARING within " + std::to_string(o.deadline_s) + " s");
    int32_t signal = 0;
    check(m, wm_broadcast_signal(m, &signal), "broadcast_signal");
    if (signal == WM_STATE_UPDATING) {
      // Two-phase: the first UPDATING starts staging the next version on a
      // side thread; this thread keeps generating from the old weights and
      // asking for the signal, which carries the ranks' vote on what they
      // staged, until every rank staged the same version (COMMIT).
      if (!stager.joinable()) {
        staged.struct_size = sizeof staged;
        stage_rc = WM_OK;
        stage_start = std::chrono::steady_clock::now();
        steps_while_staging = 0;
        stager = std::thread([&] { stage_rc = wm_stage(m, &req, &staged); });
      }
      if (serve_and_record()) {
        steps_while_staging++;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // nothing to serve yet
      }
      continue;
    } else if (signal == WM_STATE_COMMIT) {
      // Every rank got COMMIT at this step: switch before the next one.
      stager.join();
      wm_update_stats stats;
      stats.struct_size = sizeof stats;
      const auto commit_start = std::chrono::steady_clock::now();
      wm_result rc = wm_commit(m, &stats);
      const auto pause_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - commit_start).count();
      if (rc != WM_OK) {
        std::fprintf(stderr, "rl_engine: rank %d: commit failed: %s: %s\n", o.rank, wm_result_text(rc),
                     last_error(m).c_str());
        continue;
      }
      updates++;
      const auto stage_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(commit_start - stage_start).count();
      // version bytes total_ns tensors stage_ns pause_ns tokens_generated_while_staging
      std::fprintf(files.updates, "%s %llu %llu %llu %llu %llu %llu\n", stats.version,
                   (unsigned long long)stats.bytes, (unsigned long long)(stage_ns + pause_ns),
                   (unsigned long long)stats.tensors, (unsigned long long)stage_ns,
                   (unsigned long long)pause_ns, (unsigned long long)(steps_while_staging * kGenerate));
      std::fflush(files.updates);
    } else if (signal == WM_STATE_CLEARED && stager.joinable()) {
      // No rank commits (one failed to stage): the old weights stay; rank 0
      // reported it to the controller. Keep serving them.
      stager.join();
      std::fprintf(stderr, "rl_engine: rank %d: update dropped (stage: %s): %s\n", o.rank,
                   wm_result_text(stage_rc), last_error(m).c_str());
      continue;
    } else if (signal == WM_STATE_CLEARING) {
      check(m, wm_clear(m), "clear");
      break;
    } else if (signal == WM_STATE_CLEARED) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // wait for UPDATING
      continue;
    }
    if (!serve_and_record()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("rl_engine: rank %d: %llu updates, %llu forward passes, %llu distinct outputs\n", o.rank,
              (unsigned long long)updates, (unsigned long long)computations, (unsigned long long)records);
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception &e) {
    std::fprintf(stderr, "rl_engine: rank %d: %s\n", o.rank, e.what());
    return 1;
  }
}
