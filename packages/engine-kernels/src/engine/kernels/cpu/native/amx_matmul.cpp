// The bfloat16 packed product on AMX tiles (Sapphire Rapids and later): what
// engine_packed_matmul and engine_matmul run for bfloat16 panels, every row count, where
// this build has AMX (-march=native defines __AMX_TILE__ and __AMX_BF16__) and Linux lets
// the process use the tiles; elsewhere the avx512_bf16 panels (packed_matmul.cpp) run.
//
// No repacking: packed_matmul.cpp's bfloat16 layout with AVX-512 is, per tile of 32
// columns, K / 2 groups of 32 columns x 2 weights (128 bytes), so a tile's 16 groups from
// pair 16 * kb on, read 128 bytes apart, are two AMX B tiles: the first 64 bytes of each
// group (columns 0..15) and the last 64 (columns 16..31), each 16 rows of 16 pairs, as
// TDPBF16PS takes them. The A tiles are 16 activation rows x 32 values read at the row
// stride; the C tiles 16 x 16 float32 sums. One block is up to 32 rows x one packed tile's
// 32 columns: 2 A tiles x 2 B tiles into 4 C tiles (all 8 tile registers, every tile 16
// rows of 64 bytes: one tile configuration). The sums leave the tiles through a float32
// buffer, where the bias is added before the one rounding to bfloat16 (nearest even).
// Rows past M in the last group of 16 are read from a zero-padded copy of those rows; a K
// not a multiple of 32 from a zero-padded copy of x (all rows) and of each tile's last
// pairs. Blocks are split over the threads as packed_matmul.cpp splits its (tile, row
// block) items: passes of kPassRows rows, consecutive items sharing a tile.
//
// Used at every row count, no threshold: measured on a 2-core Sapphire Rapids VM
// (avx512_bf16, amx_bf16/int8/tile), the benchmark model's layer shapes, 12 weight copies
// cycled (weights from memory), 2 threads, best of 15, µs per product, avx512_bf16 panels
// / AMX / oneDNN (torch.ops.mkldnn, AMX too):
//   768->1280   4 rows 58 / 43 / 66,   16 rows 165 / 44 / 70,   64 rows 599 / 73 / 106,
//               512 rows 4696 / 491 / 396
//   768->5120   4 rows 485 / 174 / 308, 64 rows 2720 / 441 / 486, 512 rows 19130 / 2106 / 1447
//   2560->768   4 rows 117 / 79 / 117,  64 rows 1279 / 126 / 263, 512 rows 9478 / 857 / 1956
//   768->8192  64 rows 4276 / 725 / 743, 512 rows 31041 / 3490 / 3067
// the whole step's products (49): 4 rows 9.1 / 4.3 / 7.0 ms, 16 rows 18.8 / 4.9 / 7.4,
// 64 rows 63.5 / 8.9 / 11.8, 512 rows 464 / 48 / 54. At 1-3 rows AMX on the panels beats
// small_matmul.cpp's loop on the dense weight too (1 row: 768->1280 41-47 µs vs 48-55,
// 768->5120 214-260 vs 351-401, 2560->768 86-92 vs 110-115), so engine_matmul (graph.cpp)
// sends every bfloat16 row count here. Below oneDNN: 512+ rows of the wide shapes
// (0.7-0.9x; ~1.1 TFLOP/s a core against its ~1.5: each K step's four tile loads come
// from L2 here, where oneDNN keeps one operand in L1).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"
#define ENGINE_AMX 1
#endif

namespace {

#if defined(ENGINE_AMX)

constexpr int64_t kColumns = 32;     // packed_matmul.cpp's tile with AVX-512 (kColumns)
constexpr int64_t kBlockK = 32;      // bfloat16 values of K per A tile row (64 bytes)
constexpr int64_t kGroupRows = 16;   // rows per A / C tile
constexpr int64_t kBlockRows = 32;   // rows per block: two A tiles
constexpr int64_t kPassRows = 256;   // as packed_matmul.cpp
constexpr int64_t kTileK = kBlockK * kColumns;  // weights of one K block of a packed tile
// Tile registers (GCC's tile intrinsics take the number as a literal token): C tiles by
// (row group, column half), A tiles by row group, B tiles by column half.
#define kC00 0
#define kC01 1
#define kC10 2
#define kC11 3
#define kA0 4
#define kA1 5
#define kB0 6
#define kB1 7

// GCC's tile loads are asm that does not tell the compiler they read memory: a barrier
// keeps the writes of the buffers they read before them.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// Linux keeps AMX's 8 KB of tile state off until the process asks (arch_prctl; without
// it a tile instruction raises SIGILL). Asked once per process; false if refused.
bool tiles_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return permitted;
}

// Every tile 16 rows of 64 bytes (palette 1). Per thread: each thread loads it.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                    {16, 16, 16, 16, 16, 16, 16, 16}};

// 16 activation rows: the first at p, each `stride` bytes after the last.
struct Rows {
  const uint16_t* p;
  int64_t stride;
};

// C (rows 16 * two groups x the tile's 32 columns, 32 floats a row) = A rows x the packed
// tile over `steps` K blocks, the last one from b_tail when it is not null.
template <bool kTwoGroups>
void block_sums(Rows a0, Rows a1, const uint16_t* tile, int64_t steps, const uint16_t* b_tail,
                float* c) {
  _tile_zero(kC00);
  _tile_zero(kC01);
  if (kTwoGroups) {
    _tile_zero(kC10);
    _tile_zero(kC11);
  }
  for (int64_t kb = 0; kb < steps; ++kb) {
    const uint16_t* b = b_tail != nullptr && kb == steps - 1 ? b_tail : tile + kb * kTileK;
    _tile_loadd(kB0, b, kColumns * 4);
    _tile_loadd(kB1, b + kGroupRows * 2, kColumns * 4);
    _tile_loadd(kA0, a0.p + kb * kBlockK, a0.stride);
    _tile_dpbf16ps(kC00, kA0, kB0);
    _tile_dpbf16ps(kC01, kA0, kB1);
    if (kTwoGroups) {
      _tile_loadd(kA1, a1.p + kb * kBlockK, a1.stride);
      _tile_dpbf16ps(kC10, kA1, kB0);
      _tile_dpbf16ps(kC11, kA1, kB1);
    }
  }
  _tile_stored(kC00, c, kColumns * 4);
  _tile_stored(kC01, c + kGroupRows, kColumns * 4);
  if (kTwoGroups) {
    _tile_stored(kC10, c + kGroupRows * kColumns, kColumns * 4);
    _tile_stored(kC11, c + kGroupRows * kColumns + kGroupRows, kColumns * 4);
  }
}

// Where the activations' row groups are read: x itself, its last group (rows past M)
// from a zero-padded copy, or (K not a multiple of 32) all of x from one.
struct Activations {
  const uint16_t* x;
  int64_t x_row;  // elements
  int64_t M;
  const uint16_t* copy;  // null, the last group's rows or all rows, each `width` apart
  int64_t width;         // K rounded up to 32
  bool all_copied;
  Rows group(int64_t g) const {
    if (all_copied) return {copy + g * kGroupRows * width, width * 2};
    if ((g + 1) * kGroupRows <= M) return {x + g * kGroupRows * x_row, x_row * 2};
    return {copy, width * 2};
  }
};

// The copies Activations reads, in `buffer` (the calling thread's, reused).
Activations activations(const uint16_t* x, int64_t x_row, int64_t M, int64_t K,
                        std::vector<uint16_t>& buffer) {
  const int64_t width = (K + kBlockK - 1) / kBlockK * kBlockK;
  const bool all = width != K;
  const int64_t from = all ? 0 : M / kGroupRows * kGroupRows;
  if (from == M) return {x, x_row, M, nullptr, width, false};
  const int64_t rows = (M - from + kGroupRows - 1) / kGroupRows * kGroupRows;
  buffer.assign(static_cast<size_t>(rows * width), 0);
  for (int64_t r = from; r < M; ++r)
    std::memcpy(buffer.data() + (r - from) * width, x + r * x_row, static_cast<size_t>(K * 2));
  return {x, x_row, M, buffer.data(), width, all};
}

// out rows [m, m + rows) x the tile's first n columns = C + bias, rounded to bfloat16.
void store_block(const float* c, int64_t rows, const uint16_t* bias, uint16_t* out,
                 int64_t out_row, int64_t n) {
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = bf16_load_first(bias, n < 16 ? n : 16);
    if (n > 16) b1 = bf16_load_first(bias + 16, n - 16);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + r * kColumns), b0);
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + r * kColumns + 16), b1);
    bf16_store_first(out + r * out_row, lo, hi, n);
  }
}

void amx_matmul(const Activations& a, const uint16_t* packed, int64_t N, int64_t K,
                const uint16_t* bias, uint16_t* out, int64_t out_row, int num_threads) {
  const int64_t tiles = (N + kColumns - 1) / kColumns;
  const int64_t steps = (K + kBlockK - 1) / kBlockK;
  const int64_t tail_pairs = K % kBlockK / 2;  // pairs of the last K block when not whole
  for (int64_t first = 0; first < a.M; first += kPassRows) {
    const int64_t rows = a.M - first < kPassRows ? a.M - first : kPassRows;
    const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
    const int64_t items = tiles * blocks;
    const int threads = static_cast<int>(items < num_threads ? items : num_threads);
#pragma omp parallel num_threads(threads)
    {
      _tile_loadconfig(&kTileConfig);
      alignas(64) float c[kBlockRows * kColumns];
      alignas(64) uint16_t b_tail[kTileK];
      const uint16_t* tail = nullptr;
      int64_t tail_of = -1;  // the tile b_tail holds the last pairs of
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / blocks, b = item % blocks;
        const uint16_t* tile = packed + t * kColumns * K;
        if (tail_pairs > 0 && tail_of != t) {
          std::memset(b_tail, 0, sizeof b_tail);
          std::memcpy(b_tail, tile + (steps - 1) * kTileK,
                      static_cast<size_t>(tail_pairs * kColumns * 2 * 2));
          tail = b_tail;
          tail_of = t;
          memory_barrier();
        }
        const int64_t m = first + b * kBlockRows;
        const int64_t block_rows = rows - b * kBlockRows < kBlockRows ? rows - b * kBlockRows
                                                                      : kBlockRows;
        const Rows a0 = a.group(m / kGroupRows);
        if (block_rows > kGroupRows) {
          block_sums<true>(a0, a.group(m / kGroupRows + 1), tile, steps, tail, c);
        } else {
          block_sums<false>(a0, a0, tile, steps, tail, c);
        }
        const int64_t left = N - t * kColumns;
        store_block(c, block_rows, bias != nullptr ? bias + t * kColumns : nullptr,
                    out + m * out_row + t * kColumns, out_row, left < kColumns ? left : kColumns);
      }
      _tile_release();
    }
  }
}

#endif  // ENGINE_AMX

}  // namespace

extern "C" {

// engine_packed_matmul's bfloat16 product (same arguments, the weight packed by
// engine_pack_matmul_weight) on AMX tiles. Returns 0; 1, having done nothing, where this
// build has no AMX or the process may not use it (then the avx512_bf16 panels run).
int engine_amx_packed_matmul(const void* x, int64_t x_row, int64_t M, const void* packed,
                             int64_t N, int64_t K, const void* bias, void* out,
                             int64_t out_row, int num_threads) {
#if defined(ENGINE_AMX)
  if (!tiles_permitted()) return 1;
  thread_local std::vector<uint16_t> buffer;
  const Activations a = activations(static_cast<const uint16_t*>(x), x_row, M, K, buffer);
  memory_barrier();
  amx_matmul(a, static_cast<const uint16_t*>(packed), N, K, static_cast<const uint16_t*>(bias),
             static_cast<uint16_t*>(out), out_row, num_threads);
  return 0;
#else
  (void)x, (void)x_row, (void)M, (void)packed, (void)N, (void)K, (void)bias, (void)out,
      (void)out_row, (void)num_threads;
  return 1;
#endif
}

}  // extern "C"
