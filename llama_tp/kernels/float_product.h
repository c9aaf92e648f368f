// What the fp32 product kernels share across instruction sets (cpu_kernels.cpp for AVX-512,
// avx2_float_product.cpp for AVX2): their operands' checks, the product's output, and the split
// of its outputs among threads.

#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <vector>

namespace llama_tp {

// The output of x [..., width] fp32 times w [out_features, width] fp32, transposed: an empty
// [..., out_features] (any leading dimensions, as F.linear takes them: reshaping in Python cost
// 3.5 us of a 6 us call), after checking both operands.
inline at::Tensor float_product_output(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 [..., width]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(-1),
              "w must be contiguous fp32 [out_features, width]");
  std::vector<int64_t> y_shape(x.sizes().begin(), x.sizes().end());
  y_shape.back() = w.size(0);
  return at::empty(y_shape, x.options());
}

// The outputs split among threads, per_task at a time: body(first, last) on each thread's outputs
// [first, last), one contiguous run of weight rows.
template <typename Body>
void parallel_over_outputs(int64_t out_features, int64_t per_task, const Body& body) {
  const int64_t tasks = (out_features + per_task - 1) / per_task;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    body(begin * per_task, std::min(end * per_task, out_features));
  });
}

}  // namespace llama_tp
