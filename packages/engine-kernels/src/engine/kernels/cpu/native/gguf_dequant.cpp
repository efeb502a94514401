// Dequantization of 4- and 8-bit weights into float32 or bfloat16, for the GGUF linear
// kernels (engine.kernels.gguf.kernels), which multiply the result with oneDNN.
//
// * engine_gguf_dequant: GGUF blocks (Q4_0, Q4_1, Q8_0; ggml's type codes) into row-major
//   values. Block layouts as in gguf_formats.py: d (and m) float16, then the quants;
//   elements 0..15 of a 4-bit block are the low nibbles, 16..31 the high ones.
//     Q8_0  w = q * d        Q4_0  w = (q - 8) * d        Q4_1  w = q * d + m
// * engine_int4pack_dequant_t: torch's CPU int4 layout (_convert_weight_to_int4pack_for_cpu
//   with inner k tiles of 1; what gguf_int4 keeps) into the transposed weight, [K, rows]:
//   in tiles of B rows (torch picks B = 64 on AVX-512 CPUs, 32 on AVX2 ones), byte
//   [b][k][i] holds rows B b + i (low nibble) and B b + B / 2 + i (high), with a
//   (scale, zero) pair per row and group of 32 columns, scales_zeros [K / 32][N][2] in the
//   output dtype:  w = (q - 8) * scale + zero.
//
// Both compute in float32 with a product then a sum (compiled without FMA contraction,
// library.py) and round once, as the torch code they replace does: the values are the
// same bit for bit (a NaN stays a NaN, its payload aside). A block's 32 values are two
// 16-lane registers on AVX-512 (GCC does not vectorize the scalar loops, used elsewhere:
// every byte load may alias the output).
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "numerics.h"
#include "q8_0.h"

namespace {

// Work items of at least this many weights go to several threads.
constexpr int64_t kParallelWeights = int64_t{1} << 16;

enum GGMLType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

#if defined(__AVX512F__)

inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(uint16_t* o, __m512 v) {  // numerics.h's store, 16 lanes at a time
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(rounded));
}

// 32 values a, b (lanes 0..15, 16..31) stored at o. bfloat16 through avx512_bf16's
// conversion where it exists (round to nearest even, as store16; it would keep a NaN's
// payload, so NaNs are replaced by torch's canonical one). The values here are never
// subnormal (multiples of float16 steps), which that conversion would flush.
inline void store32(float* o, __m512 a, __m512 b) {
  store16(o, a);
  store16(o + 16, b);
}
inline void store32(uint16_t* o, __m512 a, __m512 b) {
#if defined(__AVX512BF16__)
  __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  const __mmask32 nan = static_cast<__mmask32>(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)) |
                        static_cast<__mmask32>(_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) << 16;
  packed = _mm512_mask_mov_epi16(packed, nan, _mm512_set1_epi16(0x7FC0));
  _mm512_storeu_si512(o, packed);
#else
  store16(o, a);
  store16(o + 16, b);
#endif
}

inline __m512 bytes_to_float(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }

#endif

template <typename T>
void dequant_q8_0(const uint8_t* blocks, int64_t n, T* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n * 32 >= kParallelWeights)
  for (int64_t b = 0; b < n; ++b) {
    const uint8_t* block = blocks + b * kQ8_0BlockBytes;
    T* o = out + b * 32;
#if defined(__AVX512F__)
    store32(o, q8_lanes(block, 0), q8_lanes(block, 1));
#else
    const float d = half_at(block);
    const auto* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 32; ++j) store(o, j, static_cast<float>(q[j]) * d);
#endif
  }
}

template <typename T, bool kOffset>
void dequant_q4(const uint8_t* blocks, int64_t n, T* out, int threads) {
  constexpr int64_t kSize = kOffset ? 20 : 18;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * 32 >= kParallelWeights)
  for (int64_t b = 0; b < n; ++b) {
    const uint8_t* block = blocks + b * kSize;
    const float d = half_at(block);
    const float m = kOffset ? half_at(block + 2) : 0.f;
    const uint8_t* qs = block + (kOffset ? 4 : 2);
    T* o = out + b * 32;
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m512 halves[2] = {bytes_to_float(_mm_and_si128(bytes, low)),
                              bytes_to_float(_mm_and_si128(_mm_srli_epi16(bytes, 4), low))};
    const __m512 dv = _mm512_set1_ps(d);
    __m512 v[2];
    for (int half = 0; half < 2; ++half) {
      v[half] = kOffset ? _mm512_add_ps(_mm512_mul_ps(halves[half], dv), _mm512_set1_ps(m))
                        : _mm512_mul_ps(_mm512_sub_ps(halves[half], _mm512_set1_ps(8.f)), dv);
    }
    store32(o, v[0], v[1]);
#else
    for (int j = 0; j < 16; ++j) {
      const float lo = static_cast<float>(qs[j] & 0x0F);
      const float hi = static_cast<float>(qs[j] >> 4);
      if (kOffset) {
        store(o, j, lo * d + m);
        store(o, j + 16, hi * d + m);
      } else {
        store(o, j, (lo - 8.f) * d);
        store(o, j + 16, (hi - 8.f) * d);
      }
    }
#endif
  }
}

// Rows [first_row, first_row + rows) (multiples of the tile's `block` rows, 32 or 64) of
// the int4-packed weight, transposed into out [cols][rows]; threads split the columns by
// groups of 32.
template <typename T>
void int4pack_dequant_t(const uint8_t* packed, int64_t cols, int block, int64_t first_row,
                        int64_t rows, const T* scales_zeros, int64_t total_rows, T* out,
                        int threads) {
  const int64_t groups = cols / 32;
  const int half_block = block / 2;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (cols * rows >= kParallelWeights)
  for (int64_t g = 0; g < groups; ++g) {
    float scale[64];
    float zero[64];
    for (int64_t t = 0; t < rows / block; ++t) {
      const int64_t tile = first_row / block + t;
      const T* sz = scales_zeros + (g * total_rows + block * tile) * 2;
      for (int i = 0; i < block; ++i) {
        scale[i] = load(sz, 2 * i);
        zero[i] = load(sz, 2 * i + 1);
      }
#if defined(__AVX512F__)
      const int vectors = block / 16;  // of 16 rows; half of them from low nibbles
      __m512 sv[4], zv[4];
      for (int v = 0; v < vectors; ++v) {
        sv[v] = _mm512_loadu_ps(scale + 16 * v);
        zv[v] = _mm512_loadu_ps(zero + 16 * v);
      }
      const __m128i low = _mm_set1_epi8(0x0F);
      const __m512 eight = _mm512_set1_ps(8.f);
#endif
      for (int64_t k = 32 * g; k < 32 * g + 32; ++k) {
        const uint8_t* q = packed + (tile * cols + k) * half_block;
        T* o = out + k * rows + block * t;
#if defined(__AVX512F__)
        // v[j]: rows 16j..16j+15; bytes 16h.. hold rows 16h.. (low) and half_block + 16h..
        __m512 v[4];
        for (int h = 0; h < vectors / 2; ++h) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h));
          const __m512 lo = bytes_to_float(_mm_and_si128(bytes, low));
          const __m512 hi = bytes_to_float(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
          const int j = vectors / 2 + h;
          v[h] = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(lo, eight), sv[h]), zv[h]);
          v[j] = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(hi, eight), sv[j]), zv[j]);
        }
        for (int j = 0; j < vectors; j += 2) store32(o + 16 * j, v[j], v[j + 1]);
#else
        for (int i = 0; i < half_block; ++i) {
          const int j = i + half_block;
          store(o, i, (static_cast<float>(q[i] & 0x0F) - 8.f) * scale[i] + zero[i]);
          store(o, j, (static_cast<float>(q[i] >> 4) - 8.f) * scale[j] + zero[j]);
        }
#endif
      }
    }
  }
}

}  // namespace

extern "C" {

// Each returns 0, 1 for an unknown dtype code, or 3 for a type it has no loop for.

int engine_gguf_dequant(int type, const uint8_t* blocks, int64_t num_blocks, int dtype,
                        void* out, int num_threads) {
  if (type != kQ4_0 && type != kQ4_1 && type != kQ8_0) return 3;
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out);
    if (type == kQ8_0) {
      dequant_q8_0(blocks, num_blocks, o, num_threads);
    } else if (type == kQ4_1) {
      dequant_q4<T, true>(blocks, num_blocks, o, num_threads);
    } else {
      dequant_q4<T, false>(blocks, num_blocks, o, num_threads);
    }
  });
}

// block: the layout's rows per tile, 32 or 64 (torch's choice for the CPU); first_row and
// rows multiples of it. Returns 4 for another block.
int engine_int4pack_dequant_t(const uint8_t* packed, int64_t cols, int block, int64_t first_row,
                              int64_t rows, const void* scales_zeros, int64_t total_rows,
                              int dtype, void* out, int num_threads) {
  if (block != 32 && block != 64) return 4;
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    int4pack_dequant_t(packed, cols, block, first_row, rows,
                       static_cast<const T*>(scales_zeros), total_rows, static_cast<T*>(out),
                       num_threads);
  });
}

}  // extern "C"
