// The CPU step graph's interpreter (engine.core.native.graph), and the two calls a graph
// makes of its own: row copies and the embedding's row gather. Built as a library of its
// own (runtime.py), apart from the engine's kernels.
//
// A graph is the list of calls one forward pass of the model makes, recorded once with
// every pointer fixed (weights, KV caches, the graph's own buffers and inputs) and replayed
// here for any token count up to the one it was recorded for: one call from Python per step
// instead of ~10 per layer, each with its Python around it. Every call is of a function
// with the graph ABI (graph_call.h, engine.sdk.graph_calls): the engine's kernels and a
// plugin's alike; this file names none of them.
//
// Each op is kOpWidth int64s: the function's address, a mask of the arguments that are a
// multiple of the step's token count (such an argument holds the multiple, and becomes
// multiple * `rows` before the call: rows of per-head tensors are tokens * heads), the
// number of arguments, then the arguments.

#include <cstdint>
#include <cstring>

#include "engine_graph_call.h"

namespace {

constexpr int64_t kMaxArgs = 24;
constexpr int64_t kOpWidth = 3 + kMaxArgs;

using GraphFunction = int (*)(const int64_t* args, int64_t num_args, int max_threads);

}  // namespace

extern "C" {

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
// told it may use max_threads threads. Returns 0, or (index of the failing op + 1) * 256 +
// its status; the ops after it do not run.
int64_t engine_graph_run(const int64_t* ops, int64_t num_ops, int64_t rows,
                         int max_threads) {
  int64_t args[kMaxArgs];
  const int threads = max_threads < 1 ? 1 : max_threads;
  for (int64_t i = 0; i < num_ops; ++i) {
    const int64_t* op = ops + i * kOpWidth;
    const int64_t num_args = op[2];
    if (num_args < 0 || num_args > kMaxArgs) return (i + 1) * 256 + 254;
    std::memcpy(args, op + 3, sizeof args);
    for (int64_t j = 0; j < num_args; ++j)
      if (op[1] >> j & 1) args[j] *= rows;  // it holds the multiple of the token count
    const auto function = reinterpret_cast<GraphFunction>(op[0]);
    const int status = function(args, num_args, threads);
    if (status != 0) return (i + 1) * 256 + (status > 0 && status < 256 ? status : 255);
  }
  return 0;
}

}  // extern "C"

// The step graph's entries for its own calls (graph_call.h).
ENGINE_GRAPH_ENTRY(copy_rows, 6) {
  return engine_copy_rows(x.p(0), x.a[1], x.p(2), x.a[3], x.a[4], x.a[5]);
}

ENGINE_GRAPH_ENTRY(gather_rows, 8) {
  return engine_gather_rows(x.p(0), x.a[1], x.a[2], x.ptr<const int64_t>(3), x.a[4], x.p(5),
                            x.a[6], x.a[7]);
}
