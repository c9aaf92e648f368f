// Attention of one new token per row to the keys and values cached so far, on CPUs with AVX-512
// or AVX2 (float_lanes.h: each extension builds it for its own registers).
//
// torch's CPU attention (flash attention, scaled_dot_product_attention) took about 190 us per
// layer for the demo model at batch 8 in a decoding step, where the cached keys and values
// (1.8 MB a layer at 150 positions) read from memory in about 70: 18% of the step. It is built
// for many queries at once; here each query is a single row, so a pass over the keys makes every
// score of the kv head's queries, a vectorized exp turns them into weights, and a pass over the
// values sums them. On AVX2 CPUs, rows at different positions (continuous batching) also made
// torch gather every row's cache into a copy and read it under a mask: 20% of a 16-row step of
// the demo model in int4 (AMD EPYC, 2 threads), where each row here reads its own cache row.
//
// Each row of the batch reads its own row of the preallocated caches, up to its own length (rows
// at different positions: continuous batching). Query head h reads kv head h / (heads / kv heads),
// as scaled_dot_product_attention's enable_gqa has it.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "float_lanes.h"

namespace {

namespace lanes = llama_tp::lanes;
using lanes::Floats;
using lanes::kWidth;

// The `group` query heads q[group][head_dim] of one kv head attend to its `positions` keys and
// values (row stride `stride`); out[group][head_dim]. scores: room for group * positions floats.
void attend(const float* q, const float* keys, const float* values, int64_t stride, int64_t positions,
            int64_t group, int64_t head_dim, float* scores, float* out) {
  const int64_t registers = head_dim / kWidth;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t t = 0; t < positions; ++t) {  // each key read once for every query of the group
    const float* key = keys + t * stride;
    for (int64_t j = 0; j < group; ++j) {
      Floats dot = lanes::zeros();
      for (int64_t r = 0; r < registers; ++r)
        dot = lanes::fmadd(lanes::load(q + j * head_dim + r * kWidth), lanes::load(key + r * kWidth), dot);
      scores[j * positions + t] = lanes::sum(dot) * scale;
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* row = scores + j * positions;
    Floats most = lanes::broadcast(-INFINITY);
    for (int64_t t = 0; t < positions; t += kWidth)
      most = lanes::max(most, lanes::load_first(row + t, positions - t, -INFINITY));
    const Floats highest = lanes::broadcast(lanes::largest(most));
    Floats total = lanes::zeros();
    for (int64_t t = 0; t < positions; t += kWidth) {
      const Floats weights = lanes::keep_first(
          lanes::exp_of_nonpositive(lanes::sub(lanes::load_first(row + t, positions - t), highest)), positions - t);
      lanes::store_first(row + t, positions - t, weights);
      total = lanes::add(total, weights);
    }
    const float inverse_total = 1.0f / lanes::sum(total);
    for (int64_t r = 0; r < registers; ++r) {  // out = the values weighted by the scores
      Floats sum = lanes::zeros();
      for (int64_t t = 0; t < positions; ++t)
        sum = lanes::fmadd(lanes::broadcast(row[t]), lanes::load(values + t * stride + r * kWidth), sum);
      lanes::store(out + j * head_dim + r * kWidth, lanes::mul(sum, lanes::broadcast(inverse_total)));
    }
  }
}

// Each row's int64 entry in a vector of one per row (stride 0: the same for every row).
int64_t row_entry(const at::Tensor& vector, int64_t row) {
  return vector.data_ptr<int64_t>()[row * vector.stride(0)];
}

// Each row's cache row and position (or length, with first = 1: [1, capacity]) inside the caches.
void check_rows(const at::Tensor& slots, const at::Tensor& positions, int64_t batch, const at::Tensor& k_cache,
                int64_t first) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == batch && slots.scalar_type() == at::kLong &&
              positions.dim() == 1 && positions.size(0) == batch && positions.scalar_type() == at::kLong,
              "slots and positions (or lengths) must be int64 [batch]");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t slot = row_entry(slots, b), position = row_entry(positions, b);
    TORCH_CHECK(0 <= slot && slot < k_cache.size(0) && first <= position && position < k_cache.size(2) + first,
                "row ", b, ": cache row ", slot, " or position ", position, " outside the cache");
  }
}

// Queries q [batch, heads, head_dim] (contiguous) attend to the keys and values of cache row
// slots[b] at positions [0, lengths[b]): caches [rows, kv heads, capacity, head_dim], any strides
// with head_dim contiguous.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous fp32 [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.stride(3) == 1,
              "the caches must be fp32 [rows, kv heads, positions, head_dim] alike, head_dim contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0 && head_dim % kWidth == 0, "shapes do not match");
  check_rows(slots, lengths, batch, k_cache, 1);
  const int64_t group = heads / kv_heads;
  at::Tensor out = at::empty_like(q);
  const float *q_data = q.data_ptr<float>(), *k_data = k_cache.data_ptr<float>(), *v_data = v_cache.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kv = task % kv_heads, positions = row_entry(lengths, b);
      scores.resize(group * positions);
      const int64_t offset = row_entry(slots, b) * k_cache.stride(0) + kv * k_cache.stride(1);
      const int64_t first = (b * heads + kv * group) * head_dim;
      attend(q_data + first, k_data + offset, v_data + offset, k_cache.stride(2), positions, group, head_dim,
             scores.data(), out_data + first);
    }
  });
  return out;
}

// One head's channel pairs (2i, 2i+1) turned by the angles whose cos and sin are turns[i]:
// apply_rotary's complex product.
void rotate(const float* x, const float* turns, int64_t head_dim, float* out) {
  for (int64_t i = 0; i < head_dim; i += 2) {
    const float cos = turns[i], sin = turns[i + 1];
    out[i] = x[i] * cos - x[i + 1] * sin;
    out[i + 1] = x[i] * sin + x[i + 1] * cos;
  }
}

// A step's attention in one call, as apply_rotary, KVCache.update and decode_attention do it in
// turn: row b's tokens, at positions positions[b], positions[b] + 1, ..., are taken one after the
// other: the token's query and key heads turned to its position, its key and value written into
// cache row slots[b] there, then its queries attend to positions [0, its own]. Rows may sit
// anywhere in the caches, each at its own position (continuous batching) or all at one. A step
// of several tokens a row (guesses to verify, a short chunk of prompt) gives every token exactly
// the bits it would get in a step of its own.
// qkv [batch, tokens, (heads + 2 kv heads) * head_dim]: the wqkv product, queries then keys then
// values; turns [batch or 1, tokens, head_dim / 2, 2]: each token's cos and sin (one set for all
// rows); caches [rows, kv heads, capacity, head_dim], contiguous; slots, positions int64 [batch].
// Returns [batch, tokens, heads * head_dim].
at::Tensor decode_step_attention(const at::Tensor& qkv, const at::Tensor& turns, at::Tensor& k_cache,
                                 at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& positions,
                                 int64_t heads) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "the caches must be contiguous fp32 [rows, kv heads, positions, head_dim] alike");
  const int64_t kv_heads = k_cache.size(1), capacity = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t batch = qkv.size(0), tokens = qkv.size(1), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.dim() == 3 && tokens > 0 && qkv.size(2) == width && qkv.scalar_type() == at::kFloat &&
              qkv.is_contiguous(), "qkv must be contiguous fp32 [batch, tokens, (heads + 2 kv heads) * head_dim]");
  TORCH_CHECK(turns.scalar_type() == at::kFloat && turns.is_contiguous() &&
              (turns.numel() == tokens * head_dim || turns.numel() == batch * tokens * head_dim),
              "turns must be contiguous fp32 cos and sin [batch or 1, tokens, head_dim / 2, 2]");
  TORCH_CHECK(heads % kv_heads == 0 && head_dim % kWidth == 0, "shapes do not match");
  check_rows(slots, positions, batch, k_cache, 0);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(row_entry(positions, b) + tokens <= capacity, "row ", b, ": its last token falls outside the cache");
  const int64_t group = heads / kv_heads;
  const int64_t turns_stride = turns.numel() == tokens * head_dim ? 0 : tokens * head_dim;
  at::Tensor out = at::empty({batch, tokens, heads * head_dim}, qkv.options());
  const float *qkv_data = qkv.data_ptr<float>(), *turn_data = turns.data_ptr<float>();
  float *k_data = k_cache.data_ptr<float>(), *v_data = v_cache.data_ptr<float>(), *out_data = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t finish) {
    std::vector<float> scores, queries(group * head_dim);
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t b = task / kv_heads, kv = task % kv_heads;
      const int64_t cached = (row_entry(slots, b) * kv_heads + kv) * capacity * head_dim;  // this kv head's first position
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t position = row_entry(positions, b) + t;
        scores.resize(group * (position + 1));
        const float* row = qkv_data + (b * tokens + t) * width;
        const float* token_turns = turn_data + b * turns_stride + t * head_dim;
        rotate(row + (heads + kv) * head_dim, token_turns, head_dim, k_data + cached + position * head_dim);
        const float* value = row + (heads + kv_heads + kv) * head_dim;
        std::copy(value, value + head_dim, v_data + cached + position * head_dim);
        for (int64_t j = 0; j < group; ++j)
          rotate(row + (kv * group + j) * head_dim, token_turns, head_dim, queries.data() + j * head_dim);
        attend(queries.data(), k_data + cached, v_data + cached, head_dim, position + 1, group, head_dim,
               scores.data(), out_data + ((b * tokens + t) * heads + kv * group) * head_dim);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths) -> Tensor");
  m.def("decode_step_attention(Tensor qkv, Tensor turns, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor positions, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_step_attention", decode_step_attention);
}
