// Products of activation rows with a weight packed once into column panels (the `cpu`
// linear kernel's path from SMALL_MATMUL_ROWS + 1 rows up): out [M, N] = x [M, K] W^T + bias.
//
// Packed layout: W [N, K] in panels of kPanel = 32 output columns, each panel kTiles tiles
// of kColumns = two registers of float32 results (one tile of 32 with AVX-512, two of 16
// with AVX2), each tile K / P groups of kColumns x P weights, P = 2 for bfloat16 (the
// pairs avx512_bf16's dot product takes), 1 for float32:
//     packed[panel][tile][k / P][column][k % P] = W[panel * 32 + tile * kColumns + column][k]
// with the columns past N in the last panel zero. A tile is one contiguous stream; the
// size is the same on every CPU (ceil(N / 32) * 32 * K).
//
// Weights packed as bfloat16 for float32 activations (dtype code kWidened): a float32
// weight whose every value is a bfloat16 value (a bfloat16 checkpoint run in float32) is
// packed as those bfloat16 values, half the bytes, and each group's registers are widened
// back to float32 as they are loaded (exactly: a bfloat16 is a float32's upper half), so
// the sums are the float32 kernel's, bit for bit. The group's kColumns values are stored
// in the order the widening (unpack with zero, per 128-bit lane) puts them back in
// (widened_column). Built with AVX2 (see WidenedPanel); measured there (2-core Zen 4, the
// model's shapes, weights from memory): 2.5x the float32 panels at 1 row, 2.4x at 4, 1.1x
// at 16, 1.05x at 64, 1.02x at 256.
//
// The micro-kernel keeps up to kRows rows x one tile's columns of float32 sums in registers
// (12 rows with AVX-512's 32 registers, 6 with AVX2's 16): per group it loads the tile's
// two registers once and, for each row, broadcasts the row's P values and
// multiplies-accumulates into both (2 * kRows dot products per 2 loads and kRows
// broadcasts). Rows go in passes of kPassRows (the pass's activations stay in L2), each
// pass in ceil(rows / kRows) row blocks of (nearly) equal size, its (tile, row block)
// items split statically over the threads, consecutive items sharing a tile. Equal
// blocks took 5% off the products at 64 rows (6 blocks of 10-11 rows instead of five of
// 12 and one of 4) and 2-3% at 40-250 rows (benchmarks/README.md, runs 27-30). Sums are
// float32 in K order, bias added before the one rounding. With AVX2 each block of a tile
// also prefetches its share of the thread's next tile, spread over its groups: the first
// block of a tile otherwise waits on memory (kPrefetchNextTile).
// Built for float32 with AVX-512 or AVX2 and FMA, bfloat16 with avx512_bf16. With AVX2 a
// tile is 16 columns stored contiguously (an earlier loop that read half of a 32-column
// panel's rows at a stride ran at 0.84-0.90x oneDNN on a 2-core Zen 3).
//
// Measured on a 2-core Zen 4 (avx512_bf16), the benchmark model's shapes, weights from
// memory, bfloat16: 1.08-1.13x oneDNN's prepacked matmul at 64 rows (~400-430 GFLOP/s of
// a ~450 peak), ~1.3x at 4-16 rows, 0.97-1.05x at 512-2048 (benchmarks/linear_kernels.py).
// On a CPU with AMX the same bfloat16 panels are multiplied on its tiles instead
// (amx_matmul.cpp: a tile of 32 columns is two AMX B tiles as it is).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "numerics.h"
#include "simd.h"

namespace {

constexpr int64_t kPanel = 32;
constexpr int64_t kPassRows = 256;
// The dtype code of float32 activations with weights packed as bfloat16 (after Dtype's).
constexpr int kWidened = 2;

#if defined(ENGINE_F32_SIMD)

// A tile's columns are two registers; a panel is kTiles tiles.
constexpr int64_t kColumns = 2 * kF32Lanes;
constexpr int64_t kTiles = kPanel / kColumns;
// The micro-kernel's block: kRows rows x one tile's columns of sums (two registers per
// row), in registers with the two weight registers and a broadcast: 27 of AVX-512's 32
// registers, 15 of AVX2's 16.
#if defined(__AVX512F__)
constexpr int kRows = 12;
#else
constexpr int kRows = 6;
#endif
// Whether a block prefetches part of the thread's next tile (see packed_matmul). With AVX2
// the products of weights streamed from memory ran 1.14x faster at 64 rows and 1.5-1.8x
// at 4-16 rows with it; with AVX-512 (float32 and bfloat16) 0.9-0.95x at 16-64 rows and
// 0.6x at 8, as that loop's hardware prefetch already keeps up (2-core Zen 4, one build
// for each, the benchmark model's layer shapes, 12 weight copies).
#if defined(__AVX512F__)
constexpr bool kPrefetchNextTile = false;
#else
constexpr bool kPrefetchNextTile = true;
#endif
static_assert(kTiles * kColumns == kPanel, "a panel is whole tiles");

// How a panel's group is read and multiplied, by activation type (Act: x, bias and out)
// and packed weight type (Weight): kPack weights of a column per group, weights() the
// group's two registers, broadcast() a row's kPack values, madd() into float32 sums.
struct Float32Panel {
  using Act = float;
  using Weight = float;
  static constexpr int64_t kPack = 1;
  using Vec = F32Vec;
  static void weights(const float* p, Vec& w0, Vec& w1) {
    w0 = f32_load(p);
    w1 = f32_load(p + kF32Lanes);
  }
  static Vec broadcast(const float* x) { return f32_broadcast(x); }
  static F32Vec madd(F32Vec acc, Vec x, Vec w) { return f32_fmadd(x, w, acc); }
  // The tile's first n (1..kColumns) outputs.
  static void store(float* out, F32Vec lo, F32Vec hi, int64_t n) {
    f32_store_first(out, lo, n);
    if (n > kF32Lanes) f32_store_first(out + kF32Lanes, hi, n - kF32Lanes);
  }
};

#if !defined(__AVX512F__)
// float32 activations, weights packed as bfloat16 in widened_column order (see the top).
// AVX2 builds only: with AVX-512 the same loop (one 512-bit load, two unpacks) measured
// 2.8x / 1.8x / 1.06x the float32 panels at 1 / 4 / 16 rows but 0.95x at 64 and 256
// (2-core Zen 4), where the float32 panels already run at the FMA peak.
constexpr bool kWidenedBuilt = true;
struct WidenedPanel : Float32Panel {
  using Weight = uint16_t;
  static void weights(const uint16_t* p, Vec& w0, Vec& w1) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
};
#else
constexpr bool kWidenedBuilt = false;
#endif

// The column (0..kColumns) whose value WidenedPanel::weights finds at position i of a
// group: the unpacks take each 128-bit lane's first four values into the low register and
// its last four into the high one.
constexpr int64_t widened_column(int64_t i) {
  return (i % 8 < 4 ? 0 : kF32Lanes) + i / 8 * 4 + i % 4;
}

// n (1..kF32Lanes) bias values, the other lanes 0.
inline F32Vec bias_lanes(const float* b, int64_t n) {
  return n >= kF32Lanes ? f32_load(b) : f32_load_first(b, n);
}

#if defined(__AVX512BF16__)
struct BFloat16Panel {
  using Act = uint16_t;
  using Weight = uint16_t;
  static constexpr int64_t kPack = 2;
  using Vec = __m512bh;
  static void weights(const uint16_t* p, Vec& w0, Vec& w1) {
    w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
    w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p + kF32Lanes * kPack));
  }
  static Vec broadcast(const uint16_t* x) {  // the pair x[0], x[1] in every 32-bit lane
    int32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
  }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
  static void store(uint16_t* out, __m512 lo, __m512 hi, int64_t n) {
    bf16_store_first(out, lo, hi, n);
  }
};

inline __m512 bias_lanes(const uint16_t* b, int64_t n) { return bf16_load_first(b, n); }
#endif

// Cache lines of a later tile to bring into the cache while a block computes.
struct Ahead {
  const char* lines = nullptr;  // the first line
  int64_t count = 0;
};

// out rows [0, R) x the tile's first n (1..kColumns) columns; meanwhile ahead's lines are
// prefetched, spread evenly over the groups.
template <int R, typename P, typename T = typename P::Act, typename W = typename P::Weight>
void panel_rows(const T* x, int64_t x_row, const W* w, int64_t K, const T* bias, T* out,
                int64_t out_row, int64_t n, Ahead ahead) {
  constexpr int64_t kPack = P::kPack;
  const int64_t groups = K / kPack;
  F32Vec lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = f32_zero();
  const auto group = [&](int64_t g) __attribute__((always_inline)) {
    typename P::Vec w0, w1;
    P::weights(w + g * kColumns * kPack, w0, w1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto xv = P::broadcast(x + r * x_row + g * kPack);
      lo[r] = P::madd(lo[r], xv, w0);
      hi[r] = P::madd(hi[r], xv, w1);
    }
  };
  int64_t g = 0;
  if (ahead.count > 0) {
    const int64_t every = groups / ahead.count > 1 ? groups / ahead.count : 1;
    for (int64_t line = 0; line < ahead.count; ++line) {
      _mm_prefetch(ahead.lines + line * 64, _MM_HINT_T1);
      const int64_t end = g + every < groups ? g + every : groups;
      for (; g < end; ++g) group(g);
    }
  }
  for (; g < groups; ++g) group(g);
  F32Vec b0 = f32_zero(), b1 = f32_zero();
  if (bias != nullptr) {
    b0 = bias_lanes(bias, n < kF32Lanes ? n : kF32Lanes);
    if (n > kF32Lanes) b1 = bias_lanes(bias + kF32Lanes, n - kF32Lanes);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    P::store(out + r * out_row, f32_add(lo[r], b0), f32_add(hi[r], b1), n);
  }
}

// panel_rows for rows (1..R) known only at run time.
template <int R, typename P, typename T = typename P::Act, typename W = typename P::Weight>
void panel_block(int rows, const T* x, int64_t x_row, const W* tile, int64_t K, const T* bias,
                 T* out, int64_t out_row, int64_t columns, Ahead ahead) {
  if constexpr (R > 0) {
    if (rows == R) {
      panel_rows<R, P>(x, x_row, tile, K, bias, out, out_row, columns, ahead);
    } else {
      panel_block<R - 1, P>(rows, x, x_row, tile, K, bias, out, out_row, columns, ahead);
    }
  }
}

// Tiles of an N-column weight: whole panels' worth (the last panel's columns past N zero).
inline int64_t tiles_of(int64_t N) { return (N + kPanel - 1) / kPanel * kTiles; }

template <typename P, typename T = typename P::Act, typename W = typename P::Weight>
void packed_matmul(const T* x, int64_t x_row, int64_t M, const W* packed, int64_t N, int64_t K,
                   const T* bias, T* out, int64_t out_row, int num_threads) {
  const int64_t tiles = tiles_of(N);
  const int64_t tile_lines = (kColumns * K * static_cast<int64_t>(sizeof(W)) + 63) / 64;
  for (int64_t first = 0; first < M; first += kPassRows) {
    const int64_t rows = M - first < kPassRows ? M - first : kPassRows;
    const int64_t blocks = (rows + kRows - 1) / kRows;
    // The pass's rows spread evenly over its blocks (64 rows: 11 11 11 11 10 10, not
    // 12 12 12 12 12 4: a block of a few rows keeps too few sums in flight).
    const int64_t base = rows / blocks, extra = rows % blocks;
    const int64_t items = tiles * blocks;
    const int threads = static_cast<int>(items < num_threads ? items : num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / blocks, b = item % blocks;
      const int64_t left = N - t * kColumns;  // a tile past N (all zero) is skipped
      if (left <= 0) continue;
      const int64_t m = first + b * base + (b < extra ? b : extra);
      const int r = static_cast<int>(base + (b < extra ? 1 : 0));
      const int64_t columns = left < kColumns ? left : kColumns;
      // The next tile (this thread's next, but at the end of its share) comes from memory
      // while this tile's blocks run from the cache: block b prefetches its b-th part.
      Ahead ahead;
      if (kPrefetchNextTile && t + 1 < tiles && N - (t + 1) * kColumns > 0) {
        const int64_t from = tile_lines * b / blocks, to = tile_lines * (b + 1) / blocks;
        ahead = {reinterpret_cast<const char*>(packed + (t + 1) * kColumns * K) + from * 64,
                 to - from};
      }
      panel_block<kRows, P>(r, x + m * x_row, x_row, packed + t * kColumns * K, K,
                            bias != nullptr ? bias + t * kColumns : nullptr,
                            out + m * out_row + t * kColumns, out_row, columns, ahead);
    }
  }
}

template <typename P, typename T = typename P::Weight>
void pack(const T* w, int64_t N, int64_t K, T* packed, int num_threads) {
  constexpr int64_t kPack = P::kPack;
  const int64_t tiles = tiles_of(N);
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    T* dst = packed + t * kColumns * K;
    for (int64_t g = 0; g < K / kPack; ++g) {
      for (int64_t c = 0; c < kColumns; ++c) {
        const int64_t n = t * kColumns + c;
        for (int64_t j = 0; j < kPack; ++j) {
          dst[(g * kColumns + c) * kPack + j] = n < N ? w[n * K + g * kPack + j] : T{0};
        }
      }
    }
  }
}

// pack for WidenedPanel: float32 w, its values' upper halves in widened_column order.
// Returns false, the packing unfinished, if a value is not a bfloat16 value (its lower 16
// bits not zero).
bool pack_widened(const float* w, int64_t N, int64_t K, uint16_t* packed, int num_threads) {
  const int64_t tiles = tiles_of(N);
  bool exact = true;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(&& : exact)
  for (int64_t t = 0; t < tiles; ++t) {
    uint16_t* dst = packed + t * kColumns * K;
    for (int64_t g = 0; g < K && exact; ++g) {
      for (int64_t i = 0; i < kColumns; ++i) {
        const int64_t n = t * kColumns + widened_column(i);
        uint32_t bits = 0;
        if (n < N) std::memcpy(&bits, w + n * K + g, sizeof bits);
        exact = exact && (bits & 0xFFFFu) == 0;
        dst[g * kColumns + i] = static_cast<uint16_t>(bits >> 16);
      }
    }
  }
  return exact;
}

// Calls f(P{}) for the panel type of a dtype code engine_packed_matmul_dtypes() reports;
// returns 1 for any other, without instantiating f for it.
template <typename F>
int with_panel(int dtype, F&& f) {
  if (dtype == kWidened) {
#if !defined(__AVX512F__)
    f(WidenedPanel{});
    return 0;
#else
    return 1;
#endif
  }
  return with_matmul_dtype(dtype, [&](auto tag) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<decltype(tag), uint16_t>) {
      f(BFloat16Panel{});
      return;
    }
#endif
    if constexpr (std::is_same_v<decltype(tag), float>) f(Float32Panel{});
  });
}

#endif  // ENGINE_F32_SIMD

}  // namespace

extern "C" {

// Bit i set: dtype code i has a kernel in this build: matmul_dtypes() with AVX-512 or AVX2
// and FMA, and kWidened (2: float32 activations, weights packed as bfloat16) with AVX2;
// none elsewhere (see the top of this file).
int engine_packed_matmul_dtypes() {
#if defined(ENGINE_F32_SIMD)
  return matmul_dtypes() | (kWidenedBuilt ? 1 << kWidened : 0);
#else
  return 0;
#endif
}

// packed [ceil(N / 32) * 32 * K] = W [N, K] (contiguous) in the layout above; for kWidened
// W is float32 and packed bfloat16. Returns 0; 1 for a dtype this build has no kernel for;
// 2 for K not a multiple of the dtype's group; 3 (kWidened) for a value of W that is not a
// bfloat16 value.
int engine_pack_matmul_weight(int dtype, const void* w, int64_t N, int64_t K, void* packed,
                              int num_threads) {
#if defined(ENGINE_F32_SIMD)
  if (dtype == kBFloat16 && K % 2) return 2;
  if (dtype == kWidened) {
    if (!kWidenedBuilt) return 1;
    return pack_widened(static_cast<const float*>(w), N, K, static_cast<uint16_t*>(packed),
                        num_threads) ? 0 : 3;
  }
  return with_panel(dtype, [&](auto panel) {
    using P = decltype(panel);
    using W = typename P::Weight;
    pack<P>(static_cast<const W*>(w), N, K, static_cast<W*>(packed), num_threads);
  });
#else
  (void)dtype, (void)w, (void)N, (void)K, (void)packed, (void)num_threads;
  return 1;
#endif
}

// out [M, N] (rows out_row apart) = x [M, K] (rows x_row apart) W^T + bias (null: none),
// W packed by engine_pack_matmul_weight with the same dtype code (kWidened: x, bias and out
// float32). Returns 0; 1 for a dtype this build has no kernel for; 2 for K not a multiple
// of the dtype's group.
int engine_packed_matmul(int dtype, const void* x, int64_t x_row, int64_t M,
                         const void* packed, int64_t N, int64_t K, const void* bias, void* out,
                         int64_t out_row, int num_threads) {
#if defined(ENGINE_F32_SIMD)
  if (dtype == kBFloat16 && K % 2) return 2;
  if (dtype == kBFloat16 && (matmul_dtypes() >> kBFloat16 & 1) &&
      engine_amx_packed_matmul(x, x_row, M, packed, N, K, bias, out, out_row, num_threads) == 0)
    return 0;  // AMX, where built and allowed (amx_matmul.cpp)
  return with_panel(dtype, [&](auto panel) {
    using P = decltype(panel);
    using T = typename P::Act;
    using W = typename P::Weight;
    packed_matmul<P>(static_cast<const T*>(x), x_row, M, static_cast<const W*>(packed), N, K,
                     static_cast<const T*>(bias), static_cast<T*>(out), out_row, num_threads);
  });
#else
  (void)dtype, (void)x, (void)x_row, (void)M, (void)packed, (void)N, (void)K, (void)bias,
      (void)out, (void)out_row, (void)num_threads;
  return 1;
#endif
}

}  // extern "C"
