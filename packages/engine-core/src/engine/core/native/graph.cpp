// The CPU step graph's interpreter (engine.core.native.graph), and the small kernels only a
// graph needs on top of the others: the matmul that picks its loop by row count, row
// copies and the embedding's row gather.
//
// A graph is the list of kernel calls one forward pass of the model makes, recorded once
// with every pointer fixed (weights, KV caches, the graph's own buffers and inputs) and
// replayed here for any token count up to the one it was recorded for: one call from
// Python per step instead of ~10 per layer, each with its Python around it.
//
// Each op is kOpWidth int64s: the kernel (GraphKernel), a mask of the arguments that are
// a multiple of the step's token count (such an argument holds the multiple, and becomes
// multiple * `rows` before the call: rows of per-head tensors are tokens * heads), then the
// arguments in the kernel's order: pointers and integers as they are, a float as its 32 bits.

#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "numerics.h"

namespace {

enum GraphKernel : int64_t {
  kRmsNorm = 0,
  kRotaryEmbedding = 1,
  kSiluAndMul = 2,
  kMatmul = 3,
  kWriteKv = 4,
  kPagedAttention = 5,
  kCopyRows = 6,
  kGatherRows = 7,
};

constexpr int64_t kMaxArgs = 24;
constexpr int64_t kOpWidth = 2 + kMaxArgs;
// Most rows engine_small_matmul takes (kMaxRows in small_matmul.cpp).
constexpr int64_t kSmallRows = 3;

struct Args {
  int64_t a[kMaxArgs];
  void* p(int i) const { return reinterpret_cast<void*>(a[i]); }
  int i32(int i) const { return static_cast<int>(a[i]); }
  float f(int i) const {
    const auto bits = static_cast<uint32_t>(a[i]);
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }
  template <typename T>
  T* ptr(int i) const { return reinterpret_cast<T*>(a[i]); }
  // The thread count recorded at i, capped at the run's.
  int threads(int i) const { return a[i] < max_threads ? static_cast<int>(a[i]) : max_threads; }
  int max_threads;
};

int run_op(int64_t kernel, const Args& x) {
  switch (kernel) {
    case kRmsNorm:
      return engine_rms_norm(x.i32(0), x.p(1), x.a[2], x.p(3), x.a[4], x.p(5), x.a[6], x.a[7],
                             x.f(8), x.threads(9));
    case kRotaryEmbedding:
      return engine_rotary_embedding(x.i32(0), x.ptr<const int64_t>(1), x.a[2],
                                     x.ptr<const float>(3), x.a[4], x.a[5], x.i32(6), x.i32(7),
                                     x.p(8), x.a[9], x.a[10], x.i32(11), x.p(12), x.a[13],
                                     x.a[14], x.i32(15), x.threads(16));
    case kSiluAndMul:
      return engine_silu_and_mul(x.i32(0), x.p(1), x.a[2], x.p(3), x.a[4], x.a[5], x.a[6],
                                 x.threads(7));
    case kMatmul:
      return engine_matmul(x.i32(0), x.p(1), x.a[2], x.a[3], x.p(4), x.p(5), x.a[6], x.a[7],
                           x.p(8), x.p(9), x.a[10], x.threads(11));
    case kWriteKv:
      engine_write_kv(x.i32(0), x.p(1), x.a[2], x.a[3], x.p(4), x.a[5], x.a[6], x.p(7), x.p(8),
                      x.a[9], x.a[10], x.a[11], x.ptr<const int64_t>(12), x.a[13], x.i32(14),
                      x.i32(15), x.i32(16));
      return 0;
    case kPagedAttention:
      return engine_paged_attention(
          x.i32(0), x.p(1), x.a[2], x.a[3], x.p(4), x.p(5), x.a[6], x.a[7], x.a[8],
          x.ptr<const int32_t>(9), x.a[10], x.ptr<const int32_t>(11), x.ptr<const int32_t>(12),
          x.a[13], x.p(14), x.a[15], x.a[16], x.i32(17), x.i32(18), x.i32(19), x.i32(20),
          x.i32(21), x.f(22), x.threads(23));
    case kCopyRows:
      return engine_copy_rows(x.p(0), x.a[1], x.p(2), x.a[3], x.a[4], x.a[5]);
    case kGatherRows:
      return engine_gather_rows(x.p(0), x.a[1], x.a[2], x.ptr<const int64_t>(3), x.a[4],
                                x.p(5), x.a[6], x.a[7]);
    default:
      return 255;
  }
}

}  // namespace

extern "C" {

// out [M, N] = x [M, K] W^T + bias: engine_small_matmul on the dense W for 1..3 rows (where
// this build has that dtype), else engine_packed_matmul on W's panels (null: none); bfloat16
// panels on AMX for every row count (amx_matmul.cpp: faster than the dense loop from 1 row).
// Returns their status, or 4 when neither takes M rows here.
int engine_matmul(int dtype, const void* x, int64_t x_row, int64_t M, const void* w,
                  const void* packed, int64_t N, int64_t K, const void* bias, void* out,
                  int64_t out_row, int num_threads) {
  if (packed != nullptr && dtype == kBFloat16 &&
      engine_amx_packed_matmul(x, x_row, M, packed, N, K, bias, out, out_row, num_threads) == 0)
    return 0;
  if (M >= 1 && M <= kSmallRows && w != nullptr && (engine_small_matmul_dtypes() >> dtype & 1))
    return engine_small_matmul(dtype, x, x_row, M, w, N, K, bias, out, out_row, num_threads);
  if (packed != nullptr)
    return engine_packed_matmul(dtype, x, x_row, M, packed, N, K, bias, out, out_row,
                                num_threads);
  return 4;
}

// rows of row_bytes each, from src (rows src_row bytes apart) to dst (dst_row apart).
int engine_copy_rows(const void* src, int64_t src_row, void* dst, int64_t dst_row,
                     int64_t rows, int64_t row_bytes) {
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  if (src_row == row_bytes && dst_row == row_bytes) {
    std::memmove(d, s, static_cast<size_t>(rows * row_bytes));
    return 0;
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memmove(d + r * dst_row, s + r * src_row, static_cast<size_t>(row_bytes));
  return 0;
}

// out row t = table row ids[t] (rows of row_bytes; table rows table_row bytes apart, out
// rows out_row apart). Returns 2, having written nothing, if an id is outside the table.
int engine_gather_rows(const void* table, int64_t table_row, int64_t table_rows,
                       const int64_t* ids, int64_t rows, void* out, int64_t out_row,
                       int64_t row_bytes) {
  for (int64_t t = 0; t < rows; ++t)
    if (ids[t] < 0 || ids[t] >= table_rows) return 2;
  const auto* s = static_cast<const char*>(table);
  auto* d = static_cast<char*>(out);
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(d + t * out_row, s + ids[t] * table_row, static_cast<size_t>(row_bytes));
  return 0;
}

// Runs num_ops ops (kOpWidth int64s each, see the top of this file) for `rows` tokens, each
// on at most max_threads threads (fewer where it was recorded with fewer). Returns 0, or
// (index of the failing op + 1) * 256 + its status; the ops after it do not run.
int64_t engine_graph_run(const int64_t* ops, int64_t num_ops, int64_t rows,
                         int max_threads) {
  for (int64_t i = 0; i < num_ops; ++i) {
    const int64_t* op = ops + i * kOpWidth;
    Args args;
    args.max_threads = max_threads < 1 ? 1 : max_threads;
    std::memcpy(args.a, op + 2, sizeof args.a);
    for (int64_t j = 0; j < kMaxArgs; ++j)
      if (op[1] >> j & 1) args.a[j] *= rows;  // it holds the multiple of the token count
    const int status = run_op(op[0], args);
    if (status != 0) return (i + 1) * 256 + (status & 255);
  }
  return 0;
}

}  // extern "C"
