// Matrix products for decoding (a few rows of fp32 activations) on CPUs with AVX-512, where
// reading the weight is the cost: both kernels keep several independent sums in flight and ask
// for the weight ahead of their reads (simd.h says how far).
//
// float_product: a plain fp32 weight [out, in], as MKL and oneDNN also read it. Each output's
// row is summed in registers of 16 inputs and the registers summed at the end.
//
// int8_product: grouped int8 weights (int8.py) in blocks of 16 output channels, each block
// input-major: q[block][input][lane]. One 16-byte load then holds one input's weights for 16
// outputs, which widen into one register of 16 floats, and no sum ever runs across a register.
// scales and zeros are [block][group][lane]. With a group's weights w = q * scale + zero,
//   y = sum over groups of scale * (q . x over the group) + zero * (sum of x over the group),
// so the inner loop is one widening and one multiply-add per 16 weights and row.

#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>

#include "float_product.h"
#include "quantized_products.h"
#include "simd.h"

namespace {

using llama_tp::first_lanes;
using llama_tp::kLanes;
using llama_tp::prefetch_ahead;
using llama_tp::prefetch_near;

// ---- float_product ----

// Rows of x multiplied in one pass over the weight rows of 4 outputs, read side by side, which
// stay in cache for the next pass: 4 rows x 4 outputs make 16 sums, which with the weight and x
// registers fit the 32 registers. Four weight rows at a time also keep one or two rows' sums
// from waiting on each other. 8 rows x 2 outputs in one pass took 6% longer for 8 rows.
// A single row reads one weight row at a time, in one stream: through the demo model's layers on
// the AMD EPYC (Zen 4) machine, 4 side by side took 11% longer (23.7 against 21.1 ms, a plain
// read of the same weights 20.2), while at 8 rows one at a time took 12% longer.
constexpr int kFloatRowsPerPass = 4;
constexpr int64_t kOutputsPerPass = 4, kOutputsPerPassOfOneRow = 1;
constexpr int64_t kOutputsPerTask = 16;  // outputs a thread takes at a time

// More than 4 rows take several passes over a group's weight rows: the first reads them from
// memory, the others from cache while the memory would idle. So a pass of several rows asks for
// the group two on, a share of its lines each pass, spread over the pass's steps, into L2: at 16
// rows the demo model's layers then took 0.81-0.85x the time, at 8 rows 0.86-0.91x, at 2-4 rows
// (one pass) the same (the next group alone: about the same; 4 and 8 on: less). A product of one
// row asks for its own stream ahead (prefetch_ahead).
constexpr int64_t kGroupsAhead = 2;

// Where a pass asks for weights ahead: `bytes` of a later group's lines each step of 16 inputs,
// from `next`; none (bytes 0) for a pass of one row, which asks for its own stream ahead.
struct Ahead {
  const char* next;
  int64_t bytes;
};

// y[r][o] = x[r] . w[o] for Rows rows and Outputs outputs (row strides width; y's y_stride).
template <int Rows, int Outputs>
void float_rows(const float* w, const float* x, int64_t width, float* y, int64_t y_stride, Ahead ahead) {
  __m512 sum[Rows][Outputs];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) sum[r][o] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes, ahead.next += ahead.bytes) {
    if (ahead.bytes == 0) {
      for (int o = 0; o < Outputs; ++o) prefetch_ahead(w + o * width + i);
    } else {
      for (int64_t line = 0; line < ahead.bytes; line += 64) _mm_prefetch(ahead.next + line, _MM_HINT_T1);
      for (int o = 0; o < Outputs; ++o) prefetch_near(w + o * width + i);
    }
    __m512 weights[Outputs];
    for (int o = 0; o < Outputs; ++o) weights[o] = _mm512_loadu_ps(w + o * width + i);
    for (int r = 0; r < Rows; ++r) {
      const __m512 inputs = _mm512_loadu_ps(x + r * width + i);
      for (int o = 0; o < Outputs; ++o) sum[r][o] = _mm512_fmadd_ps(weights[o], inputs, sum[r][o]);
    }
  }
  if (i < width) {  // the last inputs, fewer than a register
    const __mmask16 tail = first_lanes(width - i);
    for (int r = 0; r < Rows; ++r) {
      const __m512 inputs = _mm512_maskz_loadu_ps(tail, x + r * width + i);
      for (int o = 0; o < Outputs; ++o)
        sum[r][o] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + o * width + i), inputs, sum[r][o]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) y[r * y_stride + o] = _mm512_reduce_add_ps(sum[r][o]);
}

using FloatRows = void (*)(const float*, const float*, int64_t, float*, int64_t, Ahead);

template <int Outputs>
constexpr FloatRows kFloatRows[kFloatRowsPerPass] = {float_rows<1, Outputs>, float_rows<2, Outputs>,
                                                    float_rows<3, Outputs>, float_rows<4, Outputs>};

// The kernels for a pass of `rows` rows and `outputs` outputs, the outputs split as 4, 2 or 1.
void float_pass(const float* w, const float* x, int64_t width, float* y, int64_t y_stride, int rows,
                int64_t outputs, Ahead ahead) {
  for (int64_t o = 0; o < outputs;) {
    const int64_t step = outputs - o >= 4 ? 4 : outputs - o >= 2 ? 2 : 1;
    const FloatRows* kernels = step == 4 ? kFloatRows<4> : step == 2 ? kFloatRows<2> : kFloatRows<1>;
    kernels[rows - 1](w + o * width, x, width, y + o, y_stride, ahead);
    o += step;
  }
}

// x [..., width] fp32 times w [out_features, width] fp32, transposed: y [..., out_features].
at::Tensor float_product(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = llama_tp::float_product_output(x, w);
  const int64_t width = x.size(-1), rows = x.numel() / width, out_features = w.size(0);
  const float *w_data = w.data_ptr<float>(), *x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t per_pass = rows == 1 ? kOutputsPerPassOfOneRow : kOutputsPerPass;
  const int64_t passes = (rows + kFloatRowsPerPass - 1) / kFloatRowsPerPass;
  const int64_t steps = std::max<int64_t>(width / kLanes, 1);
  // a group's lines over all its passes' steps, whole lines each step (past the weight's end the
  // requests ask for nothing: a prefetch never faults)
  const int64_t group_bytes = per_pass * width * static_cast<int64_t>(sizeof(float));
  const int64_t ahead_bytes = rows == 1 ? 0 : ((group_bytes + passes * steps - 1) / (passes * steps) + 63) / 64 * 64;
  llama_tp::parallel_over_outputs(out_features, kOutputsPerTask, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; o += per_pass) {
      const int64_t outputs = std::min(per_pass, last - o);
      const char* later_group = reinterpret_cast<const char*>(w_data + (o + kGroupsAhead * per_pass) * width);
      for (int64_t row = 0, pass = 0; row < rows; row += kFloatRowsPerPass, ++pass) {
        const int pass_rows = static_cast<int>(std::min<int64_t>(kFloatRowsPerPass, rows - row));
        float_pass(w_data + o * width, x_data + row * width, width, y_data + row * out_features + o,
                   out_features, pass_rows, outputs, {later_group + pass * steps * ahead_bytes, ahead_bytes});
      }
    }
  });
  return y;
}

// ---- int8_product ----

// Rows multiplied in one pass over a block: 4 rows x 4 partial sums + a weight fit the 32 registers.
constexpr int kRowsPerPass = 4;
constexpr int kPartials = 4;  // independent sums per row, so multiply-adds do not wait on each other

__m512 widen(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// y[r][lane] for one block and Rows rows of x (row stride width), storing its first `count` lanes.
template <int Rows>
void block_product(const int8_t* q, const float* scales, const float* zeros, const float* x,
                   const float* x_sums, int64_t width, int64_t groups, float* y, int64_t y_stride,
                   int64_t count) {
  const int64_t size = width / groups;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* q_group = q + g * size * kLanes;
    const float* x_group = x + g * size;
    __m512 dot[Rows][kPartials];
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < kPartials; ++p) dot[r][p] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kPartials <= size; i += kPartials) {  // one 64-byte cache line of weights
      prefetch_ahead(q_group + i * kLanes);
      for (int p = 0; p < kPartials; ++p) {
        const __m512 w = widen(q_group + (i + p) * kLanes);
        for (int r = 0; r < Rows; ++r)
          dot[r][p] = _mm512_fmadd_ps(w, _mm512_set1_ps(x_group[r * width + i + p]), dot[r][p]);
      }
    }
    for (; i < size; ++i) {  // groups narrower than kPartials inputs
      const __m512 w = widen(q_group + i * kLanes);
      for (int r = 0; r < Rows; ++r)
        dot[r][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(x_group[r * width + i]), dot[r][0]);
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * kLanes);
    const __m512 zero = _mm512_loadu_ps(zeros + g * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(dot[r][0], dot[r][1]), _mm512_add_ps(dot[r][2], dot[r][3]));
      acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
    }
  }
  const __mmask16 lanes = first_lanes(count);  // the last block may be partial
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(y + r * y_stride, lanes, acc[r]);
}

constexpr llama_tp::Int8Pass kBlockProducts[kRowsPerPass] = {block_product<1>, block_product<2>, block_product<3>,
                                                             block_product<4>};

// x [rows, width] fp32 times the blocked weight, transposed: y [rows, out_features] fp32.
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t out_features) {
  return llama_tp::int8_product_in_passes(x, q, scales, zeros, out_features, kRowsPerPass, kBlockProducts);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("float_product(Tensor x, Tensor w) -> Tensor");
  m.def("int8_product(Tensor x, Tensor q, Tensor scales, Tensor zeros, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) {
  m.impl("float_product", float_product);
  m.impl("int8_product", int8_product);
}
