// Registers of floats for the kernels built for AVX-512 and for AVX2 alike (attention_kernel.cpp,
// norm_kernel.cpp, sampler_kernel.cpp): 16 lanes where the build has AVX-512, else AVX2's 8. The
// kernels are written once against these few operations; each extension compiles them for its
// instruction set.

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace llama_tp::lanes {

#if defined(__AVX512F__)

using Floats = __m512;
constexpr int64_t kWidth = 16;

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= kWidth ? 0xFFFF : (1u << n) - 1); }
inline Floats broadcast(float value) { return _mm512_set1_ps(value); }
inline Floats zeros() { return _mm512_setzero_ps(); }
inline Floats load(const float* p) { return _mm512_loadu_ps(p); }
// The first n floats at p (all kWidth for n >= kWidth), the other lanes fill.
inline Floats load_first(const float* p, int64_t n, float fill = 0.0f) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p);
}
inline void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline void store_first(float* p, int64_t n, Floats v) { _mm512_mask_storeu_ps(p, first(n), v); }
inline Floats keep_first(Floats v, int64_t n) { return _mm512_maskz_mov_ps(first(n), v); }  // the others 0
inline Floats add(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats sub(Floats a, Floats b) { return _mm512_sub_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats max(Floats a, Floats b) { return _mm512_max_ps(a, b); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats fnmadd(Floats a, Floats b, Floats c) { return _mm512_fnmadd_ps(a, b, c); }
inline Floats nearest_integer(Floats v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float sum(Floats v) { return _mm512_reduce_add_ps(v); }
inline float largest(Floats v) { return _mm512_reduce_max_ps(v); }
// Bit i set where lane i of v is at least floor.
inline uint32_t at_least(Floats v, Floats floor) { return _mm512_cmp_ps_mask(v, floor, _CMP_GE_OQ); }
// v where lane i of values is at least floor, else 0.
inline Floats where_at_least(Floats values, Floats floor, Floats v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(values, floor, _CMP_GE_OQ), v);
}
// p * 2^n for integral n >= -126 (scalef takes any n; the AVX2 build's exponent bits need this range)
inline Floats times_power_of_two(Floats p, Floats n) { return _mm512_scalef_ps(p, n); }

#else  // AVX2

using Floats = __m256;
constexpr int64_t kWidth = 8;

// All ones in the first n lanes (all kWidth for n >= kWidth): maskload's and maskstore's mask.
inline __m256i first(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < kWidth ? n : kWidth)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Floats broadcast(float value) { return _mm256_set1_ps(value); }
inline Floats zeros() { return _mm256_setzero_ps(); }
inline Floats load(const float* p) { return _mm256_loadu_ps(p); }
inline Floats load_first(const float* p, int64_t n, float fill = 0.0f) {
  const __m256i lanes = first(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, lanes), _mm256_castsi256_ps(lanes));
}
inline void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline void store_first(float* p, int64_t n, Floats v) { _mm256_maskstore_ps(p, first(n), v); }
inline Floats keep_first(Floats v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first(n))); }
inline Floats add(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats sub(Floats a, Floats b) { return _mm256_sub_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats max(Floats a, Floats b) { return _mm256_max_ps(a, b); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats fnmadd(Floats a, Floats b, Floats c) { return _mm256_fnmadd_ps(a, b, c); }
inline Floats nearest_integer(Floats v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float sum(Floats v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
inline float largest(Floats v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}
inline uint32_t at_least(Floats v, Floats floor) { return _mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_GE_OQ)); }
inline Floats where_at_least(Floats values, Floats floor, Floats v) {
  return _mm256_and_ps(_mm256_cmp_ps(values, floor, _CMP_GE_OQ), v);
}
inline Floats times_power_of_two(Floats p, Floats n) {  // 2^n built in the exponent bits
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

#endif

// e^x for x <= 0 (scores less their maximum), to about 2 ulp: x = n ln 2 + f with |f| <= ln 2 / 2,
// e^f by its Taylor series to the 7th power, then scaled by 2^n. Below -87 (n < -126) x is taken
// as -87: e^-87 is 1.6e-38, nothing beside the largest score's weight of 1.
inline Floats exp_of_nonpositive(Floats x) {
  x = max(x, broadcast(-87.0f));
  const Floats n = nearest_integer(mul(x, broadcast(1.44269504088896341f)));
  // ln 2 in two parts, so that n ln 2 is exact to fp32's precision
  Floats f = fnmadd(n, broadcast(0.693145751953125f), x);
  f = fnmadd(n, broadcast(1.428606765330187045e-06f), f);
  Floats p = broadcast(1.0f / 5040);
  for (const float coefficient : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = fmadd(p, f, broadcast(coefficient));
  return times_power_of_two(p, n);
}

}  // namespace llama_tp::lanes
