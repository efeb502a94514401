/* The test_capture_native kernel's product, with the CPU step graph's function ABI
 * (engine.sdk.graph_calls): int fn(const int64_t* args, int64_t num_args, int max_threads).
 *
 * args: x (float32 rows, x_row elements apart), rows, weight (float32 [n, k], contiguous),
 * n, k, bias (float32 [n], or null), out (float32 rows, out_row elements apart), out_row.
 * out = x weight^T + bias, on the calling thread (max_threads is an upper bound: a kernel
 * with an OpenMP region would pass num_threads(min(its own, max_threads))).
 * Returns 0, or 1 when it gets other than 9 arguments. */
#include <stdint.h>

int test_capture_matmul(const int64_t* args, int64_t num_args, int max_threads) {
  (void)max_threads;
  if (num_args != 9) return 1;
  const float* x = (const float*)args[0];
  const int64_t x_row = args[1], rows = args[2];
  const float* weight = (const float*)args[3];
  const int64_t n = args[4], k = args[5];
  const float* bias = (const float*)args[6];
  float* out = (float*)args[7];
  const int64_t out_row = args[8];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t i = 0; i < k; ++i) sum += x[r * x_row + i] * weight[j * k + i];
      out[r * out_row + j] = bias ? sum + bias[j] : sum;
    }
  }
  return 0;
}
