// make_seeds: writes the seed corpora of the fuzz targets, built the way the tests build valid
// requests (tests/service/grpc_integration_test.cc, tests/kernels/tiny_model.h) against the
// world of fuzz_world.h, plus a few near misses that each fail one check.
//
//   build-fuzz/tests/fuzz/make_seeds tests/fuzz/corpus    # rewrites the committed seeds
//
// Writes DIR/<target>/<seed name> (serialized protos; for parsers_fuzzer a selector byte and
// its input). scripts/fuzz.sh runs it into each working corpus too, so seeds follow the proto.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/common/half.h"
#include "laprox/v1/laprox.pb.h"
#include "tests/fuzz/fuzz_world.h"

namespace laprox::fuzz {
namespace {

namespace fs = std::filesystem;

class SeedWriter {
 public:
  explicit SeedWriter(fs::path root) : root_(std::move(root)) {}

  void Write(const std::string& target, const std::string& name, const std::string& bytes) {
    const fs::path dir = root_ / target;
    fs::create_directories(dir);
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "make_seeds: cannot write %s\n", (dir / name).c_str());
      ok_ = false;
    }
    ++count_;
  }
  void Write(const std::string& target, const std::string& name,
             const google::protobuf::Message& message) {
    Write(target, name, message.SerializeAsString());
  }
  bool ok() const { return ok_; }
  int count() const { return count_; }

 private:
  fs::path root_;
  bool ok_ = true;
  int count_ = 0;
};

int64_t ElementBytes(v1::DType dtype) { return dtype == v1::DTYPE_F32 ? 4 : 2; }

int64_t SectionOffset(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F16:
      return kF16Offset;
    case v1::DTYPE_BF16:
      return kBf16Offset;
    default:
      return kF32Offset;
  }
}

// Deterministic finite values in (-1, 1), in `dtype`'s encoding.
std::string InlineValues(int64_t count, v1::DType dtype, uint32_t seed) {
  std::string bytes;
  uint32_t state = seed * 2654435761u + 1;
  for (int64_t i = 0; i < count; ++i) {
    state = state * 1664525u + 1013904223u;
    const float x = static_cast<float>(state >> 8) / static_cast<float>(1 << 24) * 2.f - 1.f;
    if (dtype == v1::DTYPE_F32) {
      bytes.append(reinterpret_cast<const char*>(&x), 4);
    } else {
      const uint16_t h = dtype == v1::DTYPE_F16 ? kernels::FloatToF16(x) : kernels::FloatToBf16(x);
      bytes.append(reinterpret_cast<const char*>(&h), 2);
    }
  }
  return bytes;
}

void SetShape(v1::TensorRef* t, std::initializer_list<int64_t> shape,
              std::initializer_list<int64_t> strides = {}) {
  for (int64_t s : shape) t->add_shape(s);
  for (int64_t s : strides) t->add_strides(s);
}

int64_t Product(std::initializer_list<int64_t> shape) {
  int64_t p = 1;
  for (int64_t s : shape) p *= s;
  return p;
}

// A contiguous tensor in the world's input region; `cursor` is the next free byte of the
// dtype's section and advances.
void RegionTensor(v1::TensorRef* t, v1::DType dtype, std::initializer_list<int64_t> shape,
                  int64_t& cursor) {
  t->mutable_region()->set_region_id(kInputRegionId);
  t->mutable_region()->set_byte_offset(SectionOffset(dtype) + cursor);
  t->set_dtype(dtype);
  SetShape(t, shape);
  cursor += Product(shape) * ElementBytes(dtype);
}

void InlineTensor(v1::TensorRef* t, v1::DType dtype, std::initializer_list<int64_t> shape,
                  uint32_t seed) {
  t->set_inline_bytes(InlineValues(Product(shape), dtype, seed));
  t->set_dtype(dtype);
  SetShape(t, shape);
}

struct KeepMaskShape {
  int model = 1;  // 1, 2 or 3 (fuzz_world.h kModels)
  int64_t n = 64;
  int64_t rows = 8;  // window rows wq given
  v1::DType dtype = v1::DTYPE_F32;
  bool inline_tensors = false;
};

// A valid request: keys, values, window queries per layer; policy window = rows.
v1::ComputeKeepMaskRequest KeepMaskRequest(const KeepMaskShape& s) {
  const FuzzModel& m = kModels[s.model - 1];
  v1::ComputeKeepMaskRequest r;
  r.set_model_id(s.model);
  r.set_n(s.n);
  r.mutable_budget()->set_tokens_per_head(s.n / 2);
  r.mutable_policy()->set_window(static_cast<int32_t>(s.rows));
  int64_t cursor = 0;
  for (int l = 0; l < m.num_layers; ++l) {
    v1::LayerInputs* in = r.add_layers();
    const std::initializer_list<int64_t> kv = {m.num_kv_heads, s.n, m.head_dim};
    const std::initializer_list<int64_t> q = {m.num_heads, s.rows, m.head_dim};
    if (s.inline_tensors) {
      InlineTensor(in->mutable_keys(), s.dtype, kv, 10 * l + 1);
      InlineTensor(in->mutable_values(), s.dtype, kv, 10 * l + 2);
      InlineTensor(in->mutable_window_queries(), s.dtype, q, 10 * l + 3);
    } else {
      RegionTensor(in->mutable_keys(), s.dtype, kv, cursor);
      RegionTensor(in->mutable_values(), s.dtype, kv, cursor);
      RegionTensor(in->mutable_window_queries(), s.dtype, q, cursor);
    }
  }
  return r;
}

// KeepMaskRequest's region request with every layer's keys and values paged through one block
// table: pools of 8 blocks per layer (vLLM FlashAttention layout, K pool then V pool) at the
// start of the dtype's section, the window queries after them.
v1::ComputeKeepMaskRequest PagedKeepMaskRequest(const KeepMaskShape& s, int64_t block_size,
                                                std::vector<int32_t> ids) {
  v1::ComputeKeepMaskRequest r = KeepMaskRequest(s);
  const FuzzModel& m = kModels[s.model - 1];
  const int64_t block = block_size * m.num_kv_heads * m.head_dim, physical = 8;
  v1::BlockTable* table = r.add_block_tables();
  table->mutable_block_ids()->Assign(ids.begin(), ids.end());
  table->set_block_size(static_cast<int32_t>(block_size));
  const int64_t element = ElementBytes(s.dtype);
  int64_t cursor = 0;
  for (v1::LayerInputs& in : *r.mutable_layers()) {
    for (v1::TensorRef* t : {in.mutable_keys(), in.mutable_values()}) {
      t->mutable_region()->set_byte_offset(SectionOffset(s.dtype) + cursor);
      cursor += physical * block * element;
      v1::PagedLayout* paged = t->mutable_paged();
      paged->set_block_stride(block);
      paged->set_slot_stride(m.num_kv_heads * m.head_dim);
      paged->set_head_stride(m.head_dim);
      paged->set_dim_stride(1);
    }
  }
  for (v1::LayerInputs& in : *r.mutable_layers()) {
    v1::TensorRef* q = in.mutable_window_queries();
    q->mutable_region()->set_byte_offset(SectionOffset(s.dtype) + cursor);
    cursor += int64_t{m.num_heads} * s.rows * m.head_dim * element;
  }
  return r;
}

// A valid decode re-plan (laprox.proto, DecodeCache): layer l holds entries[l] entries per KV
// head in the input region, at token positions 2 * i + g before the window, the window's `rows`
// tokens at 1000 ..; n is the longest layer's; policy window = rows, budget 16.
v1::ComputeKeepMaskRequest DecodeKeepMaskRequest(int model, std::vector<int64_t> entries,
                                                 int64_t rows) {
  const FuzzModel& m = kModels[model - 1];
  v1::ComputeKeepMaskRequest r;
  r.set_model_id(model);
  r.set_n(*std::max_element(entries.begin(), entries.end()));
  r.mutable_budget()->set_tokens_per_head(16);
  r.mutable_policy()->set_window(static_cast<int32_t>(rows));
  int64_t cursor = 0;
  for (int l = 0; l < m.num_layers; ++l) {
    const int64_t n_l = entries[static_cast<size_t>(l)];
    v1::LayerInputs* in = r.add_layers();
    RegionTensor(in->mutable_keys(), v1::DTYPE_F32, {m.num_kv_heads, n_l, m.head_dim}, cursor);
    RegionTensor(in->mutable_values(), v1::DTYPE_F32, {m.num_kv_heads, n_l, m.head_dim}, cursor);
    RegionTensor(in->mutable_window_queries(), v1::DTYPE_F32, {m.num_heads, rows, m.head_dim},
                 cursor);
    v1::DecodeCacheLayer* layer = r.mutable_cache()->add_layers();
    layer->set_entries(n_l);
    for (int g = 0; g < m.num_kv_heads; ++g) {
      for (int64_t i = 0; i < n_l - rows; ++i) {
        layer->add_positions(static_cast<int32_t>(2 * i + g));
      }
      for (int64_t i = 0; i < rows; ++i) layer->add_positions(static_cast<int32_t>(1000 + i));
    }
  }
  return r;
}

void DecodeSeeds(SeedWriter& w, const std::string& t) {
  w.Write(t, "decode_ragged_layers", DecodeKeepMaskRequest(1, {40, 25}, 8));
  w.Write(t, "decode_model2", DecodeKeepMaskRequest(2, {30}, 4));
  {
    v1::ComputeKeepMaskRequest r = DecodeKeepMaskRequest(1, {33, 48}, 8);
    r.mutable_policy()->set_sinks(2);
    r.mutable_policy()->set_plan_shape(v1::PLAN_SHAPE_LAYER_UNIFORM);
    r.mutable_policy()->set_max_layer_share(1.25);
    w.Write(t, "decode_layer_uniform_sinks_cap", r);
  }
  {
    v1::ComputeKeepMaskRequest r = DecodeKeepMaskRequest(1, {12, 20}, 8);
    r.mutable_budget()->set_tokens_per_head(18);  // more than the layers hold
    r.mutable_outputs()->set_bitmask(true);
    r.mutable_outputs()->set_scores(true);
    w.Write(t, "decode_fewer_than_budget", r);
  }
  {
    v1::ComputeKeepMaskRequest r = DecodeKeepMaskRequest(1, {40, 25}, 8);
    r.mutable_cache()->mutable_layers(1)->set_positions(3, 4);  // a repeated position
    w.Write(t, "decode_repeated_position", r);
  }
  {
    // Paged: each layer's keys and values through a table of its own length, blocks of 16
    // (vLLM FlashAttention layout, 4 physical blocks per pool).
    v1::ComputeKeepMaskRequest r = DecodeKeepMaskRequest(1, {40, 25}, 8);
    const FuzzModel& m = kModels[0];
    const int64_t block = 16 * m.num_kv_heads * m.head_dim;
    int64_t cursor = 0;
    for (int l = 0; l < m.num_layers; ++l) {
      v1::BlockTable* table = r.add_block_tables();
      const std::vector<int32_t> ids =
          l == 0 ? std::vector<int32_t>{2, 0, 3} : std::vector<int32_t>{1, 3};
      table->mutable_block_ids()->Assign(ids.begin(), ids.end());
      table->set_block_size(16);
      for (v1::TensorRef* t :
           {r.mutable_layers(l)->mutable_keys(), r.mutable_layers(l)->mutable_values()}) {
        t->mutable_region()->set_byte_offset(SectionOffset(v1::DTYPE_F32) + cursor);
        cursor += 4 * block * 4;
        v1::PagedLayout* paged = t->mutable_paged();
        paged->set_block_table(static_cast<uint32_t>(l));
        paged->set_block_stride(block);
        paged->set_slot_stride(m.num_kv_heads * m.head_dim);
        paged->set_head_stride(m.head_dim);
        paged->set_dim_stride(1);
      }
    }
    w.Write(t, "decode_paged_tables_per_layer", r);
  }
  {
    v1::ComputeKeepMaskRequest r = DecodeKeepMaskRequest(1, {40, 25}, 8);
    r.mutable_outputs()->mutable_destination()->set_region_id(kOutputRegionId);
    r.mutable_outputs()->mutable_destination()->set_positions_offset(0);
    w.Write(t, "decode_into_region", r);
  }
}

void ComputeKeepMaskSeeds(SeedWriter& w) {
  const std::string t = "compute_keep_mask";
  DecodeSeeds(w, t);
  w.Write(t, "paged_f32", PagedKeepMaskRequest({}, 16, {5, 2, 7, 0}));
  w.Write(t, "paged_bf16_partial_block",
          PagedKeepMaskRequest({.n = 40, .dtype = v1::DTYPE_BF16}, 16, {3, 1, 6}));
  {
    auto r = PagedKeepMaskRequest({.n = 8, .rows = 4}, 1, {7, 6, 5, 4, 3, 2, 1, 0});
    r.mutable_block_tables(0)->set_allow_repeated_ids(true);
    r.mutable_block_tables(0)->set_block_ids(3, 7);
    w.Write(t, "token_pool_repeated", r);
  }
  for (const auto& [name, shape] :
       {std::pair{"blocks_shared", v1::PLAN_SHAPE_BLOCKS_SHARED},
        std::pair{"blocks_per_layer", v1::PLAN_SHAPE_BLOCKS_PER_LAYER}}) {
    auto r = PagedKeepMaskRequest({.n = 40, .dtype = v1::DTYPE_BF16}, 16, {3, 1, 6});
    r.mutable_policy()->set_plan_shape(shape);
    r.mutable_outputs()->set_scores(true);
    w.Write(t, name, r);
  }
  {
    // The table's ids read from the region (whatever its bytes are there: the fuzzer mutates).
    auto r = PagedKeepMaskRequest({}, 16, {5, 2, 7, 0});
    v1::BlockTable* table = r.mutable_block_tables(0);
    table->clear_block_ids();
    table->mutable_ids_region()->set_region_id(r.layers(0).keys().region().region_id());
    table->mutable_ids_region()->set_byte_offset(0);
    table->set_ids_count(4);
    w.Write(t, "paged_table_in_region", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_plan_shape(v1::PLAN_SHAPE_BLOCKS_SHARED);
    r.mutable_policy()->set_block_size(8);
    w.Write(t, "blocks_contiguous", r);
  }
  w.Write(t, "region_f32", KeepMaskRequest({}));
  w.Write(t, "region_f16", KeepMaskRequest({.dtype = v1::DTYPE_F16}));
  w.Write(t, "region_bf16", KeepMaskRequest({.dtype = v1::DTYPE_BF16}));
  w.Write(t, "region_model2", KeepMaskRequest({.model = 2, .n = 40, .rows = 4}));
  w.Write(t, "inline_f32",
          KeepMaskRequest({.model = 2, .n = 32, .rows = 4, .inline_tensors = true}));
  w.Write(t, "inline_bf16",
          KeepMaskRequest(
              {.model = 2, .n = 24, .rows = 4, .dtype = v1::DTYPE_BF16, .inline_tensors = true}));
  w.Write(t, "n_below_window", KeepMaskRequest({.n = 6, .rows = 4}));
  {
    auto r = KeepMaskRequest({});
    r.mutable_outputs()->set_bitmask(true);
    r.mutable_outputs()->set_scores(true);
    w.Write(t, "bitmask_scores", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.mutable_budget()->set_compression_ratio(0.5);
    w.Write(t, "compression_ratio", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.mutable_budget()->set_tokens_per_head(1000);
    w.Write(t, "budget_above_n", r);
  }
  {
    auto r = KeepMaskRequest({});
    v1::Policy* p = r.mutable_policy();
    p->set_sinks(4);
    p->set_min_per_head(2);
    p->set_head_uniform_layers(true);
    p->set_pooling(v1::POOLING_MAX);
    p->set_pool_kernel(3);
    w.Write(t, "sinks_floor_layer_uniform", r);
  }
  {
    auto r = KeepMaskRequest({});
    v1::Policy* p = r.mutable_policy();
    p->set_pooling(v1::POOLING_AVG_PEAK);
    p->set_pool_kernel(5);
    w.Write(t, "avg_peak_pooling", r);
  }
  {
    auto r = KeepMaskRequest({});
    v1::Policy* p = r.mutable_policy();
    p->set_min_per_head(2);
    p->set_plan_shape(v1::PLAN_SHAPE_LAYER_UNIFORM);
    p->set_max_layer_share(1.25);
    w.Write(t, "max_layer_share_layer_uniform", r);
  }
  for (auto [name, allocation] : {std::pair{"allocation_raw", v1::ALLOCATION_GLOBAL_RAW},
                                  std::pair{"allocation_per_layer", v1::ALLOCATION_PER_LAYER},
                                  std::pair{"allocation_uniform", v1::ALLOCATION_UNIFORM}}) {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_allocation(allocation);
    w.Write(t, name, r);
  }
  // gqa_value unset is MEAN_HEAD_PRODUCT (the default); the others explicitly.
  for (auto [name, gqa] : {std::pair{"gqa_mean_head_norm", v1::GQA_VALUE_MEAN_HEAD_NORM},
                           std::pair{"gqa_summed", v1::GQA_VALUE_SUMMED_PROJECTION},
                           std::pair{"gqa_product", v1::GQA_VALUE_MEAN_HEAD_PRODUCT},
                           std::pair{"gqa_exact_block", v1::GQA_VALUE_EXACT_BLOCK}}) {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_gqa_value(gqa);
    r.mutable_policy()->set_pooling(v1::POOLING_NONE);
    w.Write(t, name, r);
  }
  // pool_target on both sides of each placement, and the PAPER preset.
  for (auto [name, gqa, target] :
       {std::tuple{"pool_attention_product", v1::GQA_VALUE_MEAN_HEAD_PRODUCT,
                   v1::POOL_TARGET_ATTENTION},
        std::tuple{"pool_attention_exact_block", v1::GQA_VALUE_EXACT_BLOCK,
                   v1::POOL_TARGET_ATTENTION},
        std::tuple{"pool_score_mean_head_norm", v1::GQA_VALUE_MEAN_HEAD_NORM,
                   v1::POOL_TARGET_SCORE}}) {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_gqa_value(gqa);
    r.mutable_policy()->set_pool_target(target);
    w.Write(t, name, r);
  }
  {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_preset(v1::POLICY_PRESET_PAPER);
    w.Write(t, "preset_paper", r);
  }
  for (auto [name, indicator] : {std::pair{"indicator_value", v1::INDICATOR_ATTENTION_X_VALUE},
                                 std::pair{"indicator_attention", v1::INDICATOR_ATTENTION}}) {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_indicator(indicator);
    w.Write(t, name, r);
  }
  for (auto [name, kind] : {std::pair{"streaming_llm", v1::POLICY_KIND_STREAMING_LLM},
                            std::pair{"snapkv", v1::POLICY_KIND_SNAPKV},
                            std::pair{"pyramidkv", v1::POLICY_KIND_PYRAMIDKV},
                            std::pair{"adakv", v1::POLICY_KIND_ADAKV},
                            std::pair{"criticalkv", v1::POLICY_KIND_CRITICALKV},
                            std::pair{"critical_adakv", v1::POLICY_KIND_CRITICAL_ADAKV},
                            std::pair{"cake", v1::POLICY_KIND_CAKE}}) {
    auto r = KeepMaskRequest({});
    r.mutable_policy()->set_kind(kind);
    r.mutable_policy()->set_pool_kernel(3);
    w.Write(t, name, r);
  }
  {
    auto r = KeepMaskRequest({.dtype = v1::DTYPE_BF16});
    r.mutable_policy()->set_kind(v1::POLICY_KIND_CRITICAL_ADAKV);
    r.mutable_policy()->set_numeric_mode(v1::NUMERIC_MODE_KVPRESS_COMPAT);
    r.mutable_budget()->set_compression_ratio(0.25);
    w.Write(t, "kvpress_compat_bf16", r);
  }
  {
    // Keys stored [n, Hkv, d] and sent as [Hkv, n, d] with strides [d, Hkv * d, 1].
    auto r = KeepMaskRequest({});
    const FuzzModel& m = kModels[0];
    for (v1::LayerInputs& in : *r.mutable_layers()) {
      for (v1::TensorRef* kv : {in.mutable_keys(), in.mutable_values()}) {
        kv->clear_strides();
        kv->add_strides(m.head_dim);
        kv->add_strides(int64_t{m.num_kv_heads} * m.head_dim);
        kv->add_strides(1);
      }
    }
    w.Write(t, "strided_nhd", r);
  }
  {
    // Every KV head and query head reads the same rows (stride 0 along the head).
    auto r = KeepMaskRequest({});
    const FuzzModel& m = kModels[0];
    for (v1::LayerInputs& in : *r.mutable_layers()) {
      for (v1::TensorRef* x :
           {in.mutable_keys(), in.mutable_values(), in.mutable_window_queries()}) {
        x->clear_strides();
        x->add_strides(0);
        x->add_strides(m.head_dim);
        x->add_strides(1);
      }
    }
    w.Write(t, "zero_head_stride", r);
  }
  {
    // Model 3 (512 KV heads of d = 2), and then every head reading the same rows (stride 0).
    auto r = KeepMaskRequest({.model = 3, .n = 16, .rows = 2});
    w.Write(t, "many_heads", r);
    for (v1::LayerInputs& in : *r.mutable_layers()) {
      for (v1::TensorRef* x :
           {in.mutable_keys(), in.mutable_values(), in.mutable_window_queries()}) {
        x->clear_strides();
        x->add_strides(0);
        x->add_strides(2);
        x->add_strides(1);
      }
    }
    w.Write(t, "many_heads_shared_rows", r);
  }
  {
    // Attention rows given (uniform over the keys each causal row sees) instead of queries.
    const int64_t n = 16, rows = 4;
    auto r = KeepMaskRequest({.model = 2, .n = n, .rows = rows, .inline_tensors = true});
    const FuzzModel& m = kModels[1];
    for (v1::LayerInputs& in : *r.mutable_layers()) {
      std::vector<float> a(m.num_heads * rows * n, 0.f);
      for (int h = 0; h < m.num_heads; ++h) {
        for (int64_t t_row = 0; t_row < rows; ++t_row) {
          const int64_t seen = n - rows + t_row + 1;
          for (int64_t j = 0; j < seen; ++j) a[(h * rows + t_row) * n + j] = 1.f / seen;
        }
      }
      v1::TensorRef* att = in.mutable_window_attention();  // clears window_queries (oneof)
      att->set_inline_bytes(a.data(), a.size() * 4);
      att->set_dtype(v1::DTYPE_F32);
      SetShape(att, {m.num_heads, rows, n});
    }
    w.Write(t, "window_attention", r);
  }
  {
    auto r = KeepMaskRequest({.model = 2, .n = 32, .rows = 4, .inline_tensors = true});
    const FuzzModel& m = kModels[1];
    for (v1::LayerInputs& in : *r.mutable_layers()) {
      InlineTensor(in.mutable_window_lse(), v1::DTYPE_F32, {m.num_heads, 4}, 7);
    }
    w.Write(t, "window_lse", r);
  }
  {
    auto r = KeepMaskRequest({});
    v1::OutputOptions* out = r.mutable_outputs();
    out->set_bitmask(true);
    out->set_scores(true);
    v1::OutputDestination* to = out->mutable_destination();
    to->set_region_id(kOutputRegionId);
    to->set_counts_offset(0);
    to->set_offsets_offset(64);
    to->set_positions_offset(4096);
    to->set_bitmask_offset(65536);
    to->set_scores_offset(131072);
    w.Write(t, "destination", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.mutable_outputs()->set_positions(false);
    r.mutable_outputs()->mutable_destination()->set_region_id(kOutputRegionId);
    r.mutable_outputs()->mutable_destination()->set_positions_offset(0);
    w.Write(t, "destination_positions_only", r);
  }
  // Near misses: each fails one check.
  {
    auto r = KeepMaskRequest({});
    r.set_model_id(0);
    w.Write(t, "miss_model_id_0", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.clear_budget();
    w.Write(t, "miss_no_budget", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.mutable_layers(1)->mutable_keys()->mutable_region()->set_byte_offset(kInputBytes - 4);
    w.Write(t, "miss_past_region_end", r);
  }
  {
    auto r = KeepMaskRequest({});
    r.set_n(int64_t{1} << 21);
    w.Write(t, "miss_n_above_limit", r);
  }
}

v1::RegisterModelRequest ModelRequest(int layers, int heads, int kv_heads, int head_dim, int hidden,
                                      v1::DType dtype, bool in_region) {
  v1::RegisterModelRequest r;
  r.set_name("fuzz/seed-model");
  v1::ModelGeometry* g = r.mutable_geometry();
  g->set_num_layers(layers);
  g->set_num_heads(heads);
  g->set_num_kv_heads(kv_heads);
  g->set_head_dim(head_dim);
  g->set_hidden_size(hidden);
  int64_t cursor = 0;
  for (int l = 0; l < layers; ++l) {
    v1::TensorRef* t = r.add_o_proj();
    const std::initializer_list<int64_t> shape = {hidden, int64_t{heads} * head_dim};
    if (in_region) {
      RegionTensor(t, dtype, shape, cursor);
    } else {
      InlineTensor(t, dtype, shape, 100 + l);
    }
  }
  return r;
}

void RegisterModelSeeds(SeedWriter& w) {
  const std::string t = "register_model";
  w.Write(t, "inline_f32", ModelRequest(2, 4, 2, 8, 16, v1::DTYPE_F32, false));
  w.Write(t, "inline_f16", ModelRequest(1, 2, 1, 4, 8, v1::DTYPE_F16, false));
  w.Write(t, "inline_bf16", ModelRequest(1, 3, 3, 4, 6, v1::DTYPE_BF16, false));
  w.Write(t, "region_f32", ModelRequest(3, 6, 2, 16, 48, v1::DTYPE_F32, true));
  w.Write(t, "region_bf16", ModelRequest(2, 4, 1, 8, 32, v1::DTYPE_BF16, true));
  {
    auto r = ModelRequest(2, 6, 2, 8, 24, v1::DTYPE_F32, true);
    r.set_prepare_cross_grams(true);
    r.mutable_geometry()->set_softmax_scale(0.125f);
    w.Write(t, "cross_grams", r);
  }
  {
    // o_proj.weight given transposed ([H*d, D] in memory): strides [1, D].
    auto r = ModelRequest(1, 2, 2, 4, 8, v1::DTYPE_F32, true);
    r.mutable_o_proj(0)->add_strides(1);
    r.mutable_o_proj(0)->add_strides(8);
    w.Write(t, "strided_o_proj", r);
  }
  {
    auto r = ModelRequest(1, 2, 2, 4, 8, v1::DTYPE_F32, false);
    r.mutable_o_proj(0)->clear_inline_bytes();
    r.mutable_o_proj(0)->set_inline_bytes(std::string(4, '\0'));
    r.mutable_o_proj(0)->add_strides(0);
    r.mutable_o_proj(0)->add_strides(0);
    w.Write(t, "zero_strides", r);
  }
  {
    auto r = ModelRequest(1, 4, 3, 4, 8, v1::DTYPE_F32, false);
    w.Write(t, "miss_heads_not_multiple", r);
  }
  {
    auto r = ModelRequest(2, 2, 2, 4, 8, v1::DTYPE_F32, false);
    r.mutable_o_proj()->RemoveLast();
    w.Write(t, "miss_o_proj_count", r);
  }
  {
    auto r = ModelRequest(1, 2, 2, 4, 8, v1::DTYPE_F32, false);
    r.set_name("bad name!");
    w.Write(t, "miss_name", r);
  }
}

void RegisterRegionSeeds(SeedWriter& w) {
  const std::string t = "register_region";
  auto shm = [](const std::string& name, int64_t offset, int64_t size, bool writable) {
    v1::RegisterRegionRequest r;
    r.mutable_shm()->set_name(name);
    r.mutable_shm()->set_offset(offset);
    r.mutable_shm()->set_byte_size(size);
    r.set_writable(writable);
    return r;
  };
  w.Write(t, "shm_whole", shm(kSelfShmName, 0, kInputBytes, false));
  w.Write(t, "shm_window", shm(kSelfShmName, 5000, 4096, false));
  w.Write(t, "shm_writable", shm(std::string("/") + kSelfShmName, 4096, 65536, true));
  w.Write(t, "miss_shm_past_end", shm(kSelfShmName, kInputBytes - 8, 16, false));
  w.Write(t, "miss_shm_missing", shm("laprox-fuzz-does-not-exist", 0, 8, false));
  w.Write(t, "miss_shm_name", shm("kv0", 0, 8, false));
  auto ipc = [](size_t handle_bytes, const std::string& uuid, int64_t offset, int64_t size) {
    v1::RegisterRegionRequest r;
    r.mutable_cuda_ipc()->set_handle(std::string(handle_bytes, '\x01'));
    r.mutable_cuda_ipc()->set_device_uuid(uuid);
    r.mutable_cuda_ipc()->set_offset(offset);
    r.mutable_cuda_ipc()->set_byte_size(size);
    return r;
  };
  w.Write(t, "cuda_ipc", ipc(64, "GPU-00112233-4455-6677-8899-aabbccddeeff", 256, 4096));
  w.Write(t, "cuda_ipc_bare_uuid", ipc(64, "00112233-4455-6677-8899-AABBCCDDEEFF", 0, 8));
  w.Write(t, "miss_cuda_ipc_handle", ipc(63, "GPU-00112233-4455-6677-8899-aabbccddeeff", 0, 8));
  w.Write(t, "miss_cuda_ipc_uuid", ipc(64, "GPU-0011-zz", 0, 8));
  w.Write(t, "miss_kind", v1::RegisterRegionRequest());
}

void ParserSeeds(SeedWriter& w) {
  const std::string t = "parsers";
  auto sel = [](char selector, const std::string& input) {
    return std::string(1, selector) + input;
  };
  w.Write(t, "shm_self", sel(0, kSelfShmName));
  w.Write(t, "shm_slash", sel(0, std::string("/") + kSelfShmName));
  w.Write(t, "shm_bad_char", sel(0, "laprox-a/b"));
  w.Write(t, "uuid", sel(1, "GPU-00112233-4455-6677-8899-aabbccddeeff"));
  w.Write(t, "uuid_bare_upper", sel(1, "00112233-4455-6677-8899-AABBCCDDEEFF"));
  w.Write(t, "uuid_bad", sel(1, "GPU-0011-zz"));
  w.Write(t, "address_v4", sel(2, "127.0.0.1:9464"));
  w.Write(t, "address_v6", sel(2, "[::1]:0"));
  w.Write(t, "address_any", sel(2, ":0"));
  w.Write(t, "address_localhost", sel(2, "localhost:80"));
  w.Write(t, "address_bad_port", sel(2, "127.0.0.1:65536"));
  auto extent = [&](std::initializer_list<int64_t> numbers, char rank) {
    std::string s(1, 3);
    s.push_back(rank);
    for (int64_t x : numbers) s.append(reinterpret_cast<const char*>(&x), 8);
    return s;
  };
  w.Write(t, "extent_contiguous", extent({2, 300, 16}, 3));
  w.Write(t, "extent_strided", extent({2, 300, 16, 16, 32, 1}, 3));
  w.Write(t, "extent_zero", extent({4, 0, 8}, 3));
}

// Batches of the compute_keep_mask seeds' requests: mixed lengths, dtypes, paged and block
// shapes, and an output destination beside ordinary sequences.
void ComputeKeepPlansSeeds(SeedWriter& w) {
  const std::string t = "compute_keep_plans";
  {
    v1::ComputeKeepPlansRequest r;
    *r.add_sequences() = DecodeKeepMaskRequest(1, {40, 25}, 8);
    *r.add_sequences() = KeepMaskRequest({});
    *r.add_sequences() = DecodeKeepMaskRequest(1, {20, 36}, 8);
    w.Write(t, "decode_and_prefill", r);
  }
  {
    v1::ComputeKeepPlansRequest r;
    *r.add_sequences() = KeepMaskRequest({});
    *r.add_sequences() = KeepMaskRequest({.dtype = v1::DTYPE_BF16});
    *r.add_sequences() = PagedKeepMaskRequest({.n = 40, .dtype = v1::DTYPE_BF16}, 16, {3, 1, 6});
    r.mutable_sequences(2)->mutable_policy()->set_plan_shape(v1::PLAN_SHAPE_BLOCKS_SHARED);
    w.Write(t, "mixed", r);
  }
  {
    v1::ComputeKeepPlansRequest r;
    for (int i = 0; i < 4; ++i) *r.add_sequences() = KeepMaskRequest({.n = 40 + 8 * i});
    r.mutable_sequences(1)->mutable_policy()->set_kind(v1::POLICY_KIND_SNAPKV);
    r.mutable_sequences(1)->mutable_policy()->set_window(8);
    w.Write(t, "lengths", r);
  }
}

}  // namespace
}  // namespace laprox::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  laprox::fuzz::SeedWriter writer{std::filesystem::path(argv[1])};
  laprox::fuzz::ComputeKeepMaskSeeds(writer);
  laprox::fuzz::ComputeKeepPlansSeeds(writer);
  laprox::fuzz::RegisterModelSeeds(writer);
  laprox::fuzz::RegisterRegionSeeds(writer);
  laprox::fuzz::ParserSeeds(writer);
  std::printf("make_seeds: %d seeds in %s\n", writer.count(), argv[1]);
  return writer.ok() ? 0 : 1;
}
