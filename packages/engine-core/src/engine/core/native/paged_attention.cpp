// Paged attention and KV-cache writes for the CPU, read straight from the block table.
//
// Built on first use by engine.core.native.library (the system C++ compiler,
// -O3 -march=native -fopenmp) and called through ctypes; the OpenMP runtime is the one
// torch already loaded (same soname), so the kernel uses torch's threads.
//
// Layouts (strides in elements, so any view with a contiguous last axis works):
//   query  [tokens, heads, head_size]          output the same
//   cache  [blocks, kv_heads, block_size, head_size], keys and values in two tensors
//   block_table [requests, max_blocks] int32; query row t belongs to request tok_req[t] and
//   sits at position tok_pos[t]: it sees keys 0..tok_pos[t] (the last sliding_window of
//   them when sliding_window > 0) and fills output row t.
// Scores, softmax and the weighted sum are float32 whatever the cache's dtype (bfloat16
// scores on avx512_bf16: exact pair products of the bfloat16 query and keys, float32 sums).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "numerics.h"

namespace {

struct Shape {
  int64_t q_tok, q_head, out_tok, out_head;
  int64_t c_block, c_head, c_tok;
  int64_t bt_stride;
  int heads, kv_heads, head_size, block_size, sliding_window;
  float scale;
};

// The first key a query at `pos` sees: the start of its sliding window, or 0.
inline int first_key(int pos, const Shape& s) {
  return s.sliding_window > 0 ? std::max(0, pos - s.sliding_window + 1) : 0;
}

// Head kvh's rows of the request's block b (block_size rows of head_size, contiguous).
template <typename T>
inline const T* head_rows(const T* cache, const int32_t* blocks, int b, int kvh,
                          const Shape& s) {
  return cache + blocks[b] * s.c_block + kvh * s.c_head;
}

// In place: each of `rows` rows of n scores becomes its softmax.
inline void softmax_rows(float* scores, int rows, int n) {
  for (int g = 0; g < rows; ++g) {
    float* sg = scores + g * n;
    float top = sg[0];
    for (int j = 1; j < n; ++j) top = std::max(top, sg[j]);
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - top);
      sum += sg[j];
    }
    const float inv = 1.f / sum;
    for (int j = 0; j < n; ++j) sg[j] *= inv;
  }
}

template <typename T, int kD>
void attend_one(const T* q, const T* kc, const T* vc, const int32_t* blocks, int pos, int kvh,
                T* out, const Shape& s, std::vector<float>& scratch) {
  const int D = kD > 0 ? kD : s.head_size;
  const int G = s.heads / s.kv_heads;
  const int first = first_key(pos, s);
  const int n = pos + 1 - first;
  scratch.resize(static_cast<size_t>(G) * (2 * D + n) + D);
  float* qf = scratch.data();          // [G, D], pre-scaled
  float* acc = qf + G * D;             // [G, D]
  float* row = acc + G * D;            // [D], one key or value in float32
  float* scores = row + D;             // [G, n]
  for (int g = 0; g < G; ++g) {
    const T* qh = q + (kvh * G + g) * s.q_head;
    for (int d = 0; d < D; ++d) qf[g * D + d] = load(qh, d) * s.scale;
  }
  for (int j = first; j <= pos; ++j) {
    const T* k = head_rows(kc, blocks, j / s.block_size, kvh, s) + (j % s.block_size) * s.c_tok;
#pragma omp simd
    for (int d = 0; d < D; ++d) row[d] = load(k, d);
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
      const float* qg = qf + g * D;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) dot += qg[d] * row[d];
      scores[g * n + (j - first)] = dot;
    }
  }
  softmax_rows(scores, G, n);
  std::fill(acc, acc + G * D, 0.f);
  for (int j = first; j <= pos; ++j) {
    const T* v = head_rows(vc, blocks, j / s.block_size, kvh, s) + (j % s.block_size) * s.c_tok;
#pragma omp simd
    for (int d = 0; d < D; ++d) row[d] = load(v, d);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * n + (j - first)];
      float* ag = acc + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
  for (int g = 0; g < G; ++g) {
    T* oh = out + (kvh * G + g) * s.out_head;
    for (int d = 0; d < D; ++d) store(oh, d, acc[g * D + d]);
  }
}

#if defined(__AVX512F__)
// 16 lanes at a time, q and the accumulators in registers (G query heads per KV head and
// D = 16 * C elements per head known at compile time).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) store(p, i, tmp[i]);
}

// Lane-wise partial dot product of two D = 16 * C vectors (sum the lanes for the dot).
template <int C>
inline __m512 dot16(const __m512* x, const __m512* y) {
  __m512 a = _mm512_mul_ps(x[0], y[0]);
  for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(x[c], y[c], a);
  return a;
}

inline __m256 halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// The lane sums of four vectors, as one [sum(a0), sum(a1), sum(a2), sum(a3)].
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(a0), halves(a1)),
                                  _mm256_hadd_ps(halves(a2), halves(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// A head's query and a key row in registers for the scores, and their lane-wise partial
// dot product (sum the 16 lanes for the dot). In float32 the query is pre-scaled; for
// bfloat16 on avx512_bf16 both stay bfloat16 pairs, multiplied exactly by vdpbf16ps with
// float32 sums (half the instructions of converting the keys), and the sum is scaled.
template <typename T, int C>
struct ScoreLanes {
  using Reg = __m512;
  static constexpr int kRegs = C;
  static constexpr bool kScaleAfter = false;
  static Reg query(const T* q, int c, __m512 scale) {
    return _mm512_mul_ps(load16(q + 16 * c), scale);
  }
  static Reg key(const T* k, int c) { return load16(k + 16 * c); }
  static __m512 dot(const Reg* q, const Reg* k) { return dot16<C>(q, k); }
};

#if defined(__AVX512BF16__)
template <int C>
struct ScoreLanes<uint16_t, C> {
  static_assert(C % 2 == 0, "a bfloat16 register holds two float32 registers' elements");
  using Reg = __m512bh;
  static constexpr int kRegs = C / 2;
  static constexpr bool kScaleAfter = true;
  static Reg query(const uint16_t* q, int c, __m512) { return key(q, c); }
  static Reg key(const uint16_t* k, int c) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + 32 * c));
  }
  static __m512 dot(const Reg* q, const Reg* k) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], k[0]);
    for (int c = 1; c < kRegs; ++c) a = _mm512_dpbf16_ps(a, q[c], k[c]);
    return a;
  }
};
#endif

// Ask for a block's rows of this head before they are needed: a head's rows of one block
// are contiguous (block_size * head_size elements) but blocks are scattered, so the
// hardware prefetcher, which follows one stream within a page, starts each block cold.
// `hint`: _MM_HINT_T0 (into L1) or _MM_HINT_T1 (into L2).
template <int hint, typename T>
inline void prefetch_block(const T* rows, const Shape& s) {
  const char* p = reinterpret_cast<const char*>(rows);
  const int64_t bytes = static_cast<int64_t>(s.block_size) * s.c_tok * sizeof(T);
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(p + off, static_cast<_mm_hint>(hint));
}

// Key blocks asked for ahead of the one being read, into L2, for a request's only query row
// of the step (a decode), whose keys and values nothing else has read: one block ahead left
// the loop waiting on memory (decode steps of 64 requests at ~10 GB/s); with four, and each
// value block asked for while its keys are read, the same steps run 1.3x faster
// (benchmarks/attention_cpu.py). Rows of a prefill chunk share their request's blocks, which
// the chunk's first rows bring in: for them the extra prefetch instructions only cost, so
// they ask for the next key block only, into L1.
constexpr int kBlocksAhead = 4;

template <typename T, int C, int G>
void attend_one_avx512(const T* q, const T* kc, const T* vc, const int32_t* blocks, int pos,
                       int kvh, T* out, const Shape& s, bool alone,
                       std::vector<float>& scratch) {
  const int first = first_key(pos, s);
  const int n = pos + 1 - first;
  scratch.resize(static_cast<size_t>(G) * n);
  float* scores = scratch.data();  // [G, n]
  using L = ScoreLanes<T, C>;
  typename L::Reg qv[G][L::kRegs];
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < L::kRegs; ++c)
      qv[g][c] = L::query(q + (kvh * G + g) * s.q_head, c, scale);
  const __m128 scale4 = _mm_set1_ps(s.scale);  // the scores' scale, for kScaleAfter
  const int last_block = pos / s.block_size;
  const int first_block = first / s.block_size;
  const int ahead = alone ? kBlocksAhead : 1;
  if (alone) {
    for (int b = first_block; b <= std::min(last_block, first_block + ahead - 1); ++b)
      prefetch_block<_MM_HINT_T1>(head_rows(kc, blocks, b, kvh, s), s);
  }
  for (int j = first; j <= pos;) {
    const int block = j / s.block_size;
    const T* rows = head_rows(kc, blocks, block, kvh, s);
    const int end = std::min(pos + 1, (block + 1) * s.block_size);
    if (block + ahead <= last_block) {
      if (alone) {
        prefetch_block<_MM_HINT_T1>(head_rows(kc, blocks, block + ahead, kvh, s), s);
      } else {
        prefetch_block<_MM_HINT_T0>(head_rows(kc, blocks, block + ahead, kvh, s), s);
      }
    }
    if (alone) prefetch_block<_MM_HINT_T1>(head_rows(vc, blocks, block, kvh, s), s);
    for (; j + 4 <= end; j += 4) {  // four keys: their 4 x G dot products reduced together
      __m512 part[G][4];
      for (int u = 0; u < 4; ++u) {
        const T* k = rows + ((j + u) % s.block_size) * s.c_tok;
        typename L::Reg kv[L::kRegs];
        for (int c = 0; c < L::kRegs; ++c) kv[c] = L::key(k, c);
        for (int g = 0; g < G; ++g) part[g][u] = L::dot(qv[g], kv);
      }
      for (int g = 0; g < G; ++g) {
        __m128 four = reduce4(part[g][0], part[g][1], part[g][2], part[g][3]);
        if constexpr (L::kScaleAfter) four = _mm_mul_ps(four, scale4);
        _mm_storeu_ps(scores + g * n + (j - first), four);
      }
    }
    for (; j < end; ++j) {
      const T* k = rows + (j % s.block_size) * s.c_tok;
      typename L::Reg kv[L::kRegs];
      for (int c = 0; c < L::kRegs; ++c) kv[c] = L::key(k, c);
      for (int g = 0; g < G; ++g) {
        const float dot = _mm512_reduce_add_ps(L::dot(qv[g], kv));
        scores[g * n + (j - first)] = L::kScaleAfter ? dot * s.scale : dot;
      }
    }
  }
  prefetch_block<_MM_HINT_T0>(head_rows(vc, blocks, first_block, kvh, s), s);
  softmax_rows(scores, G, n);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int j = first; j <= pos;) {
    const int block = j / s.block_size;
    const T* rows = head_rows(vc, blocks, block, kvh, s);
    const int end = std::min(pos + 1, (block + 1) * s.block_size);
    if (block < last_block)
      prefetch_block<_MM_HINT_T0>(head_rows(vc, blocks, block + 1, kvh, s), s);
    for (; j < end; ++j) {
      const T* v = rows + (j % s.block_size) * s.c_tok;
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(v + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * n + (j - first)]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(out + (kvh * G + g) * s.out_head + 16 * c, acc[g][c]);
}

// The AVX-512 instance for (D, G), or nullptr when there is none.
template <typename T>
using AttendFn = void (*)(const T*, const T*, const T*, const int32_t*, int, int, T*,
                          const Shape&, bool, std::vector<float>&);

template <typename T, int C>
AttendFn<T> avx512_for_groups(int groups) {
  switch (groups) {
    case 1: return attend_one_avx512<T, C, 1>;
    case 2: return attend_one_avx512<T, C, 2>;
    case 3: return attend_one_avx512<T, C, 3>;
    case 4: return attend_one_avx512<T, C, 4>;
    case 6: return attend_one_avx512<T, C, 6>;
    case 8: return attend_one_avx512<T, C, 8>;
    default: return nullptr;
  }
}

template <typename T>
AttendFn<T> avx512_for(int head_size, int groups) {
  switch (head_size) {
    case 64: return avx512_for_groups<T, 4>(groups);
    case 128: return avx512_for_groups<T, 8>(groups);
    default: return nullptr;
  }
}
#endif

template <typename T, int kD>
void attend_all(const T* q, const T* kc, const T* vc, const int32_t* block_table,
                const int32_t* tok_req, const int32_t* tok_pos, int64_t num_tokens, T* out,
                const Shape& s, int num_threads) {
  const int64_t items = num_tokens * s.kv_heads;
#if defined(__AVX512F__)
  const AttendFn<T> fast = avx512_for<T>(s.head_size, s.heads / s.kv_heads);
#endif
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / s.kv_heads;
      const int kvh = static_cast<int>(item % s.kv_heads);
#if defined(__AVX512F__)
      if (fast != nullptr) {
        const bool alone = (t == 0 || tok_req[t - 1] != tok_req[t]) &&
                           (t + 1 == num_tokens || tok_req[t + 1] != tok_req[t]);
        fast(q + t * s.q_tok, kc, vc, block_table + tok_req[t] * s.bt_stride, tok_pos[t], kvh,
             out + t * s.out_tok, s, alone, scratch);
        continue;
      }
#endif
      attend_one<T, kD>(q + t * s.q_tok, kc, vc, block_table + tok_req[t] * s.bt_stride,
                        tok_pos[t], kvh, out + t * s.out_tok, s, scratch);
    }
  }
}

template <typename T>
void dispatch(const void* q, const void* kc, const void* vc, const int32_t* bt,
              const int32_t* tok_req, const int32_t* tok_pos, int64_t num_tokens, void* out,
              const Shape& s, int num_threads) {
  auto run = [&](auto d) {
    attend_all<T, decltype(d)::value>(static_cast<const T*>(q), static_cast<const T*>(kc),
                                      static_cast<const T*>(vc), bt, tok_req, tok_pos,
                                      num_tokens, static_cast<T*>(out), s, num_threads);
  };
  switch (s.head_size) {
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

extern "C" {

// Returns 0, or 1 for an unknown dtype code.
int engine_paged_attention(int dtype, const void* q, int64_t q_tok, int64_t q_head,
                           const void* k_cache, const void* v_cache, int64_t c_block,
                           int64_t c_head, int64_t c_tok, const int32_t* block_table,
                           int64_t bt_stride, const int32_t* tok_req, const int32_t* tok_pos,
                           int64_t num_tokens, void* out, int64_t out_tok, int64_t out_head,
                           int heads, int kv_heads, int head_size, int block_size,
                           int sliding_window, float scale, int num_threads) {
  const Shape s{q_tok, q_head, out_tok, out_head, c_block, c_head, c_tok, bt_stride,
                heads, kv_heads, head_size, block_size, sliding_window, scale};
  return with_dtype(dtype, [&](auto tag) {
    dispatch<decltype(tag)>(q, k_cache, v_cache, block_table, tok_req, tok_pos, num_tokens,
                            out, s, num_threads);
  });
}

// Copies each token's keys and values ([tokens, kv_heads, head_size] views) into its cache
// slot (block = slot / block_size, offset = slot % block_size). elem_size: bytes per value.
void engine_write_kv(int elem_size, const void* key, int64_t k_tok, int64_t k_head,
                     const void* value, int64_t v_tok, int64_t v_head, void* k_cache,
                     void* v_cache, int64_t c_block, int64_t c_head, int64_t c_tok,
                     const int64_t* slots, int64_t num_tokens, int kv_heads, int head_size,
                     int block_size) {
  const size_t row = static_cast<size_t>(head_size) * elem_size;
  auto* kc = static_cast<char*>(k_cache);
  auto* vc = static_cast<char*>(v_cache);
  const auto* kp = static_cast<const char*>(key);
  const auto* vp = static_cast<const char*>(value);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
    for (int h = 0; h < kv_heads; ++h) {
      const int64_t dst = (blk * c_block + h * c_head + off * c_tok) * elem_size;
      std::memcpy(kc + dst, kp + (t * k_tok + h * k_head) * elem_size, row);
      std::memcpy(vc + dst, vp + (t * v_tok + h * v_head) * elem_size, row);
    }
  }
}

}  // extern "C"
