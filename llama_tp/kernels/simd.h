// What our AVX-512 product kernels share: the register width, a mask for a last partial register,
// and asking for a stream of weights ahead of its reads.
//
// Decoding reads every weight once, so the kernels ask for the weight ahead of their reads.
// Streamed from memory, the demo model's layers took 20-25% less time with the weight asked for
// 8 KB ahead than with the hardware's prefetching alone. They ask twice: 32 KB ahead into the
// core's L2 cache, which can wait on many more reads from memory than L1 can, then 2 KB ahead
// into L1. Against asking 8 KB ahead into L1, that took float_product 8-22% less time for 4-16
// rows, whose multiply-adds otherwise leave the memory idle, and int8_product 6% less for one row.
// (float_product's passes of several rows now ask for a later group of weight rows instead:
// cpu_kernels.cpp.)

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace llama_tp {

constexpr int64_t kLanes = 16;  // floats per AVX-512 register
constexpr int64_t kFarPrefetchBytes = 32768, kNearPrefetchBytes = 2048;

// Ask for the weight at `address` (a pointer to the one being read now) far ahead into L2 and
// near ahead into L1.
template <typename T>
inline void prefetch_ahead(const T* address) {
  const char* bytes = reinterpret_cast<const char*>(address);
  _mm_prefetch(bytes + kFarPrefetchBytes, _MM_HINT_T1);
  _mm_prefetch(bytes + kNearPrefetchBytes, _MM_HINT_T0);
}

// Only the near half of prefetch_ahead: for a stream whose far part another request covers.
template <typename T>
inline void prefetch_near(const T* address) {
  _mm_prefetch(reinterpret_cast<const char*>(address) + kNearPrefetchBytes, _MM_HINT_T0);
}

// The first n lanes of a register (all 16 for n >= 16): for a row's last inputs, a block's outputs.
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>(n >= kLanes ? 0xFFFF : (1u << n) - 1); }

}  // namespace llama_tp
