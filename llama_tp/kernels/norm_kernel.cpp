// rms_norm on CPUs with AVX-512 or AVX2 (float_lanes.h): the norm in one pass over each row, where
// torch's takes six. torch's CPU rms_norm is six operations, each a pass over x and a dispatch: in
// a decoding step, where the weights just streamed through have pushed everything else out of the
// caches, 28-54 us a call, 61 calls a step.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>

#include "float_lanes.h"

namespace {

namespace lanes = llama_tp::lanes;
using lanes::Floats;
using lanes::kWidth;

// Each row of x [..., dim] divided by its root mean square, times weight [dim].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 [..., dim]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous(), "weight must be contiguous fp32 [dim]");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  at::Tensor y = at::empty_like(x);
  const float *x_data = x.data_ptr<float>(), *w_data = weight.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  constexpr int64_t kRowsPerThread = 64;  // fewer rows than this are not worth waking a thread
  at::parallel_for(0, rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* in = x_data + row * dim;
      float* out = y_data + row * dim;
      Floats squares = lanes::zeros();
      for (int64_t i = 0; i < dim; i += kWidth) {
        const Floats values = lanes::load_first(in + i, dim - i);
        squares = lanes::fmadd(values, values, squares);
      }
      const Floats scale = lanes::broadcast(1.0f / std::sqrt(lanes::sum(squares) / dim + static_cast<float>(eps)));
      for (int64_t i = 0; i < dim; i += kWidth) {
        const Floats normed = lanes::mul(lanes::load_first(in + i, dim - i), scale);
        lanes::store_first(out + i, dim - i, lanes::mul(normed, lanes::load_first(w_data + i, dim - i)));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) { m.impl("rms_norm", rms_norm); }
