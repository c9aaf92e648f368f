// A decoding step of a few tokens a row through consecutive int4 or int8 layers, in one call from Python:
// the same kernels and torch operators, in the same order, as TransformerBlock's step through our
// kernels, without Python between them. In the demo model's batch-1 step in int4 (30 layers, 12
// kernel calls and operators a layer), the Python between the calls took about as long as the
// norms, the attention and the small operators themselves (docs/int4.md).
//
// Each layer: norm, wqkv's product, the attention (rotation and cache write included), wo's
// product summed over the ranks, the residual; norm, w13's product, silu(gate) * up, w2's product
// summed over the ranks, the residual. Several model-parallel ranks sum through the C++ exchange
// in shared memory (parallel/shared_memory.cpp), as all_reduce does between them.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

// The operators this file calls, registered by the kernels beside it (either build's): found once.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("llama_tp::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

// x times the int4 weight of operands[first, first + 3): codes, scales, mins.
at::Tensor int4_product(const at::Tensor& x, const std::vector<at::Tensor>& operands, size_t first) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("llama_tp::int4_product", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(x, operands[first], operands[first + 1], operands[first + 2]);
}

// x [..., width] times the blocked int8 weight of operands[first, first + 3): q, scales, zeros
// (int8.product's rows, one after another).
at::Tensor int8_product(const at::Tensor& x, const std::vector<at::Tensor>& operands, size_t first,
                        int64_t out_features) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("llama_tp::int8_product", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t)>();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  return op.call(rows, operands[first], operands[first + 1], operands[first + 2], out_features).view(shape);
}

at::Tensor attention(const at::Tensor& qkv, const at::Tensor& turns, at::Tensor& k_pool, at::Tensor& v_pool,
                     const at::Tensor& tables, const at::Tensor& positions, int64_t heads, int64_t block) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("llama_tp::decode_step_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, int64_t)>();
  return op.call(qkv, turns, k_pool, v_pool, tables, positions, heads, block);
}

// The sum of every rank's x through the shared buffer; x itself where there is none (one rank).
struct Exchange {
  c10::optional<at::Tensor> buffer;
  int64_t rank, world_size, capacity;
  double timeout_seconds;

  at::Tensor sum(const at::Tensor& x) const {
    if (!buffer) return x;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("llama_tp::shared_sum", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, double)>();
    return op.call(x, *buffer, rank, world_size, capacity, timeout_seconds);
  }
};

// A layer's operands, in this order: attention_norm, ffn_norm, then the three tensors of wqkv's,
// wo's, w13's and w2's weight (int4: codes, scales, mins; int8: q, scales, zeros).
constexpr size_t kOperandsPerLayer = 14;
constexpr size_t kWqkv = 2, kWo = 5, kW13 = 8, kW2 = 11;

// x [batch, tokens, dim] fp32 through the layers whose operands are `operands` (kOperandsPerLayer
// each) and whose caches are k_pools[i], v_pools[i]; bits: 4 or 8, the weights' kind;
// out_features: each layer's wqkv, wo, w13 and w2 output widths (int8's blocks are padded);
// turns, tables, positions, heads and block as decode_step_attention takes them; hidden: the
// width of w13's gate (and of its up); buffer, rank, world_size, capacity and timeout_seconds:
// shared_sum's, or no buffer on one rank.
at::Tensor quantized_layers_step(const at::Tensor& x, const std::vector<at::Tensor>& operands, int64_t bits,
                                 at::IntArrayRef out_features, std::vector<at::Tensor> k_pools,
                                 std::vector<at::Tensor> v_pools, const at::Tensor& turns, const at::Tensor& tables,
                                 const at::Tensor& positions, int64_t heads, int64_t block, int64_t hidden, double eps,
                                 const c10::optional<at::Tensor>& buffer, int64_t rank, int64_t world_size,
                                 int64_t capacity, double timeout_seconds) {
  const size_t layers = k_pools.size();
  TORCH_CHECK(operands.size() == layers * kOperandsPerLayer && v_pools.size() == layers &&
              out_features.size() == layers * 4, "quantized_layers_step takes ", kOperandsPerLayer,
              " operands, four output widths and two pools a layer");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be fp32 [batch, tokens, dim]");
  const Exchange exchange{buffer, rank, world_size, capacity, timeout_seconds};
  at::Tensor h = x.contiguous();
  for (size_t layer = 0; layer < layers; ++layer) {
    const size_t first = layer * kOperandsPerLayer;
    const auto product = [&](const at::Tensor& input, size_t weight, int which) {
      return bits == 4 ? int4_product(input, operands, first + weight)
                       : int8_product(input, operands, first + weight, out_features[layer * 4 + which]);
    };
    const at::Tensor qkv = product(rms_norm(h, operands[first], eps), kWqkv, 0);
    const at::Tensor attended =
        attention(qkv, turns, k_pools[layer], v_pools[layer], tables, positions, heads, block);
    h = h + exchange.sum(product(attended, kWo, 1));
    const at::Tensor gate_and_up = product(rms_norm(h, operands[first + 1], eps), kW13, 2);
    const at::Tensor gate = gate_and_up.narrow(-1, 0, hidden), up = gate_and_up.narrow(-1, hidden, hidden);
    h = h + exchange.sum(product((at::silu(gate) * up).contiguous(), kW2, 3));
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("quantized_layers_step(Tensor x, Tensor[] operands, int bits, int[] out_features, Tensor(a!)[] k_pools, "
        "Tensor(b!)[] v_pools, Tensor turns, "
        "Tensor tables, Tensor positions, int heads, int block, int hidden, float eps, Tensor? buffer, int rank, "
        "int world_size, int capacity, float timeout_seconds) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) { m.impl("quantized_layers_step", quantized_layers_step); }
