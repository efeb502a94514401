// The engine's built-in custom ops on the CPU: RMSNorm (optionally fused with the residual
// add), rotary embedding, SiLU-and-mul and GELU-and-mul, one pass over the data each, in
// float32 (exp, erf and tanh from vmath.h).
//
// Each reproduces its op's reference in engine.sdk.ops, rounding where the reference
// rounds (a bfloat16 result is rounded before it is multiplied by the weight or the gate,
// as torch's bfloat16 ops do). Compiled without -ffast-math and without FMA contraction
// (library.py), so divisions are exact and products round as torch's do: rotation and
// SiLU-and-mul give torch's results bit for bit in practice; RMSNorm differs only in the
// order of its float32 mean-square sum; GELU-and-mul only where torch's erf (Abramowitz-
// Stegun, ~1.5e-7 absolute) or tanh and vmath.h's round a value differently. Rows are views: a row stride and a contiguous
// last axis. Called through ctypes by engine.kernels.cpu.native.library, on torch's OpenMP
// runtime and thread count; calls smaller than kParallelElements run on the calling thread.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine_graph_call.h"
#include "kernels.h"
#include "numerics.h"
#include "vmath.h"

namespace {

constexpr int64_t kParallelElements = int64_t{1} << 15;
constexpr int64_t kGateChunk = 512;  // columns per work item (batch-1 rows split too)

template <typename T>
void rms_norm(T* x, int64_t x_row, T* residual, int64_t r_row, const T* weight, int64_t rows,
              int64_t n, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * n >= kParallelElements)
  {
    std::vector<float> h(n);  // the row before normalisation, unrounded (as the reference)
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* xr = x + r * x_row;
      float squares = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * r_row;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; ++i) {
          const float v = load(xr, i) + load(rr, i);
          h[i] = v;
          store(rr, i, v);
          squares += v * v;
        }
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; ++i) {
          const float v = load(xr, i);
          h[i] = v;
          squares += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(xr, i, round_to<T>(h[i] * inv) * load(weight, i));
    }
  }
}

struct Heads {
  void* data;
  int64_t tok, head;
  int count;
};

template <typename T>
inline void rotate_head(T* v, const float* cos, const float* sin, int half, bool neox) {
  if (neox) {
#pragma omp simd
    for (int i = 0; i < half; ++i) {
      const float x1 = load(v, i), x2 = load(v, i + half);
      store(v, i, x1 * cos[i] - x2 * sin[i]);
      store(v, i + half, x2 * cos[i] + x1 * sin[i]);
    }
  } else {
#pragma omp simd
    for (int i = 0; i < half; ++i) {
      const float x1 = load(v, 2 * i), x2 = load(v, 2 * i + 1);
      store(v, 2 * i, x1 * cos[i] - x2 * sin[i]);
      store(v, 2 * i + 1, x2 * cos[i] + x1 * sin[i]);
    }
  }
}

template <typename T>
void rotary(const int64_t* positions, int64_t tokens, const float* cache, int64_t cache_row,
            int rotary_dim, bool neox, Heads q, Heads k, int num_threads) {
  const int half = rotary_dim / 2;
  const int64_t work = tokens * (q.count + k.count) * rotary_dim;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (work >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = cache + positions[t] * cache_row;
    const float* sin = cos + half;
    for (const Heads* x : {&q, &k}) {
      T* row = static_cast<T*>(x->data) + t * x->tok;
      for (int h = 0; h < x->count; ++h) rotate_head(row + h * x->head, cos, sin, half, neox);
    }
  }
}

template <typename T>
void silu_and_mul(const T* x, int64_t x_row, T* out, int64_t out_row, int64_t rows, int64_t d,
                  int num_threads) {
  const int64_t chunks = (d + kGateChunk - 1) / kGateChunk;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * d >= kParallelElements)
  for (int64_t item = 0; item < rows * chunks; ++item) {
    const int64_t r = item / chunks, begin = (item % chunks) * kGateChunk;
    const int64_t end = std::min(d, begin + kGateChunk);
    const T* gate = x + r * x_row;
    const T* up = gate + d;
    T* y = out + r * out_row;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float a = load(gate, i);
      store(y, i, round_to<T>(a / (1.f + exp_f32(-a))) * load(up, i));
    }
  }
}

// The GELU forms of torch's CPU kernel, in its order: x * 0.5 * (1 + erf(x / sqrt(2))),
// or 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))).
constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kTanhBeta = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhKappa = 0.044715f;
enum Gelu : int { kGeluErf = 0, kGeluTanh = 1 };

template <typename T>
void gelu_and_mul(const T* x, int64_t x_row, T* out, int64_t out_row, int64_t rows, int64_t d,
                  bool tanh_form, int num_threads) {
  const int64_t chunks = (d + kGateChunk - 1) / kGateChunk;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * d >= kParallelElements)
  for (int64_t item = 0; item < rows * chunks; ++item) {
    const int64_t r = item / chunks, begin = (item % chunks) * kGateChunk;
    const int64_t end = std::min(d, begin + kGateChunk);
    const T* gate = x + r * x_row;
    const T* up = gate + d;
    T* y = out + r * out_row;
    if (tanh_form) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        const float a = load(gate, i);
        const float inner = kTanhBeta * (a + kTanhKappa * (a * a * a));
        store(y, i, round_to<T>(0.5f * a * (1.f + tanh_f32(inner))) * load(up, i));
      }
    } else {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        const float a = load(gate, i);
        store(y, i, round_to<T>(a * 0.5f * (1.f + erf_f32(a * kSqrtHalf))) * load(up, i));
      }
    }
  }
}

}  // namespace

extern "C" {

// Each returns 0, 1 for an unknown dtype code, or 2 for a position outside the cache
// (rotary) or an unknown GELU form (gelu_and_mul), in which case nothing was written.

// In place: x [rows, n] becomes RMSNorm(x + residual) * weight; residual (when not null)
// becomes x + residual.
int engine_rms_norm(int dtype, void* x, int64_t x_row, void* residual, int64_t r_row,
                    const void* weight, int64_t rows, int64_t n, float eps, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm(static_cast<T*>(x), x_row, static_cast<T*>(residual), r_row,
             static_cast<const T*>(weight), rows, n, eps, num_threads);
  });
}

// In place: the first rotary_dim elements of every head of query [tokens, q_heads, D] and
// key [tokens, k_heads, D] rotate by cache[positions[t]] (cosines, then sines; float32).
int engine_rotary_embedding(int dtype, const int64_t* positions, int64_t tokens,
                            const float* cache, int64_t cache_row, int64_t cache_rows,
                            int rotary_dim, int neox, void* query, int64_t q_tok,
                            int64_t q_head, int q_heads, void* key, int64_t k_tok,
                            int64_t k_head, int k_heads, int num_threads) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= cache_rows) return 2;
  }
  const Heads q{query, q_tok, q_head, q_heads}, k{key, k_tok, k_head, k_heads};
  return with_dtype(dtype, [&](auto tag) {
    rotary<decltype(tag)>(positions, tokens, cache, cache_row, rotary_dim, neox != 0, q, k,
                          num_threads);
  });
}

// out [rows, d] = silu(x[:, :d]) * x[:, d:], x [rows, 2d].
int engine_silu_and_mul(int dtype, const void* x, int64_t x_row, void* out, int64_t out_row,
                        int64_t rows, int64_t d, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul(static_cast<const T*>(x), x_row, static_cast<T*>(out), out_row, rows, d,
                 num_threads);
  });
}

// out [rows, d] = gelu(x[:, :d]) * x[:, d:], x [rows, 2d]; approximate 0: the erf form
// (F.gelu's "none"), 1: the tanh approximation ("tanh").
int engine_gelu_and_mul(int dtype, const void* x, int64_t x_row, void* out, int64_t out_row,
                        int64_t rows, int64_t d, int approximate, int num_threads) {
  if (approximate != kGeluErf && approximate != kGeluTanh) return 2;
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gelu_and_mul(static_cast<const T*>(x), x_row, static_cast<T*>(out), out_row, rows, d,
                 approximate == kGeluTanh, num_threads);
  });
}

}  // extern "C"

// The step graph's entries (graph_call.h): the arguments as library.py passes them.
ENGINE_GRAPH_ENTRY(rms_norm, 10) {
  return engine_rms_norm(x.i32(0), x.p(1), x.a[2], x.p(3), x.a[4], x.p(5), x.a[6], x.a[7],
                         x.f(8), x.threads(9));
}

ENGINE_GRAPH_ENTRY(rotary_embedding, 17) {
  return engine_rotary_embedding(x.i32(0), x.ptr<const int64_t>(1), x.a[2],
                                 x.ptr<const float>(3), x.a[4], x.a[5], x.i32(6), x.i32(7),
                                 x.p(8), x.a[9], x.a[10], x.i32(11), x.p(12), x.a[13],
                                 x.a[14], x.i32(15), x.threads(16));
}

ENGINE_GRAPH_ENTRY(silu_and_mul, 8) {
  return engine_silu_and_mul(x.i32(0), x.p(1), x.a[2], x.p(3), x.a[4], x.a[5], x.a[6],
                             x.threads(7));
}

ENGINE_GRAPH_ENTRY(gelu_and_mul, 9) {
  return engine_gelu_and_mul(x.i32(0), x.p(1), x.a[2], x.p(3), x.a[4], x.a[5], x.a[6],
                             x.i32(7), x.threads(8));
}
