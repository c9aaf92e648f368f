// The quantized products for CPUs with AVX2 but not AVX-512: int4_kernel.cpp's two operators and
// cpu_kernels.cpp's int8_product, on the same layouts, with registers of 8 floats instead of 16.
// Without them an int4 or int8 layer converts its weight back through torch at every step: on
// the demo model's int8 output head (AMD EPYC, one thread) that took 51 ms a token.
//
// int4: AVX2 has no 16-entry lookup (its vpermps takes 3 bits), so each code is turned into a
// float and multiplied and added to its group's scale and min: the same single rounding as the
// AVX-512 kernel's table, so both convert back exactly what int4.dequantize computes. A group's
// 16 bytes widen 8 at a time into 8 lanes: their low four bits are inputs 0-7 (then 8-15), the
// high four inputs 16-23 (then 24-31). That is 14 instructions a group and output, then one
// multiply-add per 8 weights and row.
//
// Up to 4 rows, a pass of 2 outputs converts each group into registers and multiplies it by
// every row at once. One or two rows split each output's sum in 4 or 2 (8 sums in all): with one
// sum an output waited out a multiply-add's latency (4 cycles) per 8 weights. From 5 rows on,
// converting again for every 4 rows cost nearly as many instructions as the products, so a pass
// of 4 outputs converts 16 groups of them at a time once into an fp32 buffer in L1, and all its
// rows (up to 32) read the buffer 2 rows x 4 outputs at a time: 2 inputs and 4 weights loaded for
// 8 multiply-adds. Timed alone on the demo model's shapes (AMD EPYC, AVX2, one thread, old and new
// kernel in turn, best of 3), its 30 layers' int4 products took, before and after: 1 row 11.8 ->
// 9.5 ms, 4 rows 16.8 -> 16.2 ms, 8 rows 33.1 -> 28.6 ms, 16 rows 66.9 -> 49.1 ms. Chunks of 8 KB
// of fp32 weights were a little faster than 4 or 2 KB; asking for the codes 8 KB ahead instead of
// 4 KB changed nothing.
//
// int8: a block's 16 outputs are two registers; as in cpu_kernels.cpp, each group's products
// q . x are summed first and then scaled, and its zero times the group's sum of x added.

#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#include "float_lanes.h"
#include "quantized_products.h"

namespace {

using llama_tp::kInt4Group;
using llama_tp::kInt8BlockLanes;

constexpr int64_t kLanes = llama_tp::lanes::kWidth;  // 8: this file is built for AVX2 alone
constexpr int64_t kChunkGroups = 64;   // groups whose scales and mins are turned into fp32 at a time
constexpr int64_t kAheadBytes = 4096;  // weights asked for this far ahead of the pass reading them

constexpr int kDirectRows = 4;          // up to these rows, passes convert the weights into registers
constexpr int64_t kDirectOutputs = 2;   // outputs a pass of those takes
constexpr int64_t kBlockOutputs = 4;    // outputs a pass through the buffer takes
constexpr int64_t kBufferGroups = 16;   // kBlockOutputs x 512 inputs: 8 KB of fp32 weights
constexpr int kStepRows = 2;            // 2 rows x kBlockOutputs sums, their inputs and a weight: 11 registers
constexpr int kMaxPassRows = 32;        // int4.MAX_ROWS: rows a pass through the buffer takes

// One output's scales and mins of a chunk of groups, in fp32.
struct Grid {
  alignas(32) float scale[kChunkGroups];
  alignas(32) float min[kChunkGroups];
};

// n fp16 values (n <= kChunkGroups) as fp32 into out.
void to_fp32(const at::Half* half, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    _mm256_store_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i))));
  for (; i < n; ++i) out[i] = static_cast<float>(half[i]);
}

// A group's 32 weights from its 16 bytes, in four registers of 8 inputs each (0-7, 8-15, 16-23, 24-31).
void group_weights(const uint8_t* bytes, float scale, float min, __m256 w[4]) {
  const __m256 scales = _mm256_set1_ps(scale), mins = _mm256_set1_ps(min);
  const __m256i low_bits = _mm256_set1_epi32(0xF);
  for (int half = 0; half < 2; ++half) {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + half * kLanes)));
    w[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(codes, low_bits)), scales, mins);
    w[half + 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(codes, 4)), scales, mins);
  }
}

void prefetch_ahead(const uint8_t* codes, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes) + line + kAheadBytes, _MM_HINT_T0);
}

// y[r][o] = x[r] . w[o] for Rows rows of x (stride width) and Outputs consecutive outputs,
// converting each group's weights into registers. A weight register's products of a row go to
// sum[part % kPartSums], so that one or two rows still have 8 sums to add to at a time.
template <int Rows, int Outputs>
void int4_direct(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
                 const float* x, float* y, int64_t y_stride) {
  constexpr int kPartSums = Rows > 2 ? 1 : 4 / Rows;
  const int64_t groups = width / kInt4Group, row_bytes = width / 2;
  __m256 sum[Rows][Outputs][kPartSums];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o)
      for (int s = 0; s < kPartSums; ++s) sum[r][o][s] = _mm256_setzero_ps();
  Grid grid[Outputs];
  prefetch_ahead(codes, Outputs * row_bytes);
  for (int64_t first = 0; first < groups; first += kChunkGroups) {
    const int64_t chunk = std::min(kChunkGroups, groups - first);
    for (int o = 0; o < Outputs; ++o) {
      to_fp32(scales + o * groups + first, chunk, grid[o].scale);
      to_fp32(mins + o * groups + first, chunk, grid[o].min);
    }
    for (int64_t g = 0; g < chunk; ++g) {
      const int64_t input = (first + g) * kInt4Group;
      for (int o = 0; o < Outputs; ++o) {
        __m256 w[4];
        group_weights(codes + o * row_bytes + input / 2, grid[o].scale[g], grid[o].min[g], w);
        for (int r = 0; r < Rows; ++r)
          for (int part = 0; part < 4; ++part)
            sum[r][o][part % kPartSums] = _mm256_fmadd_ps(w[part], _mm256_loadu_ps(x + r * width + input + part * kLanes),
                                                          sum[r][o][part % kPartSums]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) {
      __m256 total = sum[r][o][0];
      for (int s = 1; s < kPartSums; ++s) total = _mm256_add_ps(total, sum[r][o][s]);
      y[r * y_stride + o] = llama_tp::lanes::sum(total);
    }
}

template <int Outputs>
constexpr llama_tp::Int4Pass kInt4Direct[kDirectRows] = {int4_direct<1, Outputs>, int4_direct<2, Outputs>,
                                                          int4_direct<3, Outputs>, int4_direct<4, Outputs>};

// sums[r][o] += x[r] . w[o] over `inputs` inputs, for Rows rows of x (stride width) and Outputs
// buffered outputs (stride kBufferGroups groups).
template <int Rows, int Outputs>
void add_buffered_products(const float* w, int64_t inputs, const float* x, int64_t width, __m256* sums) {
  __m256 sum[Rows][Outputs];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) sum[r][o] = sums[r * Outputs + o];
  for (int64_t i = 0; i < inputs; i += kLanes) {
    __m256 input[Rows];
    for (int r = 0; r < Rows; ++r) {
      input[r] = _mm256_loadu_ps(x + r * width + i);
      asm("" : "+x"(input[r]));  // held in a register: gcc folds a load into each multiply-add that uses it
    }
    for (int o = 0; o < Outputs; ++o) {
      __m256 weight = _mm256_load_ps(w + o * kBufferGroups * kInt4Group + i);
      asm("" : "+x"(weight));  // so: 6 loads for 8 multiply-adds, not 10
      for (int r = 0; r < Rows; ++r) sum[r][o] = _mm256_fmadd_ps(weight, input[r], sum[r][o]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) sums[r * Outputs + o] = sum[r][o];
}

// y[r][o] = x[r] . w[o] for `rows` rows of x (up to kMaxPassRows, stride width) and Outputs
// consecutive outputs, their weights converted a chunk at a time into a buffer all rows read.
template <int Outputs>
void int4_buffered(int rows, const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
                   const float* x, float* y, int64_t y_stride) {
  const int64_t groups = width / kInt4Group, row_bytes = width / 2;
  alignas(32) float weights[Outputs][kBufferGroups * kInt4Group];
  __m256 sums[kMaxPassRows * Outputs];
  std::fill(sums, sums + rows * Outputs, _mm256_setzero_ps());
  prefetch_ahead(codes, Outputs * row_bytes);
  for (int64_t first = 0; first < groups; first += kBufferGroups) {
    const int64_t chunk = std::min(kBufferGroups, groups - first);
    for (int o = 0; o < Outputs; ++o)
      for (int64_t g = 0; g < chunk; ++g) {
        const int64_t group = o * groups + first + g;
        __m256 w[4];
        group_weights(codes + o * row_bytes + (first + g) * kInt4Group / 2, static_cast<float>(scales[group]),
                      static_cast<float>(mins[group]), w);
        for (int part = 0; part < 4; ++part) _mm256_store_ps(weights[o] + g * kInt4Group + part * kLanes, w[part]);
      }
    const float* x_chunk = x + first * kInt4Group;
    int r = 0;
    for (; r + kStepRows <= rows; r += kStepRows)
      add_buffered_products<kStepRows, Outputs>(weights[0], chunk * kInt4Group, x_chunk + r * width, width, sums + r * Outputs);
    for (; r < rows; ++r)
      add_buffered_products<1, Outputs>(weights[0], chunk * kInt4Group, x_chunk + r * width, width, sums + r * Outputs);
  }
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < Outputs; ++o) y[r * y_stride + o] = llama_tp::lanes::sum(sums[r * Outputs + o]);
}

// A pass of `outputs` outputs and `rows` rows: kDirectOutputs converted in registers for up to
// kDirectRows rows, kBlockOutputs through the buffer, and a task's last outputs one at a time.
struct Int4Pass {
  int64_t outputs;
  int rows;
  void operator()(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
                  const float* x, float* y, int64_t y_stride) const {
    if (outputs == kBlockOutputs)
      int4_buffered<kBlockOutputs>(rows, codes, scales, mins, width, x, y, y_stride);
    else if (outputs == kDirectOutputs)
      kInt4Direct<kDirectOutputs>[rows - 1](codes, scales, mins, width, x, y, y_stride);
    else if (rows <= kDirectRows)
      kInt4Direct<1>[rows - 1](codes, scales, mins, width, x, y, y_stride);
    else
      int4_buffered<1>(rows, codes, scales, mins, width, x, y, y_stride);
  }
};

// x [..., width] fp32 times the int4 weight, transposed: y [..., out_features] fp32.
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  const bool direct = x.numel() <= kDirectRows * x.size(-1);
  return llama_tp::int4_product_in_passes(x, codes, scales, mins, direct ? kDirectOutputs : kBlockOutputs,
                                          direct ? kDirectRows : kMaxPassRows, kAheadBytes,
                                          [](int64_t outputs, int rows) { return Int4Pass{outputs, rows}; });
}

// One output's weights converted back, width of them into out.
void convert_output(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width, float* out) {
  const int64_t groups = width / kInt4Group;
  Grid grid;
  for (int64_t first = 0; first < groups; first += kChunkGroups) {
    const int64_t chunk = std::min(kChunkGroups, groups - first);
    to_fp32(scales + first, chunk, grid.scale);
    to_fp32(mins + first, chunk, grid.min);
    for (int64_t g = 0; g < chunk; ++g) {
      const int64_t input = (first + g) * kInt4Group;
      __m256 w[4];
      group_weights(codes + input / 2, grid.scale[g], grid.min[g], w);
      for (int part = 0; part < 4; ++part) _mm256_storeu_ps(out + input + part * kLanes, w[part]);
    }
  }
}

// The int4 weight converted back: fp32 [out_features, width], for prompts' matrix products.
at::Tensor int4_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  return llama_tp::int4_weight_by_outputs(codes, scales, mins, convert_output);
}

// ---- int8_product ----

constexpr int kInt8RowsPerPass = 2;  // 2 rows x 2 halves of sums and of totals, the weights, x: 11 registers

__m256 widen8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// y[r][lane] for one block and Rows rows of x (row stride width), storing its first `count` lanes.
template <int Rows>
void block_product(const int8_t* q, const float* scales, const float* zeros, const float* x,
                   const float* x_sums, int64_t width, int64_t groups, float* y, int64_t y_stride, int64_t count) {
  const int64_t size = width / groups;
  __m256 total[Rows][2];
  for (int r = 0; r < Rows; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* q_group = q + g * size * kInt8BlockLanes;
    const float* x_group = x + g * size;
    __m256 dot[Rows][2];
    for (int r = 0; r < Rows; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < size; ++i) {
      if (i % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(q_group + i * kInt8BlockLanes) + kAheadBytes, _MM_HINT_T0);
      const __m256 low = widen8(q_group + i * kInt8BlockLanes), high = widen8(q_group + i * kInt8BlockLanes + kLanes);
      for (int r = 0; r < Rows; ++r) {
        const __m256 input = _mm256_set1_ps(x_group[r * width + i]);
        dot[r][0] = _mm256_fmadd_ps(low, input, dot[r][0]);
        dot[r][1] = _mm256_fmadd_ps(high, input, dot[r][1]);
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 scale = _mm256_loadu_ps(scales + g * kInt8BlockLanes + half * kLanes);
      const __m256 zero = _mm256_loadu_ps(zeros + g * kInt8BlockLanes + half * kLanes);
      for (int r = 0; r < Rows; ++r) {
        total[r][half] = _mm256_fmadd_ps(dot[r][half], scale, total[r][half]);
        total[r][half] = _mm256_fmadd_ps(zero, _mm256_set1_ps(x_sums[r * groups + g]), total[r][half]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    alignas(32) float lanes[kInt8BlockLanes];
    _mm256_store_ps(lanes, total[r][0]);
    _mm256_store_ps(lanes + kLanes, total[r][1]);
    std::copy(lanes, lanes + std::min(count, kInt8BlockLanes), y + r * y_stride);  // the last block may be partial
  }
}

constexpr llama_tp::Int8Pass kBlockProducts[kInt8RowsPerPass] = {block_product<1>, block_product<2>};

// x [rows, width] fp32 times the blocked weight, transposed: y [rows, out_features] fp32.
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t out_features) {
  return llama_tp::int8_product_in_passes(x, q, scales, zeros, out_features, kInt8RowsPerPass, kBlockProducts);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("int4_product(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  m.def("int4_weight(Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_product(Tensor x, Tensor q, Tensor scales, Tensor zeros, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) {
  m.impl("int4_product", int4_product);
  m.impl("int4_weight", int4_weight);
  m.impl("int8_product", int8_product);
}
