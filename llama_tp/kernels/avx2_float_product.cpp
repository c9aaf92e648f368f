// float_product for CPUs with AVX2 but not AVX-512: x [..., width] fp32 times a plain fp32 weight
// [out, width], transposed, as cpu_kernels.cpp's AVX-512 kernel takes it (matmul.linear).
//
// Through oneDNN on its packed weights, a decoding step's products of the demo model's 30 layers
// took 72 ms for 16 rows on this project's AMD EPYC (AVX2, 2 threads): 47 GFLOP/s, neither the
// memory's speed (1 row: 38 ms) nor the multiply-adds' (2 a cycle a core). Here each pass takes 4
// consecutive outputs and up to 32 rows: up to 2 rows read them straight from memory; more take
// them a chunk of 512 inputs (8 KB) at a time, which stays in L1 while every pair of rows reads
// it, 2 inputs and 4 weights loaded for 8 multiply-adds (avx2_kernels.cpp's int4 passes, without
// converting). The first pair of rows asks for the next 4 outputs' weights as it reads these:
// they follow in memory, 4 x width floats on.

#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>

#include "float_lanes.h"
#include "float_product.h"

namespace {

namespace lanes = llama_tp::lanes;

constexpr int64_t kLanes = lanes::kWidth;  // 8: this file is built for AVX2 alone
constexpr int64_t kLineFloats = 16;       // a 64-byte cache line
constexpr int64_t kBlockOutputs = 4;      // outputs a pass takes
constexpr int64_t kChunkInputs = 512;     // inputs of a block all rows read while they are in L1
constexpr int64_t kOutputsPerTask = 16;   // outputs a thread takes at a time
constexpr int64_t kPassRows = 32;         // rows a pass takes: its sums stay on the stack
constexpr int kStepRows = 2;              // 2 rows x 4 outputs: 8 sums, 2 inputs and a weight in registers
constexpr int64_t kAheadFloats = 8192;    // the direct passes ask for the weight this far ahead (32 KB)

// The register of 8 inputs at p, of which only the first n (< 8 at a row's end) are read; the others 0.
inline __m256 load_inputs(const float* p, int64_t n) { return n >= kLanes ? _mm256_loadu_ps(p) : lanes::load_first(p, n); }

// y[r][o] = x[r] . w[o] for Rows rows (1 or 2) and kBlockOutputs outputs, the weights read once,
// straight from memory. Each output's sum is one register added to in input order, as in the
// chunked passes: a row's result does not depend on the rows beside it.
template <int Rows>
void direct_pass(const float* w, const float* x, int64_t width, float* y, int64_t y_stride) {
  __m256 sum[Rows][kBlockOutputs];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < kBlockOutputs; ++o) sum[r][o] = _mm256_setzero_ps();
  for (int64_t i = 0; i < width; i += kLanes) {
    const int64_t n = std::min(kLanes, width - i);
    __m256 input[Rows];
    for (int r = 0; r < Rows; ++r) input[r] = load_inputs(x + r * width + i, n);
    for (int o = 0; o < kBlockOutputs; ++o) {
      const float* weights = w + o * width + i;
      if (i % kLineFloats == 0) _mm_prefetch(reinterpret_cast<const char*>(weights + kAheadFloats), _MM_HINT_T0);
      const __m256 weight = load_inputs(weights, n);
      for (int r = 0; r < Rows; ++r) sum[r][o] = _mm256_fmadd_ps(weight, input[r], sum[r][o]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < kBlockOutputs; ++o) y[r * y_stride + o] = lanes::sum(sum[r][o]);
}

// sum[r][o] += x[r] . w[o] over the 8 inputs from i (the first n of them, n < 8 at a row's end).
template <int Rows>
__attribute__((always_inline)) inline void multiply_add(const float* w, const float* x, int64_t width, int64_t i,
                                                        int64_t n, __m256 (&sum)[Rows][kBlockOutputs]) {
  __m256 input[Rows];
  for (int r = 0; r < Rows; ++r) {
    input[r] = load_inputs(x + r * width + i, n);
    asm("" : "+x"(input[r]));  // held in a register: gcc folds a load into each multiply-add that uses it
  }
  for (int o = 0; o < kBlockOutputs; ++o) {
    __m256 weight = load_inputs(w + o * width + i, n);
    asm("" : "+x"(weight));  // so: 6 loads for 8 multiply-adds, not 10
    for (int r = 0; r < Rows; ++r) sum[r][o] = _mm256_fmadd_ps(weight, input[r], sum[r][o]);
  }
}

// sums[r][o] += x[r] . w[o] over inputs [begin, end) for Rows rows (1 or 2) and kBlockOutputs
// outputs; with AskNext, asking for the next block's weights (kBlockOutputs x width on) meanwhile.
template <int Rows, bool AskNext>
void add_chunk(const float* w, const float* x, int64_t width, int64_t begin, int64_t end, __m256* sums) {
  __m256 sum[Rows][kBlockOutputs];
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < kBlockOutputs; ++o) sum[r][o] = sums[r * kBlockOutputs + o];
  int64_t i = begin;
  for (; i + kLineFloats <= end; i += kLineFloats) {  // a cache line of each output's weights
    if constexpr (AskNext)
      for (int o = 0; o < kBlockOutputs; ++o)
        _mm_prefetch(reinterpret_cast<const char*>(w + (kBlockOutputs + o) * width + i), _MM_HINT_T0);
    multiply_add<Rows>(w, x, width, i, kLanes, sum);
    multiply_add<Rows>(w, x, width, i + kLanes, kLanes, sum);
  }
  for (; i < end; i += kLanes) multiply_add<Rows>(w, x, width, i, end - i, sum);
  for (int r = 0; r < Rows; ++r)
    for (int o = 0; o < kBlockOutputs; ++o) sums[r * kBlockOutputs + o] = sum[r][o];
}

// y[r][o] = x[r] . w[o] for `rows` rows (3 to kPassRows) and kBlockOutputs outputs, a chunk of
// inputs at a time.
void chunked_pass(const float* w, const float* x, int64_t rows, int64_t width, float* y, int64_t y_stride) {
  __m256 sums[kPassRows * kBlockOutputs];
  std::fill(sums, sums + rows * kBlockOutputs, _mm256_setzero_ps());
  for (int64_t begin = 0; begin < width; begin += kChunkInputs) {
    const int64_t end = std::min(width, begin + kChunkInputs);
    add_chunk<kStepRows, true>(w, x, width, begin, end, sums);
    int64_t r = kStepRows;
    for (; r + kStepRows <= rows; r += kStepRows)
      add_chunk<kStepRows, false>(w, x + r * width, width, begin, end, sums + r * kBlockOutputs);
    if (r < rows) add_chunk<1, false>(w, x + r * width, width, begin, end, sums + r * kBlockOutputs);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < kBlockOutputs; ++o) y[r * y_stride + o] = lanes::sum(sums[r * kBlockOutputs + o]);
}

// y[r][o] = x[r] . w[o] for `rows` rows (up to kPassRows) and kBlockOutputs outputs.
void block_pass(const float* w, const float* x, int64_t rows, int64_t width, float* y, int64_t y_stride) {
  if (rows == 1)
    direct_pass<1>(w, x, width, y, y_stride);
  else if (rows == 2)
    direct_pass<2>(w, x, width, y, y_stride);
  else
    chunked_pass(w, x, rows, width, y, y_stride);
}

// One output alone (a weight whose outputs are not a multiple of kBlockOutputs): y[r] = x[r] . w.
void one_output(const float* w, const float* x, int64_t rows, int64_t width, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < width; i += kLanes) {
      const int64_t n = std::min(kLanes, width - i);
      sum = _mm256_fmadd_ps(load_inputs(w + i, n), load_inputs(x + r * width + i, n), sum);
    }
    y[r * y_stride] = lanes::sum(sum);
  }
}

// x [..., width] fp32 times w [out_features, width] fp32, transposed: y [..., out_features].
at::Tensor float_product(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = llama_tp::float_product_output(x, w);
  const int64_t width = x.size(-1), rows = x.numel() / width, out_features = w.size(0);
  const float *w_data = w.data_ptr<float>(), *x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  llama_tp::parallel_over_outputs(out_features, kOutputsPerTask, [&](int64_t first, int64_t last) {
    int64_t o = first;
    for (; o + kBlockOutputs <= last; o += kBlockOutputs)
      for (int64_t row = 0; row < rows; row += kPassRows)  // the block's weights stay in cache between passes
        block_pass(w_data + o * width, x_data + row * width, std::min(kPassRows, rows - row), width,
                   y_data + row * out_features + o, out_features);
    for (; o < last; ++o) one_output(w_data + o * width, x_data, rows, width, y_data + o, out_features);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_tp, m) { m.def("float_product(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(llama_tp, CPU, m) { m.impl("float_product", float_product); }
