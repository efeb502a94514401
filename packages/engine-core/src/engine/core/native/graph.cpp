// The CPU step graph's interpreter (engine.core.native.graph), and the calls a graph makes
// of its own: row copies, the embedding's row gather and a scale of rows by a number. Built as a library of its
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

float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

uint16_t to_bf16(float value) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(bits >> 16 | 0x40);
  bits += 0x7fffu + (bits >> 16 & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = h >> 10 & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else if (exponent != 0) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400u)) { mantissa <<= 1; --exponent; }
    bits = sign | exponent << 23 | (mantissa & 0x3ffu) << 13;
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

uint16_t to_f16(float value) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>(bits >> 16 & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // to inf
  if (magnitude < 0x38800000u) {  // a subnormal half (or zero)
    const uint32_t shift = 126 - (magnitude >> 23);
    if (shift > 24) return sign;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), midway = 1u << (shift - 1);
    if (rest > midway || (rest == midway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t rounded = magnitude - 0x38000000u;  // rebias the exponent (127 -> 15)
  rounded += 0xfffu + (rounded >> 13 & 1u);
  return static_cast<uint16_t>(sign | rounded >> 13);
}

template <typename T, float (*Load)(T), T (*Store)(float)>
void scale(const char* s, int64_t src_row, char* d, int64_t dst_row, int64_t rows,
           int64_t width, float factor) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto* in = reinterpret_cast<const T*>(s + r * src_row);
    auto* out = reinterpret_cast<T*>(d + r * dst_row);
    for (int64_t i = 0; i < width; ++i) out[i] = Store(Load(in[i]) * factor);
  }
}

float load_f32(float v) { return v; }
float store_f32(float v) { return v; }

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

// dst = src * factor: rows of `width` elements (rows src_row / dst_row bytes apart) of
// dtype 0 float32, 1 bfloat16, 2 float16; each element widened to float32, multiplied and
// rounded once to the dtype (torch's product of such a tensor and a number). src may be
// dst. Returns 3, having written nothing, for another dtype.
int engine_scale_rows(const void* src, int64_t src_row, void* dst, int64_t dst_row,
                      int64_t rows, int64_t width, int64_t dtype, float factor) {
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  switch (dtype) {
    case 0: scale<float, load_f32, store_f32>(s, src_row, d, dst_row, rows, width, factor);
      return 0;
    case 1: scale<uint16_t, from_bf16, to_bf16>(s, src_row, d, dst_row, rows, width, factor);
      return 0;
    case 2: scale<uint16_t, from_f16, to_f16>(s, src_row, d, dst_row, rows, width, factor);
      return 0;
    default: return 3;
  }
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

ENGINE_GRAPH_ENTRY(scale_rows, 8) {
  return engine_scale_rows(x.p(0), x.a[1], x.p(2), x.a[3], x.a[4], x.a[5], x.a[6], x.f(7));
}
