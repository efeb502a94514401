// Scalar loads and stores of float32 and bfloat16 (as uint16_t) values, computed in
// float32, and float16 values read as float32, shared by the engine's CPU kernels. Written
// without branches (half_to_float aside) so that loops over them vectorize.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1 };

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  // NaN by a bit test (-ffast-math drops isnan); torch stores its canonical quiet NaN.
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  p[i] = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
}

// Calls f with a value of the element type dtype names (float; uint16_t holds bfloat16),
// as `[&](auto tag) { using T = decltype(tag); ... }`. Returns 0, or 1 for an unknown code.
template <typename F>
inline int with_dtype(int dtype, F&& f) {
  if (dtype == kFloat32) {
    f(float{});
  } else if (dtype == kBFloat16) {
    f(uint16_t{});
  } else {
    return 1;
  }
  return 0;
}

// Bit i set: dtype code i has a matmul kernel (small_matmul.cpp, packed_matmul.cpp) in this
// build: float32 with AVX-512 or with AVX2 and FMA, bfloat16 with avx512_bf16; 0 elsewhere.
inline int matmul_dtypes() {
  int codes = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  codes |= 1 << kFloat32;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  codes |= 1 << kBFloat16;
#endif
  return codes;
}

// Calls f(T{}) for a dtype matmul_dtypes() reports (float for float32, uint16_t for
// bfloat16); returns 1 for any other, without instantiating f for it.
template <typename F>
inline int with_matmul_dtype(int dtype, F&& f) {
  if (!(matmul_dtypes() >> dtype & 1)) return 1;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return with_dtype(dtype, f);
#elif defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  f(float{});
  return 0;
#else
  (void)f;
  return 1;
#endif
}

// float16 bits to float32, exactly (subnormals included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    const float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    std::memcpy(&bits, &value, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

// A float32 value rounded as storing it in T and loading it back would.
template <typename T>
inline float round_to(float v) {
  T stored;
  store(&stored, 0, v);
  return load(&stored, 0);
}

}  // namespace
