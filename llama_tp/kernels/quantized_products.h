// What the int4 and int8 products share across instruction sets (int4_kernel.cpp and
// cpu_kernels.cpp for AVX-512, avx2_kernels.cpp for AVX2): their operands' checks, and the loops
// that split a product among threads and hand each kernel its passes. Only the passes, which
// hold the registers, differ.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <vector>

namespace llama_tp {

constexpr int64_t kInt4Group = 32, kInt4GroupBytes = kInt4Group / 2;  // inputs a group, and its bytes
constexpr int64_t kInt4OutputsPerTask = 16;                           // outputs a thread takes at a time
constexpr int64_t kInt8BlockLanes = 16;  // outputs a block of int8.py's layout holds

inline void check_int4_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              codes.size(1) % kInt4GroupBytes == 0, "codes must be contiguous uint8 [out_features, width / 2], width a multiple of 32");
  const std::vector<int64_t> grid_shape = {codes.size(0), codes.size(1) / kInt4GroupBytes};
  for (const at::Tensor* grid : {&scales, &mins})
    TORCH_CHECK(grid->sizes() == grid_shape && grid->scalar_type() == at::kHalf && grid->is_contiguous(),
                "scales and mins must be contiguous fp16 [out_features, width / 32]");
}

// A pass of an int4 product: y[r][o] = x[r] . w[o] for some rows of x (stride width) and some
// consecutive outputs, from their codes, scales and mins.
using Int4Pass = void (*)(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
                          const float* x, float* y, int64_t y_stride);

// x [..., width] fp32 times the int4 weight, transposed: y [..., out_features] fp32. Each pass
// takes outputs_per_pass outputs (the last few of a thread's one at a time) and up to
// rows_per_pass rows: pass_for(outputs, rows) is its kernel. A thread asks for its first
// ahead_bytes of codes at once; the passes ask for the rest.
template <typename PassFor>
at::Tensor int4_product_in_passes(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& mins, int64_t outputs_per_pass, int rows_per_pass,
                                  int64_t ahead_bytes, PassFor pass_for) {
  check_int4_weight(codes, scales, mins);
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(-1) == 2 * codes.size(1),
              "x must be contiguous fp32 [..., width]");
  const int64_t width = x.size(-1), rows = x.numel() / width, out_features = codes.size(0), groups = scales.size(1);
  std::vector<int64_t> y_shape(x.sizes().begin(), x.sizes().end());
  y_shape.back() = out_features;
  at::Tensor y = at::empty(y_shape, x.options());
  const uint8_t* code_data = codes.data_ptr<uint8_t>();
  const at::Half *scale_data = scales.data_ptr<at::Half>(), *min_data = mins.data_ptr<at::Half>();
  const float* x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t tasks = (out_features + kInt4OutputsPerTask - 1) / kInt4OutputsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kInt4OutputsPerTask, last = std::min(end * kInt4OutputsPerTask, out_features);
    for (int64_t line = 0; line < std::min(ahead_bytes, (last - first) * width / 2); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(code_data + first * width / 2) + line, _MM_HINT_T0);
    for (int64_t o = first; o < last;) {
      const int64_t outputs = last - o >= outputs_per_pass ? outputs_per_pass : 1;
      for (int64_t row = 0; row < rows; row += rows_per_pass) {  // the outputs' codes stay in cache between passes
        const int pass_rows = static_cast<int>(std::min<int64_t>(rows_per_pass, rows - row));
        pass_for(outputs, pass_rows)(code_data + o * width / 2, scale_data + o * groups, min_data + o * groups, width,
                                     x_data + row * width, y_data + row * out_features + o, out_features);
      }
      o += outputs;
    }
  });
  return y;
}

// The int4 weight converted back: fp32 [out_features, width]. convert(codes, scales, mins,
// width, out) writes one output's weights.
template <typename ConvertOutput>
at::Tensor int4_weight_by_outputs(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                                  ConvertOutput convert) {
  check_int4_weight(codes, scales, mins);
  const int64_t out_features = codes.size(0), width = 2 * codes.size(1), groups = scales.size(1);
  at::Tensor weight = at::empty({out_features, width}, codes.options().dtype(at::kFloat));
  const uint8_t* code_data = codes.data_ptr<uint8_t>();
  const at::Half *scale_data = scales.data_ptr<at::Half>(), *min_data = mins.data_ptr<at::Half>();
  float* weight_data = weight.data_ptr<float>();
  at::parallel_for(0, out_features, kInt4OutputsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      convert(code_data + o * width / 2, scale_data + o * groups, min_data + o * groups, width, weight_data + o * width);
  });
  return weight;
}

// A pass of an int8 product over one block: y[r][lane] for some rows of x (stride width), from
// the block's q, scales and zeros and each row's sums of x over each group, storing the block's
// first `count` lanes (the last block may be partial).
using Int8Pass = void (*)(const int8_t* q, const float* scales, const float* zeros, const float* x,
                          const float* x_sums, int64_t width, int64_t groups, float* y, int64_t y_stride,
                          int64_t count);

// x [rows, width] fp32 times the blocked int8 weight, transposed: y [rows, out_features] fp32,
// each block in passes of up to rows_per_pass rows (passes[rows - 1]).
inline at::Tensor int8_product_in_passes(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                         const at::Tensor& zeros, int64_t out_features, int rows_per_pass,
                                         const Int8Pass* passes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [rows, width]");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kInt8BlockLanes && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q must be contiguous int8 [blocks, width, 16]");
  const int64_t rows = x.size(0), width = x.size(1), blocks = q.size(0), groups = scales.size(1);
  TORCH_CHECK(q.size(1) == width && width % groups == 0 && blocks * kInt8BlockLanes >= out_features, "shapes do not match");
  TORCH_CHECK(scales.sizes() == zeros.sizes() && scales.size(0) == blocks && scales.size(2) == kInt8BlockLanes &&
              scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat &&
              scales.is_contiguous() && zeros.is_contiguous(), "scales and zeros must be contiguous fp32 [blocks, groups, 16]");
  const at::Tensor x_sums = x.view({rows, groups, width / groups}).sum(2).contiguous();  // rows, groups
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const int8_t* q_data = q.data_ptr<int8_t>();
  const float *scale_data = scales.data_ptr<float>(), *zero_data = zeros.data_ptr<float>();
  const float *x_data = x.data_ptr<float>(), *x_sum_data = x_sums.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t row = 0; row < rows; row += rows_per_pass) {  // the block stays in cache between passes
        const int pass_rows = static_cast<int>(std::min<int64_t>(rows_per_pass, rows - row));
        passes[pass_rows - 1](q_data + block * width * kInt8BlockLanes, scale_data + block * groups * kInt8BlockLanes,
                              zero_data + block * groups * kInt8BlockLanes, x_data + row * width,
                              x_sum_data + row * groups, width, groups,
                              y_data + row * out_features + block * kInt8BlockLanes, out_features,
                              out_features - block * kInt8BlockLanes);
      }
    }
  });
  return y;
}

}  // namespace llama_tp
