// float32 exp, erf and tanh for the elementwise kernels (elementwise.cpp): branch-free
// (each computes every case and selects), so a `#pragma omp simd` loop over them vectorizes
// for AVX-512 or AVX2 alike, and accurate to about one ulp (what torch's vectorized exp
// and tanh give; its erf is less accurate), in explicit FMAs so no compiler contraction
// changes them. erf and tanh were checked against double precision over every float32 in
// [-6, 6] (erf) and every fifth in [-12, 12] (tanh), and saturate correctly beyond.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// exp(x): Cody-Waite reduction and Cephes' degree-6 polynomial (~1 ulp). Past float32's
// range it is +inf (as torch's exp, so silu of a very negative value is -0, not a tiny
// number), below it the smallest normal's neighbourhood (1 + exp(x) is 1 there either way).
inline float exp_f32(float x) {
  const bool overflow = x > 88.7228f;
  float c = x < -87.0f ? -87.0f : x;  // comparisons, not fmin/fmax: a NaN passes through
  c = c > 88.0f ? 88.0f : c;
  const float k = std::floor(std::fma(c, 1.44269504088896341f, 0.5f));
  const float r = std::fma(k, 2.12194440e-4f, std::fma(k, -0.693359375f, c));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float e = std::fma(p * r, r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float result = e * scale;
  return overflow ? HUGE_VALF : result;
}

// erf(x), within 1.09 ulp of the exact value: two minimax polynomials (fitted for this
// file: Lawson's iteration on the relative error, then the float32 coefficients nudged by
// a few ulps where that lowered the measured maximum). For |x| <= 0.9277, x + x P(x^2);
// above, 1 - exp(Q(|x|)), Q a degree-7 fit of log(erfc(|x|)) on [0.9277, 3.95] (past it
// the exp is below erf's last ulp: 1; +-inf gives +-1), the sign restored. Not the
// Abramowitz-Stegun 7.1.26 that torch's vectorized erf is (about 1.5e-7 absolute: several
// ulp near 1).
inline float erf_f32(float a) {
  const float t = std::fabs(a);
  const float s = a * a;
  float q = std::fma(-1.152701134e-05f, t, 3.257653443e-04f);
  const float u = std::fma(-3.654515836e-03f, t, 2.378754690e-02f);
  q = std::fma(q, s, u);
  q = std::fma(q, t, -1.062665433e-01f);
  q = std::fma(q, t, -6.351333261e-01f);
  q = std::fma(q, t, -1.286529154e-01f);
  q = std::fma(q, t, -t);
  float big = 1.0f - exp_f32(q);
  big = a < 0.0f ? -big : big;
  float p = -5.964116426e-04f;
  p = std::fma(p, s, 4.987992812e-03f);
  p = std::fma(p, s, -2.676310763e-02f);
  p = std::fma(p, s, 1.128172055e-01f);
  p = std::fma(p, s, -3.761248589e-01f);
  p = std::fma(p, s, 1.283791512e-01f);
  const float small = std::fma(p, a, a);
  return t > 0.927734375f ? big : small;  // a NaN takes the small form: NaN
}

// tanh(x), within 1.32 ulp: Cephes' odd polynomial x + x^3 P(x^2) for |x| < 0.625, else
// 1 - 2 / (exp(2|x|) + 1) with the sign restored (exp's +inf gives exactly +-1).
inline float tanh_f32(float x) {
  const float z = std::fabs(x);
  float big = 1.0f - 2.0f / (exp_f32(2.0f * z) + 1.0f);
  big = x < 0.0f ? -big : big;
  const float s = x * x;
  float p = -5.70498872745e-3f;
  p = std::fma(p, s, 2.06390887954e-2f);
  p = std::fma(p, s, -5.37397155531e-2f);
  p = std::fma(p, s, 1.33314422036e-1f);
  p = std::fma(p, s, -3.33332819422e-1f);
  const float small = std::fma(p * s, x, x);
  return z >= 0.625f ? big : small;  // a NaN takes the polynomial: NaN
}

}  // namespace
