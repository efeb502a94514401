// Products of a few activation rows with a weight matrix (decode steps of small batches):
// out [M, N] = x [M, K] W^T + bias, W [N, K] row-major, 1 <= M <= kMaxRows.
//
// Such a product reads every weight once and does little else, so it runs at the speed
// the weights stream from memory. oneDNN's kernels for these shapes are bound by their
// compute loop instead (~13 GB/s per core on a Zen 4 where a plain read streams ~27): here
// each thread reads one contiguous range of W's rows front to back, every row against all
// M rows of x (which stay in L1), accumulating in float32 (bfloat16 pairs through
// avx512_bf16's dot-product instruction). Built only where those instructions exist; the
// Python side asks engine_small_matmul_dtypes() and uses oneDNN elsewhere.
#include <omp.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "numerics.h"

namespace {

// Measured on the benchmark model's shapes (Zen 4, 2 threads, bf16): 1.4-1.9x oneDNN at one
// row, 1.5x at two, 1.1-1.3x at three, even at four, slower beyond (the loop's compute per
// weight byte then keeps too few loads in flight): three is where oneDNN takes over.
constexpr int kMaxRows = 3;

#if defined(__AVX512F__)

// One 512-bit register of T as dot_rows uses it: how many elements it holds, its load (and
// the masked one for a row's last elements) and the multiply-accumulate into 16 float32s.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  using Vec = __m512;
  static constexpr int kCount = 16;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_tail(const float* p, int64_t left) {  // left < kCount
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), p);
  }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct Lanes<uint16_t> {  // bfloat16: pairs multiplied exactly, summed in float32
  using Vec = __m512bh;
  static constexpr int kCount = 32;
  static Vec load(const uint16_t* p) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  }
  static Vec load_tail(const uint16_t* p, int64_t left) {  // left < kCount
    const auto mask = static_cast<__mmask32>((1u << left) - 1);
    return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
  }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

// acc[m] = dot(w[0:K], x_m[0:K]) for the M rows of x, in float32: two registers of w per
// step (two accumulators per row), then the last K % kCount elements masked.
template <int M, typename T>
inline void dot_rows(const T* w, const T* x, int64_t x_row, int64_t K, float* acc) {
  using L = Lanes<T>;
  constexpr int V = L::kCount;
  __m512 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * V <= K; k += 2 * V) {
    const auto w0 = L::load(w + k), w1 = L::load(w + k + V);
    for (int m = 0; m < M; ++m) {
      a[m] = L::madd(a[m], w0, L::load(x + m * x_row + k));
      b[m] = L::madd(b[m], w1, L::load(x + m * x_row + k + V));
    }
  }
  for (; k < K; k += V) {
    const bool whole = K - k >= V;
    const auto w0 = whole ? L::load(w + k) : L::load_tail(w + k, K - k);
    for (int m = 0; m < M; ++m) {
      const T* xm = x + m * x_row + k;
      a[m] = L::madd(a[m], w0, whole ? L::load(xm) : L::load_tail(xm, K - k));
    }
  }
  for (int m = 0; m < M; ++m) acc[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
}

// Rows [lo, hi) of W against the M rows of x.
template <int M, typename T>
void weight_rows(const T* x, int64_t x_row, const T* w, int64_t K, const T* bias, T* out,
                 int64_t out_row, int64_t lo, int64_t hi) {
  float acc[M];
  for (int64_t n = lo; n < hi; ++n) {
    dot_rows<M>(w + n * K, x, x_row, K, acc);
    const float b = bias != nullptr ? load(bias, n) : 0.0f;
    for (int m = 0; m < M; ++m) store(out + m * out_row, n, acc[m] + b);
  }
}

template <int M, typename T>
void small_matmul(const T* x, int64_t x_row, const T* w, int64_t N, int64_t K, const T* bias,
                  T* out, int64_t out_row, int num_threads) {
  // Each thread one contiguous range of rows (a multiple of 16, so ranges start on a line).
  const int64_t blocks = (N + 15) / 16;
  const int threads = static_cast<int>(blocks < num_threads ? blocks : num_threads);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (blocks + nt - 1) / nt * 16;
    const int64_t lo = t * per, hi = lo + per < N ? lo + per : N;
    if (lo < hi) weight_rows<M>(x, x_row, w, K, bias, out, out_row, lo, hi);
  }
}

template <typename T>
int by_rows(int64_t M, const T* x, int64_t x_row, const T* w, int64_t N, int64_t K,
            const T* bias, T* out, int64_t out_row, int num_threads) {
  switch (M) {
    case 1: small_matmul<1>(x, x_row, w, N, K, bias, out, out_row, num_threads); break;
    case 2: small_matmul<2>(x, x_row, w, N, K, bias, out, out_row, num_threads); break;
    case 3: small_matmul<3>(x, x_row, w, N, K, bias, out, out_row, num_threads); break;
    default: return 2;
  }
  return 0;
}

#endif  // __AVX512F__

}  // namespace

extern "C" {

// Bit i set: dtype code i has a kernel in this build (float32 with AVX-512, bfloat16 also
// needs avx512_bf16); 0 on other CPUs.
int engine_small_matmul_dtypes() {
  int codes = 0;
#if defined(__AVX512F__)
  codes |= 1 << kFloat32;
#if defined(__AVX512BF16__)
  codes |= 1 << kBFloat16;
#endif
#endif
  return codes;
}

// out [M, N] (rows out_row apart) = x [M, K] (rows x_row apart) W^T + bias (null: none),
// W [N, K] contiguous. Returns 0; 1 for a dtype this build has no kernel for; 2 for M
// outside 1..kMaxRows.
int engine_small_matmul(int dtype, const void* x, int64_t x_row, int64_t M, const void* w,
                        int64_t N, int64_t K, const void* bias, void* out, int64_t out_row,
                        int num_threads) {
  if (!(engine_small_matmul_dtypes() >> dtype & 1)) return 1;
  if (M < 1 || M > kMaxRows) return 2;
  int status = 0;
#if defined(__AVX512F__)
  const int code = with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
#if !defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {
      status = 1;
    } else
#endif
    {
      status = by_rows<T>(M, static_cast<const T*>(x), x_row, static_cast<const T*>(w), N, K,
                          static_cast<const T*>(bias), static_cast<T*>(out), out_row,
                          num_threads);
    }
  });
  if (code != 0) return code;
#else
  (void)x, (void)x_row, (void)M, (void)w, (void)N, (void)K, (void)bias, (void)out,
      (void)out_row, (void)num_threads;
#endif
  return status;
}

}  // extern "C"
