// Products by grouped 4-bit weights (int4.py) for decoding on CPUs with AVX-512, and the same
// weights converted back to fp32 for prompts.
//
// codes [out][in / 2] as stored: each output's inputs in groups of 32, 16 bytes a group, byte j
// holding input j in its low four bits and input j + 16 in its high four (GGUF's order). scales
// and mins fp16 [out][groups]. A group's 32 weights take one of 16 values, code * scale + min:
// the kernel makes those 16 floats in one register (one multiply-add), widens the group's 16
// bytes into 16 lanes, and looks the weights up with vpermps, which takes only the low four bits
// of each lane as the index: the low codes as they are, the high ones after a shift. So a group
// costs one widening, one shift, two lookups and the table, then one multiply-add per 16 weights
// and row; the weights looked up are exactly those int4.dequantize computes (code * scale is
// exact in fp32, so the multiply-add rounds as its multiply then add does). Lanes are inputs: x
// is read as it lies, and each output's sums are added across the register at the end.
//
// That is about 8 vector instructions per 32 weights, and on Zen 4, which runs a 512-bit
// instruction as two 256-bit halves, they bound a one-row product rather than memory: see
// docs/int4.md for the measurements.

#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#include "quantized_products.h"
#include "simd.h"

namespace {

using llama_tp::first_lanes;
using llama_tp::kInt4Group;
using llama_tp::kLanes;

constexpr int64_t kChunkGroups = 64;  // groups whose scales and mins are turned into fp32 at a time
constexpr int64_t kAheadBytes = 4096;

// Rows x outputs in one pass over the outputs' codes: 4 x 2 make 16 sums of two registers each,
// which with the tables and weights fit the 32 registers; more rows take further passes over
// codes that are still in cache. One row takes 4 outputs a pass, for more sums in flight.
constexpr int kRowsPerPass = 4;
constexpr int64_t kOutputsPerPass = 2, kOutputsPerPassOfOneRow = 2;

// One output's scales and mins of a chunk of groups, in fp32.
struct Grid {
  alignas(64) float scale[kChunkGroups];
  alignas(64) float min[kChunkGroups];
};

// n fp16 values (n <= kChunkGroups) as fp32 into out.
void to_fp32(const at::Half* half, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += kLanes)
    _mm512_store_ps(out + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n - i), half + i)));
}

// The 16 values a group's codes stand for: code * scale + min.
__m512 values(float scale, float min) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(codes, _mm512_set1_ps(scale), _mm512_set1_ps(min));
}

// A group's 32 weights from its 16 bytes: inputs 0-15 into low, 16-31 into high.
void group_weights(const uint8_t* bytes, __m512 table, __m512& low, __m512& high) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  low = _mm512_permutexvar_ps(codes, table);  // the index is bits 0-3 of each lane
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

// y[r][o] = x[r] . w[o] for Rows rows of x (stride width) and Outputs consecutive outputs.
template <int Rows, int Outputs>
void int4_rows(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
               const float* x, float* y, int64_t y_stride) {
  const int64_t groups = width / kInt4Group, row_bytes = width / 2;
  __m512 sum[Rows][Outputs][2];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) sum[r][o][0] = sum[r][o][1] = _mm512_setzero_ps();
  Grid grid[Outputs];
  // The codes of as many outputs further on, asked for into L1 now (they are read a pass later or so).
  for (int64_t line = 0; line < Outputs * row_bytes; line += 64) { _mm_prefetch(reinterpret_cast<const char*>(codes) + line + kAheadBytes, _MM_HINT_T0); }
  for (int64_t first = 0; first < groups; first += kChunkGroups) {
    const int64_t chunk = std::min(kChunkGroups, groups - first);
    for (int o = 0; o < Outputs; ++o) {
      to_fp32(scales + o * groups + first, chunk, grid[o].scale);
      to_fp32(mins + o * groups + first, chunk, grid[o].min);
    }
    for (int64_t g = 0; g < chunk; ++g) {
      const int64_t input = (first + g) * kInt4Group;
      for (int o = 0; o < Outputs; ++o) {
        const uint8_t* bytes = codes + o * row_bytes + input / 2;
        __m512 low, high;
        group_weights(bytes, values(grid[o].scale[g], grid[o].min[g]), low, high);
        for (int r = 0; r < Rows; ++r) {
          const float* x_group = x + r * width + input;
          sum[r][o][0] = _mm512_fmadd_ps(low, _mm512_loadu_ps(x_group), sum[r][o][0]);
          sum[r][o][1] = _mm512_fmadd_ps(high, _mm512_loadu_ps(x_group + kLanes), sum[r][o][1]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o) y[r * y_stride + o] = _mm512_reduce_add_ps(_mm512_add_ps(sum[r][o][0], sum[r][o][1]));
}

template <int Outputs>
constexpr llama_tp::Int4Pass kInt4Rows[kRowsPerPass] = {int4_rows<1, Outputs>, int4_rows<2, Outputs>,
                                                        int4_rows<3, Outputs>, int4_rows<4, Outputs>};

// The kernels for `outputs` outputs a pass (kOutputsPerPassOfOneRow, kOutputsPerPass or 1).
const llama_tp::Int4Pass* int4_kernels(int64_t outputs) {
  return outputs == kOutputsPerPassOfOneRow ? kInt4Rows<kOutputsPerPassOfOneRow>
         : outputs == kOutputsPerPass       ? kInt4Rows<kOutputsPerPass>
                                            : kInt4Rows<1>;
}

// x [..., width] fp32 times the int4 weight, transposed: y [..., out_features] fp32.
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  const bool one_row = x.dim() >= 1 && x.size(-1) > 0 && x.numel() == x.size(-1);
  return llama_tp::int4_product_in_passes(x, codes, scales, mins, one_row ? kOutputsPerPassOfOneRow : kOutputsPerPass,
                                          kRowsPerPass, kAheadBytes,
                                          [](int64_t outputs, int rows) { return int4_kernels(outputs)[rows - 1]; });
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
      __m512 low, high;
      group_weights(codes + input / 2, values(grid.scale[g], grid.min[g]), low, high);
      _mm512_storeu_ps(out + input, low);
      _mm512_storeu_ps(out + input + kLanes, high);
    }
  }
}

// The int4 weight converted back: fp32 [out_features, width], for prompts' matrix products.
at::Tensor int4_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  return llama_tp::int4_weight_by_outputs(codes, scales, mins, convert_output);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) {
  m.def("int4_product(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  m.def("int4_weight(Tensor codes, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) {
  m.impl("int4_product", int4_product);
  m.impl("int4_weight", int4_weight);
}
