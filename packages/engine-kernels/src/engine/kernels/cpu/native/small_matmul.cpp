// Products of a few activation rows with a weight matrix (decode steps of small batches):
// out [M, N] = x [M, K] W^T + bias, W [N, K] row-major, 1 <= M <= kMaxRows.
//
// Such a product reads every weight once and does little else, so it runs at the speed
// the weights stream from memory. oneDNN's kernels for these shapes are bound by their
// compute loop instead (~13 GB/s per core on a Zen 4 where a plain read streams ~27): here
// each thread reads one contiguous range of W's rows front to back, every row against all
// M rows of x (which stay in L1), accumulating in float32 (bfloat16 pairs through
// avx512_bf16's dot-product instruction). Built for float32 with AVX-512 or AVX2 and FMA,
// bfloat16 with avx512_bf16; the Python side asks engine_small_matmul_dtypes() and uses
// oneDNN elsewhere.
//
// engine_small_matmul_q8_0 is the same loop over GGUF Q8_0 rows (the gguf_dequant kernel's
// few-token path): each register of weights is computed from its block as it is needed,
// rounded as the dequantized row would be, so the sums are the dense kernel's on that row
// while only ~1.06 bytes per weight are read.
#include <omp.h>

#include <cstdint>

#include "kernels.h"
#include "numerics.h"
#include "q8_0.h"
#include "simd.h"

namespace {

// Measured on the benchmark model's shapes (Zen 4, 2 threads, bf16): 1.4-1.9x oneDNN at one
// row, 1.5x at two, 1.1-1.3x at three, even at four, slower beyond (the loop's compute per
// weight byte then keeps too few loads in flight): three is where oneDNN takes over.
constexpr int kMaxRows = 3;
// Weight formats run_small_matmul takes (kDense / kQ8_0 below, for the kernels).
constexpr int kDenseFormat = -1, kQ8_0Format = 8;

#if defined(ENGINE_F32_SIMD)

// One register of T as dot_rows uses it: how many elements it holds, its load (and the
// load of a row's last elements) and the multiply-accumulate into float32 sums.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  using Vec = F32Vec;
  static constexpr int kCount = kF32Lanes;
  static Vec load(const float* p) { return f32_load(p); }
  static Vec load_tail(const float* p, int64_t left) { return f32_load_first(p, left); }
  static F32Vec madd(F32Vec acc, Vec w, Vec x) { return f32_fmadd(w, x, acc); }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
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

// One weight row in registers of T, as dot_rows reads it: full(k) the kCount elements from
// k, tail(k, left) the last left < kCount. A dense row loads them; a Q8_0 row (34-byte
// blocks of float16 d and 32 int8 q, w = q * d) computes them, rounded to T as the row
// dequantized into memory would be: both give dot_rows the same values.
template <typename T>
struct DenseRow {
  const T* w;
  typename Lanes<T>::Vec full(int64_t k) const { return Lanes<T>::load(w + k); }
  typename Lanes<T>::Vec tail(int64_t k, int64_t left) const {
    return Lanes<T>::load_tail(w + k, left);
  }
};

template <typename T>
struct Q8Row;

template <>
struct Q8Row<float> {  // a register is half a block (AVX-512) or a quarter (AVX2)
  const uint8_t* blocks;
  F32Vec full(int64_t k) const {
    return q8_lanes(blocks + k / 32 * kQ8_0BlockBytes, k % 32 / kF32Lanes);
  }
  F32Vec tail(int64_t k, int64_t left) const { return f32_keep_first(full(k), left); }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <>
struct Q8Row<uint16_t> {  // a register is a block, rounded to nearest even
  const uint8_t* blocks;
  __m512bh full(int64_t k) const {
    const uint8_t* block = blocks + k / 32 * kQ8_0BlockBytes;
    return _mm512_cvtne2ps_pbh(q8_lanes(block, 1), q8_lanes(block, 0));
  }
  __m512bh tail(int64_t k, int64_t left) const {  // K is whole blocks: never called
    const auto mask = static_cast<__mmask32>((1u << left) - 1);
    return reinterpret_cast<__m512bh>(
        _mm512_maskz_mov_epi16(mask, reinterpret_cast<__m512i>(full(k))));
  }
};
#endif

// acc[m] = dot(w[0:K], x_m[0:K]) for the M rows of x, in float32: two registers of w per
// step (two accumulators per row), then the last K % kCount elements masked.
template <int M, typename T, typename Row>
inline void dot_rows(const Row& w, const T* x, int64_t x_row, int64_t K, float* acc) {
  using L = Lanes<T>;
  constexpr int V = L::kCount;
  F32Vec a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = f32_zero();
  int64_t k = 0;
  for (; k + 2 * V <= K; k += 2 * V) {
    const auto w0 = w.full(k), w1 = w.full(k + V);
    for (int m = 0; m < M; ++m) {
      a[m] = L::madd(a[m], w0, L::load(x + m * x_row + k));
      b[m] = L::madd(b[m], w1, L::load(x + m * x_row + k + V));
    }
  }
  for (; k < K; k += V) {
    const bool whole = K - k >= V;
    const auto w0 = whole ? w.full(k) : w.tail(k, K - k);
    for (int m = 0; m < M; ++m) {
      const T* xm = x + m * x_row + k;
      a[m] = L::madd(a[m], w0, whole ? L::load(xm) : L::load_tail(xm, K - k));
    }
  }
  for (int m = 0; m < M; ++m) acc[m] = f32_sum(f32_add(a[m], b[m]));
}

// Weight rows: dense T [N, K] (kDense) or Q8_0 blocks [N, K / 32 * 34].
constexpr int kDense = kDenseFormat, kQ8_0 = kQ8_0Format;

template <int Format, typename T>
inline auto weight_row(const void* w, int64_t n, int64_t K) {
  if constexpr (Format == kDense) {
    return DenseRow<T>{static_cast<const T*>(w) + n * K};
  } else {
    return Q8Row<T>{static_cast<const uint8_t*>(w) + n * (K / 32 * 34)};
  }
}

// Rows [lo, hi) of W against the M rows of x.
template <int M, int Format, typename T>
void weight_rows(const T* x, int64_t x_row, const void* w, int64_t K, const T* bias, T* out,
                 int64_t out_row, int64_t lo, int64_t hi) {
  float acc[M];
  for (int64_t n = lo; n < hi; ++n) {
    dot_rows<M>(weight_row<Format, T>(w, n, K), x, x_row, K, acc);
    const float b = bias != nullptr ? load(bias, n) : 0.0f;
    for (int m = 0; m < M; ++m) store(out + m * out_row, n, acc[m] + b);
  }
}

template <int M, int Format, typename T>
void small_matmul(const T* x, int64_t x_row, const void* w, int64_t N, int64_t K,
                  const T* bias, T* out, int64_t out_row, int num_threads) {
  // Each thread one contiguous range of rows (a multiple of 16, so ranges start on a line).
  const int64_t blocks = (N + 15) / 16;
  const int threads = static_cast<int>(blocks < num_threads ? blocks : num_threads);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (blocks + nt - 1) / nt * 16;
    const int64_t lo = t * per, hi = lo + per < N ? lo + per : N;
    if (lo < hi) weight_rows<M, Format>(x, x_row, w, K, bias, out, out_row, lo, hi);
  }
}

template <int Format, typename T>
int by_rows(int64_t M, const T* x, int64_t x_row, const void* w, int64_t N, int64_t K,
            const T* bias, T* out, int64_t out_row, int num_threads) {
  switch (M) {
    case 1: small_matmul<1, Format>(x, x_row, w, N, K, bias, out, out_row, num_threads); break;
    case 2: small_matmul<2, Format>(x, x_row, w, N, K, bias, out, out_row, num_threads); break;
    case 3: small_matmul<3, Format>(x, x_row, w, N, K, bias, out, out_row, num_threads); break;
    default: return 2;
  }
  return 0;
}

#endif  // ENGINE_F32_SIMD

}  // namespace

extern "C" {

// Bit i set: dtype code i has a kernel in this build (see matmul_dtypes).
int engine_small_matmul_dtypes() { return matmul_dtypes(); }

// out [M, N] (rows out_row apart) = x [M, K] (rows x_row apart) W^T + bias (null: none).
// format: -1 for W [N, K] contiguous of x's dtype, 8 for GGUF Q8_0 rows (K a multiple of
// 32; the same sums as the dense kernel on the rows dequantized to x's dtype). Returns 0;
// 1 for a dtype this build has no kernel for; 2 for M outside 1..kMaxRows; 3 for another
// format.
static int run_small_matmul(int format, int dtype, const void* x, int64_t x_row, int64_t M,
                            const void* w, int64_t N, int64_t K, const void* bias, void* out,
                            int64_t out_row, int num_threads) {
  if (!(matmul_dtypes() >> dtype & 1)) return 1;
  if (M < 1 || M > kMaxRows) return 2;
  if (format != kDenseFormat && format != kQ8_0Format) return 3;
  int status = 0;
#if defined(ENGINE_F32_SIMD)
  const int code = with_matmul_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* xs = static_cast<const T*>(x);
    const auto* bs = static_cast<const T*>(bias);
    auto* os = static_cast<T*>(out);
    status = format == kDenseFormat
        ? by_rows<kDense, T>(M, xs, x_row, w, N, K, bs, os, out_row, num_threads)
        : by_rows<kQ8_0, T>(M, xs, x_row, w, N, K, bs, os, out_row, num_threads);
  });
  if (code != 0) return code;
#else
  (void)x, (void)x_row, (void)w, (void)N, (void)K, (void)bias, (void)out, (void)out_row,
      (void)num_threads;
#endif
  return status;
}

int engine_small_matmul(int dtype, const void* x, int64_t x_row, int64_t M, const void* w,
                        int64_t N, int64_t K, const void* bias, void* out, int64_t out_row,
                        int num_threads) {
  return run_small_matmul(kDenseFormat, dtype, x, x_row, M, w, N, K, bias, out, out_row,
                          num_threads);
}

int engine_small_matmul_q8_0(int dtype, const void* x, int64_t x_row, int64_t M,
                             const void* blocks, int64_t N, int64_t K, const void* bias,
                             void* out, int64_t out_row, int num_threads) {
  return run_small_matmul(kQ8_0Format, dtype, x, x_row, M, blocks, N, K, bias, out, out_row,
                          num_threads);
}

}  // extern "C"
