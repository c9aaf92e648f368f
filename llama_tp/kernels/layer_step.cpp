// A decoding step of a few tokens a row through consecutive int4 layers, in one call from Python:
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

// A layer's operands, in this order: attention_norm, ffn_norm, then codes, scales and mins of
// wqkv, wo, w13 and w2.
constexpr size_t kOperandsPerLayer = 14;
constexpr size_t kWqkv = 2, kWo = 5, kW13 = 8, kW2 = 11;

// x [batch, tokens, dim] fp32 through the layers whose operands are `operands` (kOperandsPerLayer
// each) and whose caches are k_pools[i], v_pools[i]; turns, tables, positions, heads and block as
// decode_step_attention takes them, hidden: the width of w13's gate (and of its up); buffer,
// rank, world_size, capacity and timeout_seconds: shared_sum's, or no buffer on one rank.
at::Tensor int4_layers_step(const at::Tensor& x, const std::vector<at::Tensor>& operands,
                            std::vector<at::Tensor> k_pools, std::vector<at::Tensor> v_pools, const at::Tensor& turns,
                            const at::Tensor& tables, const at::Tensor& positions, int64_t heads, int64_t block,
                            int64_t hidden, double eps, const c10::optional<at::Tensor>& buffer, int64_t rank,
                            int64_t world_size, int64_t capacity, double timeout_seconds) {
  const Exchange exchange{buffer, rank, world_size, capacity, timeout_seconds};
  const size_t layers = k_pools.size();
  TORCH_CHECK(operands.size() == layers * kOperandsPerLayer && v_pools.size() == layers,
              "int4_layers_step takes ", kOperandsPerLayer, " operands and two pools a layer");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be fp32 [batch, tokens, dim]");
  at::Tensor h = x.contiguous();
  for (size_t layer = 0; layer < layers; ++layer) {
    const size_t first = layer * kOperandsPerLayer;
    const at::Tensor qkv = int4_product(rms_norm(h, operands[first], eps), operands, first + kWqkv);
    const at::Tensor attended =
        attention(qkv, turns, k_pools[layer], v_pools[layer], tables, positions, heads, block);
    h = h + exchange.sum(int4_product(attended, operands, first + kWo));
    const at::Tensor gate_and_up = int4_product(rms_norm(h, operands[first + 1], eps), operands, first + kW13);
    const at::Tensor gate = gate_and_up.narrow(-1, 0, hidden), up = gate_and_up.narrow(-1, hidden, hidden);
    h = h + exchange.sum(int4_product((at::silu(gate) * up).contiguous(), operands, first + kW2));
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("int4_layers_step(Tensor x, Tensor[] operands, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor turns, "
        "Tensor tables, Tensor positions, int heads, int block, int hidden, float eps, Tensor? buffer, int rank, "
        "int world_size, int capacity, float timeout_seconds) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) { m.impl("int4_layers_step", int4_layers_step); }
