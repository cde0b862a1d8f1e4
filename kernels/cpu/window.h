// Window attention of one KV group and pooling along positions on the CPU: the parts that the
// LaProx score (score.cc) and the baseline statistics (baseline_stats.cc) share.
#ifndef LAPROX_KERNELS_CPU_WINDOW_H_
#define LAPROX_KERNELS_CPU_WINDOW_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cpu {

// Scratch memory of one worker thread, reused across (layer, head) tasks and requests.
struct ScoreWorkspace {
  std::vector<float> queries;      // [G * we, d], scaled
  std::vector<float> probs;        // [G * rows, n], logits, then unnormalised probabilities
  std::vector<float> row_scale;    // [G * rows], 1 / row sum
  std::vector<float> rows;         // converted key / value / attention rows
  std::vector<float> packed_keys;  // a chunk of keys in panels for the logits (cpu/logits.h)
  std::vector<float> projected;    // [chunk, F * d] V times factor blocks, or [chunk, D] V W_O^h
  std::vector<float> triangles;    // the task's triangular factors, packed (cpu/triangular.h)
  std::vector<float> scaled_row_scale;  // [G * we], row_scale times 2^k (score.cc)
  std::vector<float> attention;    // attention statistics [S, n - we], scaled by 2^(2k) (score.cc)
  std::vector<float> value;        // value statistics [F, n - we]
  std::vector<float> pre_pool;     // [n - we]
  std::vector<float> head_pooled;  // pool_target ATTENTION, per head: pool(c^h) [G, n - we]
  std::vector<float> pooled;       // baselines: one query head's pooled score [n - we]
  std::vector<double> pool_sums;   // Pool's scratch: 3 * (n - we + kernel - 1)
};

// One (layer, KV head) of a request.
struct HeadTask {
  const LayerInputs* inputs = nullptr;
  int64_t layer = 0;
  int64_t kv_head = 0;
  const float* factors = nullptr;  // CpuPreparedModel::factors(layer, kv_head)
  int64_t factor_ld = 0;           // CpuPreparedModel::row_stride()
  const float* o_proj = nullptr;   // CpuPreparedModel::output_projection(layer), [D, H*d] fp32
  int64_t hidden_size = 0;         // D
  float max_o_proj = 0.f;          // CpuPreparedModel::max_o_proj(layer): largest |o_proj[l]|
  float scale = 0.f;               // softmax scale
  // The L2 cache per core that key and value chunks are sized for (KeyChunk, ValueChunk).
  int64_t l2_bytes = int64_t{1} << 20;
  // LAPROX: the most bytes of window probabilities to hold at once (WindowRowsPerRange).
  int64_t window_bytes = int64_t{1} << 62;
  // KVPRESS_COMPAT arithmetic of the SnapKV kinds (kvpress's SnapKVPress in the model dtype T =
  // compat_dtype, kF32: no rounding): WindowAttention rounds the logits q.k to T, divides them
  // by sqrt(d) (not `scale`), rounds again and takes the softmax from them, ignoring a
  // window_lse (kvpress recomputes the softmax; the LSE is still checked). False: as above.
  bool kvpress_compat = false;
  DType compat_dtype = DType::kF32;
  // The request's stop signal (KeepPlanRequest::stop; may be null): the loops over chunks of
  // keys and values and over window rows check it, and return its status once it says stop.
  const StopSignal* stop = nullptr;
};

// x[i] rounded to the nearest `dtype` value (ties to even) and back to fp32, i < count; kF32
// leaves x as it is.
void RoundTo(DType dtype, float* x, int64_t count);

// Grows `v` to at least `size` elements and returns its data.
template <typename T>
T* Sized(std::vector<T>& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  return v.data();
}

// The same, with the first `size` elements set to 0.
template <typename T>
T* Zeroed(std::vector<T>& v, int64_t size) {
  T* p = Sized(v, size);
  std::fill(p, p + size, T{0});
  return p;
}

// Window rows t in [begin, end) of every query head of a group, 0 <= begin < end <= we.
struct WindowRows {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t count() const { return end - begin; }
};

// The window attention rows `rows` of the G query heads of `task` (SEMANTICS.md, "Scores"): from
// the engine's window_attention rows, or from queries and keys (fp32 sgemm, causal softmax, or
// the engine's window_lse; KVPRESS_COMPAT: see HeadTask::kvpress_compat). Afterwards row
// r = hi * rows.count() + (t - rows.begin) of ws.probs ([G * rows.count(), n]) times
// ws.row_scale[r] is A^h[t, :] for query head h = kv_head * G + hi, valid in columns [0, n - we);
// every entry is at most 1 (softmax rows; with the engine's window_lse, exp(logit - lse) capped at
// 1; given rows are checked to sum to at most 1.01). A row's values do not depend on the range it
// is computed in. Checks every input element it reads (the group's keys, queries and LSE; or the
// attention rows of the range, with the first range also those before the window and the keys)
// and answers
// INVALID_ARGUMENT naming the tensor and element on bad data, and naming the keys when the logits
// could overflow (policy::CheckLogitMagnitude) or, in KVPRESS_COMPAT, overflow the model dtype.
absl::Status WindowAttention(const RequestShape& shape, const HeadTask& task, WindowRows rows,
                             ScoreWorkspace& ws);

// All the window rows of a request: [0, we).
inline WindowRows AllWindowRows(const RequestShape& shape) { return {0, shape.window}; }

// The L2 cache of one core of this CPU (sysconf), or 1 MiB where the C library cannot tell.
int64_t L2CacheBytes();

// Rows per chunk of keys (the window logits) and of values (the value statistics) for head dim
// d and an L2 of `l2_bytes` per core: a chunk's fp32 rows (keys: d floats a row; values: d and
// the row's products, `value_floats`) fill at most 1/16 of L2, so that they, the keys' packed
// copy (cpu/logits.h) and the probabilities being written share it: 512 rows at d = 64 and 256 at
// d = 128 on a 2 MiB L2. Powers of two. Measured (bench/RESULTS.md, "Chunk sizes"): flat up to
// 1/8 of L2 for values and 1/4 for keys, slower beyond (values at 1/4: 17-28% at d = 64; keys at
// 1/2: 5-9% at d = 128). The sgemm path (no AVX-512F) takes at least 1024 keys: sgemm packs the
// queries again for every chunk.
int64_t KeyChunk(int64_t l2_bytes, int64_t d);
int64_t ValueChunk(int64_t l2_bytes, int64_t value_floats);

// The window rows per range when a worker may hold `window_bytes` of probabilities
// ([G * rows, n] fp32): the we rows in as few ranges as fit (one row per range at least), the
// ranges as even as possible. At least 1.
int64_t WindowRowsPerRange(const RequestShape& shape, int64_t window_bytes);

// out[i] for i in [begin, len) = pool(x)_i over x[0, len) (SEMANTICS.md, "pool"); `sums` is
// scratch. AVG adds each window's own terms in fp64 (no difference of prefix sums, which would
// lose values far below an earlier large one): relative error below kernel * 2^-53 for x >= 0.
void Pool(Pooling kind, int64_t kernel, const float* x, int64_t len, int64_t begin, float* out,
          std::vector<double>& sums);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_WINDOW_H_
