// One float32 vector register of the widest instruction set this build has (-march=native):
// 16 lanes with AVX-512, 8 with AVX2 and FMA. The matmul kernels' float32 paths are written
// once against these, and ENGINE_F32_SIMD is defined where one of the two exists.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define ENGINE_F32_SIMD 1
#endif

namespace {

#if defined(__AVX512F__)

using F32Vec = __m512;
constexpr int kF32Lanes = 16;
inline F32Vec f32_zero() { return _mm512_setzero_ps(); }
inline F32Vec f32_load(const float* p) { return _mm512_loadu_ps(p); }
inline F32Vec f32_broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline F32Vec f32_add(F32Vec a, F32Vec b) { return _mm512_add_ps(a, b); }
inline F32Vec f32_mul(F32Vec a, F32Vec b) { return _mm512_mul_ps(a, b); }
inline F32Vec f32_fmadd(F32Vec a, F32Vec b, F32Vec acc) { return _mm512_fmadd_ps(a, b, acc); }
inline float f32_sum(F32Vec a) { return _mm512_reduce_add_ps(a); }
inline __mmask16 f32_first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
// The first n < kF32Lanes values from p, the other lanes 0 (nothing past p + n is read).
inline F32Vec f32_load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(f32_first(n), p);
}
// a with the lanes from n (< kF32Lanes) on set to 0.
inline F32Vec f32_keep_first(F32Vec a, int64_t n) { return _mm512_maskz_mov_ps(f32_first(n), a); }
// The first n <= kF32Lanes lanes of a to p (nothing past p + n is written).
inline void f32_store_first(float* p, F32Vec a, int64_t n) {
  if (n >= kF32Lanes) {  // a masked store is slower on some CPUs (Zen 4)
    _mm512_storeu_ps(p, a);
  } else {
    _mm512_mask_storeu_ps(p, f32_first(n), a);
  }
}

#if defined(__AVX512BF16__)
// The first n (1..16) bfloat16 values from b as float32 lanes, the others 0 (nothing past
// b + n is read).
inline __m512 bf16_load_first(const uint16_t* b, int64_t n) {
  const __m256i bits = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), b);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// lo's then hi's lanes rounded to bfloat16 (nearest even; a NaN stays a NaN, its payload
// aside), the first n (1..32) to out (nothing past out + n is written).
inline void bf16_store_first(uint16_t* out, __m512 lo, __m512 hi, int64_t n) {
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  if (n >= 32) {  // a masked store is slower on some CPUs (Zen 4)
    _mm512_storeu_si512(out, packed);
  } else {
    _mm512_mask_storeu_epi16(out, static_cast<__mmask32>((1u << n) - 1), packed);
  }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)

using F32Vec = __m256;
constexpr int kF32Lanes = 8;
inline F32Vec f32_zero() { return _mm256_setzero_ps(); }
inline F32Vec f32_load(const float* p) { return _mm256_loadu_ps(p); }
inline F32Vec f32_broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline F32Vec f32_add(F32Vec a, F32Vec b) { return _mm256_add_ps(a, b); }
inline F32Vec f32_mul(F32Vec a, F32Vec b) { return _mm256_mul_ps(a, b); }
inline F32Vec f32_fmadd(F32Vec a, F32Vec b, F32Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float f32_sum(F32Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// Lane i all ones for i < n: a window of eight 32-bit words into -1 x 8, 0 x 8.
inline __m256i f32_first(int64_t n) {
  alignas(32) static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                          0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + 8 - n));
}
// The first n < kF32Lanes values from p, the other lanes 0 (nothing past p + n is read).
inline F32Vec f32_load_first(const float* p, int64_t n) {
  return _mm256_maskload_ps(p, f32_first(n));
}
// a with the lanes from n (< kF32Lanes) on set to 0.
inline F32Vec f32_keep_first(F32Vec a, int64_t n) {
  return _mm256_and_ps(a, _mm256_castsi256_ps(f32_first(n)));
}
// The first n <= kF32Lanes lanes of a to p (nothing past p + n is written).
inline void f32_store_first(float* p, F32Vec a, int64_t n) {
  if (n >= kF32Lanes) {
    _mm256_storeu_ps(p, a);
  } else {
    _mm256_maskstore_ps(p, f32_first(n), a);
  }
}

#endif

}  // namespace
