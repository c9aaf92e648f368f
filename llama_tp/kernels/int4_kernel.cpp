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

// Up to kDirectRows rows, a pass converts each group of a few outputs into registers and
// multiplies it by every row: as many outputs as keep 16 sums of two registers each (with the
// tables and weights, the 32 registers), 8 outputs for one row, 4 for two, 2 for three or four.
// The more outputs a pass takes, the more independent work hides each group's conversion: one
// row took 0.75-0.82x the time of passes of 2 outputs from cache, 0.89x streamed from memory
// (docs/history.md). From 5 rows on, converting again for every 4 rows cost as many
// instructions as the products, so a pass of kBlockOutputs outputs converts kBufferGroups groups
// of them at a time once into an fp32 buffer in L1, and all its rows (up to kMaxPassRows) read it
// kStepRows rows x kBlockOutputs outputs at a time. Each output still sums its groups' low and
// high halves in two sums, group after group, added at the end: the same operations in the same
// order as the direct pass, so a row's result does not depend on how many rows share its product.
constexpr int kDirectRows = 4;
constexpr int64_t kBlockOutputs = 4;
constexpr int64_t kBufferGroups = 24;  // kBlockOutputs x 768 inputs: 12 KB of fp32 weights (see docs/int4.md)
constexpr int kStepRows = 3;           // 3 rows x kBlockOutputs x 2 halves of sums, their inputs and a weight: 31 registers
constexpr int kMaxPassRows = 32;       // rows a pass through the buffer takes

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

// The sums of a's, b's, c's and d's lanes, each added in _mm512_reduce_add_ps's order (the
// 256-bit halves, then the 128-bit halves, then lanes 0 + 2 and 1 + 3, then those two): the same
// bits as reducing each register alone, in about half the instructions for four.
__m128 four_sums(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));  // a's 8 | b's 8
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)));
  const __m512 quarters = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)),
                                        _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)));  // 4 each
  const __m512 pairs = _mm512_add_ps(quarters, _mm512_permute_ps(quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, sums));
}

// y[0 .. Outputs - 1] = the sums of each output's two registers of sums (low and high halves of
// its groups), added together and then across their lanes.
template <int Outputs>
void store_sums(const __m512 (&halves)[Outputs][2], float* y) {
  __m512 sums[Outputs];
  for (int o = 0; o < Outputs; ++o) sums[o] = _mm512_add_ps(halves[o][0], halves[o][1]);
  if constexpr (Outputs % 4 == 0)
    for (int o = 0; o < Outputs; o += 4) _mm_storeu_ps(y + o, four_sums(sums[o], sums[o + 1], sums[o + 2], sums[o + 3]));
  else if constexpr (Outputs == 2)
    _mm_storel_pi(reinterpret_cast<__m64*>(y), four_sums(sums[0], sums[1], sums[0], sums[1]));
  else
    y[0] = _mm512_reduce_add_ps(sums[0]);
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
  // The codes of as many outputs further on, asked for into L1 (they are read a pass later or so):
  // with one row, which waits on memory more than on its multiply-adds, a few lines a group
  // (0.82-0.91x the time of asking all at once, streamed from memory); with more rows, all at once.
  const char* ahead = reinterpret_cast<const char*>(codes) + kAheadBytes;
  const int64_t lines = Outputs * row_bytes / 64, lines_per_group = (lines + groups - 1) / groups;
  int64_t line = 0;
  if constexpr (Rows > 1)
    for (; line < lines; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
  for (int64_t first = 0; first < groups; first += kChunkGroups) {
    const int64_t chunk = std::min(kChunkGroups, groups - first);
    for (int o = 0; o < Outputs; ++o) {
      to_fp32(scales + o * groups + first, chunk, grid[o].scale);
      to_fp32(mins + o * groups + first, chunk, grid[o].min);
    }
    for (int64_t g = 0; g < chunk; ++g) {
      const int64_t input = (first + g) * kInt4Group;
      if constexpr (Rows == 1)
        for (int64_t i = 0; i < lines_per_group && line < lines; ++i, ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
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
  for (int r = 0; r < Rows; ++r) store_sums<Outputs>(sum[r], y + r * y_stride);
}

// The outputs of a direct pass of `rows` rows (kInt4Direct[rows - 1]): 16 sums at most.
constexpr int64_t direct_outputs(int64_t rows) { return rows == 1 ? 8 : rows == 2 ? 4 : 2; }
constexpr llama_tp::Int4Pass kInt4Direct[kDirectRows] = {int4_rows<1, direct_outputs(1)>, int4_rows<2, direct_outputs(2)>,
                                                          int4_rows<3, direct_outputs(3)>, int4_rows<4, direct_outputs(4)>};
constexpr llama_tp::Int4Pass kInt4DirectOne[kDirectRows] = {int4_rows<1, 1>, int4_rows<2, 1>, int4_rows<3, 1>,
                                                            int4_rows<4, 1>};

// sums[r][o][half] += the products of `groups` groups' low and high halves: w[o] (stride
// kBufferGroups groups) and x[r] (stride width) both start at the first group.
template <int Rows, int Outputs>
void add_buffered_products(const float* w, int64_t groups, const float* x, int64_t width, __m512 (*sums)[Outputs][2]) {
  __m512 sum[Rows][Outputs][2];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o)
      for (int half = 0; half < 2; ++half) sum[r][o][half] = sums[r][o][half];
  for (int64_t input = 0; input < groups * kInt4Group; input += kInt4Group) {
    __m512 x_group[Rows][2];
    for (int r = 0; r < Rows; ++r)
      for (int half = 0; half < 2; ++half) {
        x_group[r][half] = _mm512_loadu_ps(x + r * width + input + half * kLanes);
        asm("" : "+v"(x_group[r][half]));  // held in a register: gcc folds a load into each multiply-add that uses it
      }
    for (int o = 0; o < Outputs; ++o)
      for (int half = 0; half < 2; ++half) {
        __m512 weight = _mm512_load_ps(w + o * kBufferGroups * kInt4Group + input + half * kLanes);
        asm("" : "+v"(weight));
        for (int r = 0; r < Rows; ++r) sum[r][o][half] = _mm512_fmadd_ps(weight, x_group[r][half], sum[r][o][half]);
      }
  }
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < Outputs; ++o)
      for (int half = 0; half < 2; ++half) sums[r][o][half] = sum[r][o][half];
}

// y[r][o] = x[r] . w[o] for `rows` rows of x (up to kMaxPassRows, stride width) and Outputs
// consecutive outputs, their weights converted a chunk at a time into a buffer all rows read.
template <int Outputs>
void int4_buffered(int rows, const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
                   const float* x, float* y, int64_t y_stride) {
  const int64_t groups = width / kInt4Group, row_bytes = width / 2;
  alignas(64) float weights[Outputs][kBufferGroups * kInt4Group];
  __m512 sums[kMaxPassRows][Outputs][2];  // [row][output][low or high half]
  std::fill_n(&sums[0][0][0], rows * Outputs * 2, _mm512_setzero_ps());
  for (int64_t line = 0; line < Outputs * row_bytes; line += 64) { _mm_prefetch(reinterpret_cast<const char*>(codes) + line + kAheadBytes, _MM_HINT_T0); }
  Grid grid[Outputs];
  for (int64_t first = 0; first < groups; first += kBufferGroups) {
    const int64_t chunk = std::min(kBufferGroups, groups - first);
    for (int o = 0; o < Outputs; ++o) {
      to_fp32(scales + o * groups + first, chunk, grid[o].scale);
      to_fp32(mins + o * groups + first, chunk, grid[o].min);
      for (int64_t g = 0; g < chunk; ++g) {
        __m512 low, high;
        group_weights(codes + o * row_bytes + (first + g) * kInt4Group / 2, values(grid[o].scale[g], grid[o].min[g]),
                      low, high);
        _mm512_store_ps(weights[o] + g * kInt4Group, low);
        _mm512_store_ps(weights[o] + g * kInt4Group + kLanes, high);
      }
    }
    const float* x_chunk = x + first * kInt4Group;
    int r = 0;
    for (; r + kStepRows <= rows; r += kStepRows)
      add_buffered_products<kStepRows, Outputs>(weights[0], chunk, x_chunk + r * width, width, sums + r);
    for (; r < rows; ++r)
      add_buffered_products<1, Outputs>(weights[0], chunk, x_chunk + r * width, width, sums + r);
  }
  for (int r = 0; r < rows; ++r) store_sums<Outputs>(sums[r], y + r * y_stride);
}

// A pass of `outputs` outputs and `rows` rows: direct_outputs(rows) converted in registers for up
// to kDirectRows rows, kBlockOutputs through the buffer, and a task's last outputs one at a time.
struct Int4Pass {
  int64_t outputs;
  int rows;
  void operator()(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t width,
                  const float* x, float* y, int64_t y_stride) const {
    if (rows <= kDirectRows && outputs == direct_outputs(rows))
      kInt4Direct[rows - 1](codes, scales, mins, width, x, y, y_stride);
    else if (rows <= kDirectRows && outputs == 1)
      kInt4DirectOne[rows - 1](codes, scales, mins, width, x, y, y_stride);
    else if (outputs == kBlockOutputs)  // also a product's last few rows after passes of kMaxPassRows
      int4_buffered<kBlockOutputs>(rows, codes, scales, mins, width, x, y, y_stride);
    else
      int4_buffered<1>(rows, codes, scales, mins, width, x, y, y_stride);
  }
};

// x [..., width] fp32 times the int4 weight, transposed: y [..., out_features] fp32.
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
  const int64_t rows = x.size(-1) > 0 ? x.numel() / x.size(-1) : 0;
  const bool direct = rows <= kDirectRows;
  return llama_tp::int4_product_in_passes(x, codes, scales, mins, direct ? direct_outputs(rows) : kBlockOutputs,
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
