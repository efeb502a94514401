// GGUF Q8_0 blocks (34 bytes: float16 d, then 32 int8 q; w = q * d) read into float32
// registers, shared by the dequantization (gguf_dequant.cpp) and the small-batch product
// over blocks (small_matmul.cpp): both compute each weight here, so the product's values are
// the dequantized row's by construction.
#pragma once

#include <cstdint>

#include "numerics.h"
#include "simd.h"

namespace {

constexpr int64_t kQ8_0BlockBytes = 34;

#if defined(__AVX512F__)
// The 16 values q * d of half 0 (elements 0..15) or half 1 (16..31) of a block.
inline __m512 q8_lanes(const uint8_t* block, int64_t half) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * half));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                       _mm512_set1_ps(half_at(block)));
}
#elif defined(ENGINE_F32_SIMD)
// The 8 values q * d of quarter 0..3 (elements 8 * quarter onwards) of a block.
inline __m256 q8_lanes(const uint8_t* block, int64_t quarter) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * quarter));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                       _mm256_set1_ps(half_at(block)));
}
#endif

}  // namespace
