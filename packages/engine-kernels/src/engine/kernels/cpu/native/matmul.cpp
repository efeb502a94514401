// The matmul a linear layer calls (the `cpu` linear kernel): it picks its loop by row
// count and by what the weight has, so one recorded call serves every token count of a
// step graph.

#include <cstdint>

#include "engine_graph_call.h"
#include "kernels.h"
#include "numerics.h"

namespace {

// Most rows engine_small_matmul takes (kMaxRows in small_matmul.cpp).
constexpr int64_t kSmallRows = 3;

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

}  // extern "C"

// The step graph's entry (graph_call.h): the arguments as library.py passes them.
ENGINE_GRAPH_ENTRY(matmul, 12) {
  return engine_matmul(x.i32(0), x.p(1), x.a[2], x.a[3], x.p(4), x.p(5), x.a[6], x.a[7],
                       x.p(8), x.p(9), x.a[10], x.threads(11));
}
