// Paged attention and KV-cache writes for the CPU, read straight from the block table.
//
// Built on first use by engine.kernels.cpu.native.library (the system C++ compiler,
// -O3 -march=native -fopenmp) and called through ctypes; the OpenMP runtime is the one
// torch already loaded (same soname), so the kernel uses torch's threads.
//
// Layouts (strides in elements, so any view with a contiguous last axis works):
//   query  [tokens, heads, head_size]          output the same
//   cache  [blocks, kv_heads, block_size, head_size], keys and values in two tensors
//   block_table [requests, max_blocks] int32; query row t belongs to request tok_req[t] and
//   sits at position tok_pos[t]: it sees keys 0..tok_pos[t] (the last sliding_window of
//   them when sliding_window > 0) and fills output row t.
// Options: soft_cap > 0 caps each scaled score s as soft_cap * tanh(s / soft_cap) before the
// softmax (Gemma 2); sinks (float32 [heads], or null) adds exp(sinks[h]) to head h's softmax
// denominator, a logit of a key that has no value (GPT-OSS's attention sinks).
// Scores, softmax and the weighted sum are float32 whatever the cache's dtype (bfloat16
// scores on avx512_bf16: exact pair products of the bfloat16 query and keys, float32 sums).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "engine_graph_call.h"
#include "kernels.h"
#include "numerics.h"
#include "simd.h"

namespace {

struct Shape {
  int64_t q_tok, q_head, out_tok, out_head;
  int64_t c_block, c_head, c_tok;
  int64_t bt_stride;
  int heads, kv_heads, head_size, block_size, sliding_window;
  float scale;
  float soft_cap;       // > 0: scores become soft_cap * tanh(score / soft_cap)
  const float* sinks;   // [heads] or null: one more logit per head in the softmax
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

// In place: each of `rows` rows of n scores becomes its softmax; the rows are the query
// heads of KV head kvh (s.soft_cap and s.sinks applied, see the top of the file).
inline void softmax_rows(float* scores, int rows, int n, int kvh, const Shape& s) {
  for (int g = 0; g < rows; ++g) {
    float* sg = scores + g * n;
    if (s.soft_cap > 0.f) {
      const float cap = s.soft_cap, inv_cap = 1.f / s.soft_cap;
      for (int j = 0; j < n; ++j) sg[j] = cap * std::tanh(sg[j] * inv_cap);
    }
    float top = sg[0];
    for (int j = 1; j < n; ++j) top = std::max(top, sg[j]);
    const float sink = s.sinks != nullptr ? s.sinks[kvh * rows + g] : 0.f;
    if (s.sinks != nullptr) top = std::max(top, sink);
    float sum = s.sinks != nullptr ? std::exp(sink - top) : 0.f;
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
  softmax_rows(scores, G, n, kvh, s);
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

#if defined(ENGINE_F32_SIMD)
// kF32Lanes (16 with AVX-512, 8 with AVX2) at a time, q and the accumulators in registers
// (G query heads per KV head and D = kF32Lanes * C elements per head known at compile time).
inline F32Vec load_lanes(const float* p) { return f32_load(p); }
inline F32Vec load_lanes(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#else
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#endif
}
inline void store_lanes(float* p, F32Vec v) { f32_store_first(p, v, kF32Lanes); }
inline void store_lanes(uint16_t* p, F32Vec v) {
  alignas(64) float tmp[kF32Lanes];
  f32_store_first(tmp, v, kF32Lanes);
  for (int i = 0; i < kF32Lanes; ++i) store(p, i, tmp[i]);
}

// Lane-wise partial dot product of two D = kF32Lanes * C vectors (sum the lanes for the dot).
template <int C>
inline F32Vec dot_lanes(const F32Vec* x, const F32Vec* y) {
  F32Vec a = f32_mul(x[0], y[0]);
  for (int c = 1; c < C; ++c) a = f32_fmadd(x[c], y[c], a);
  return a;
}

// The lane sums of four vectors, as one [sum(a0), sum(a1), sum(a2), sum(a3)].
#if defined(__AVX512F__)
inline __m256 halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(a0), halves(a1)),
                                  _mm256_hadd_ps(halves(a2), halves(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
// Two vectors' lane sums folded once: the 256-bit halves of a and b added, a's in the low
// half of the result and b's in the high (fold2), then the 128-bit quarters of two such
// (fold4: a's, then b's sums of each half).
inline __m512 fold2(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 fold4(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
// The last two rounds of the 16-way lane sums of z[0..3] (each from fold4), lane i of the
// result the sum for key i when the keys went in as kFoldOrder says.
inline __m512 fold16(const __m512* z) {
  const __m512 w0 = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[2]), _mm512_unpackhi_ps(z[0], z[2]));
  const __m512 w1 = _mm512_add_ps(_mm512_unpacklo_ps(z[1], z[3]), _mm512_unpackhi_ps(z[1], z[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x44), _mm512_shuffle_ps(w0, w1, 0xEE));
}
// Which of 16 keys goes in at each place: fold4(fold2(k[8 a], k[8 a + 8]), fold2(k[8 a + 4],
// k[8 a + 12])) for a = 0..3 over the places a..a + 12 (written as the place's key).
constexpr int kFoldOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
#else
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// A head's query and a key row in registers for the scores, and their lane-wise partial
// dot product (sum the 16 lanes for the dot). In float32 the query is pre-scaled; for
// bfloat16 on avx512_bf16 both stay bfloat16 pairs, multiplied exactly by vdpbf16ps with
// float32 sums (half the instructions of converting the keys), and the sum is scaled.
template <typename T, int C>
struct ScoreLanes {
  using Reg = F32Vec;
  static constexpr int kRegs = C;
  static constexpr bool kScaleAfter = false;
  static Reg query(const T* q, int c, F32Vec scale) {
    return f32_mul(load_lanes(q + kF32Lanes * c), scale);
  }
  static Reg key(const T* k, int c) { return load_lanes(k + kF32Lanes * c); }
  static F32Vec dot(const Reg* q, const Reg* k) { return dot_lanes<C>(q, k); }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <int C>
struct ScoreLanes<uint16_t, C> {
  static_assert(C % 2 == 0, "a bfloat16 register holds two float32 registers' elements");
  using Reg = __m512bh;
  static constexpr int kRegs = C / 2;
  static constexpr bool kScaleAfter = true;
  static Reg query(const uint16_t* q, int c, F32Vec) { return key(q, c); }
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
// `hint`: _MM_HINT_T0 (into L1) or _MM_HINT_T1 (into L2). `parts` > 1: only the first
// 1/parts of the rows (see kBlocksAhead).
template <int hint, typename T>
inline void prefetch_block(const T* rows, const Shape& s, int parts = 1) {
  const char* p = reinterpret_cast<const char*>(rows);
  const int64_t bytes = static_cast<int64_t>(s.block_size) * s.c_tok * sizeof(T) / parts;
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
// Of each such block only the first half (kPrefetchParts) is asked for: a software
// prefetch holds one of the core's few L1 miss buffers until its line arrives, so asking for
// every line of the blocks kept the core at ~10 GB/s a thread; the first lines start the L2
// streamer, which fetches the rest of the run without them (the kernel on the 64-request
// decode steps 5-8% faster than with whole blocks, 2-core Sapphire Rapids, the KV cache in
// L3 or in memory).
constexpr int kBlocksAhead = 4;
constexpr int kPrefetchParts = 2;

// Value registers the weighted sum takes at a time for C registers a head and G query
// heads: the most (a divisor of C) whose G x V accumulators, V values and a broadcast fit
// in the vector registers (32 with AVX-512, 16 with AVX2).
template <int C, int G>
constexpr int VRegs() {
  constexpr int kVectorRegs = kF32Lanes == 16 ? 32 : 16;
  for (int v = C; v > 1; --v)
    if (C % v == 0 && G * v + v + 1 <= kVectorRegs) return v;
  return 1;
}

template <typename T, int C, int G>
void attend_one_simd(const T* q, const T* kc, const T* vc, const int32_t* blocks, int pos,
                       int kvh, T* out, const Shape& s, bool alone,
                       std::vector<float>& scratch) {
  const int first = first_key(pos, s);
  const int n = pos + 1 - first;
  scratch.resize(static_cast<size_t>(G) * n);
  float* scores = scratch.data();  // [G, n]
  using L = ScoreLanes<T, C>;
  typename L::Reg qv[G][L::kRegs];
  const F32Vec scale = f32_broadcast(&s.scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < L::kRegs; ++c)
      qv[g][c] = L::query(q + (kvh * G + g) * s.q_head, c, scale);
  const __m128 scale4 = _mm_set1_ps(s.scale);  // the scores' scale, for kScaleAfter
  const int last_block = pos / s.block_size;
  const int first_block = first / s.block_size;
  const int ahead = alone ? kBlocksAhead : 1;
  if (alone) {
    for (int b = first_block; b <= std::min(last_block, first_block + ahead - 1); ++b)
      prefetch_block<_MM_HINT_T1>(head_rows(kc, blocks, b, kvh, s), s, kPrefetchParts);
  }
  for (int j = first; j <= pos;) {
    const int block = j / s.block_size;
    const T* rows = head_rows(kc, blocks, block, kvh, s);
    const int end = std::min(pos + 1, (block + 1) * s.block_size);
    if (block + ahead <= last_block) {
      if (alone) {
        prefetch_block<_MM_HINT_T1>(head_rows(kc, blocks, block + ahead, kvh, s), s,
                                    kPrefetchParts);
      } else {
        prefetch_block<_MM_HINT_T0>(head_rows(kc, blocks, block + ahead, kvh, s), s);
      }
    }
    if (alone)
      prefetch_block<_MM_HINT_T1>(head_rows(vc, blocks, block, kvh, s), s, kPrefetchParts);
#if defined(__AVX512F__)
    // Sixteen keys at a time where a block holds whole groups of 16 rows: each head's 16
    // dot products summed together by halving rounds, the rounds done as the keys come
    // (keys 8 apart, then their pairs 4 apart: kFoldOrder), 45 instructions for 16 sums
    // where reduce4 takes 19 for 4.
    if (s.block_size % 16 == 0 && (j - block * s.block_size) % 16 == 0) {
      for (; j + 16 <= end; j += 16) {
        const T* rows16 = rows + (j - block * s.block_size) * s.c_tok;
        __m512 z[G][4];
#pragma GCC unroll 4
        for (int a = 0; a < 4; ++a) {
          __m512 y[G][2];
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const T* k0 = rows16 + kFoldOrder[a + 4 * h] * s.c_tok;
            const T* k1 = rows16 + kFoldOrder[a + 4 * h + 8] * s.c_tok;
            typename L::Reg kv0[L::kRegs], kv1[L::kRegs];
            for (int c = 0; c < L::kRegs; ++c) kv0[c] = L::key(k0, c);
            for (int c = 0; c < L::kRegs; ++c) kv1[c] = L::key(k1, c);
            for (int g = 0; g < G; ++g) y[g][h] = fold2(L::dot(qv[g], kv0), L::dot(qv[g], kv1));
          }
          for (int g = 0; g < G; ++g) z[g][a] = fold4(y[g][0], y[g][1]);
        }
        for (int g = 0; g < G; ++g) {
          __m512 sums = fold16(z[g]);
          if constexpr (L::kScaleAfter) sums = _mm512_mul_ps(sums, scale);
          _mm512_storeu_ps(scores + g * n + (j - first), sums);
        }
      }
    }
#endif
    for (; j + 4 <= end; j += 4) {  // four keys: their 4 x G dot products reduced together
      F32Vec part[G][4];
      for (int u = 0; u < 4; ++u) {
        const T* k = rows + (j + u - block * s.block_size) * s.c_tok;
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
      const T* k = rows + (j - block * s.block_size) * s.c_tok;
      typename L::Reg kv[L::kRegs];
      for (int c = 0; c < L::kRegs; ++c) kv[c] = L::key(k, c);
      for (int g = 0; g < G; ++g) {
        const float dot = f32_sum(L::dot(qv[g], kv));
        scores[g * n + (j - first)] = L::kScaleAfter ? dot * s.scale : dot;
      }
    }
  }
  prefetch_block<_MM_HINT_T0>(head_rows(vc, blocks, first_block, kvh, s), s);
  softmax_rows(scores, G, n, kvh, s);
  // The weighted sum of the values: G x C accumulators, V registers of each value row at a
  // time (VRegs), all of them where they fit in the registers with the values and a
  // broadcast (AVX-512); else (AVX2's 16 registers: 3 x 8 accumulators for 12 query heads
  // over 4 KV heads of 64) a block's keys for V of the C registers at a time, the
  // accumulators kept in L1 between blocks (the same sums in the same order).
  constexpr int V = VRegs<C, G>();
  // bfloat16 values on AVX-512 are widened a register pair at a time: the 32 values of a
  // 64-byte load, their even elements (shifted up) into one register and their odd ones
  // (masked) into the next, two instructions where a per-register conversion takes four;
  // the sums go back into order at the end (the same sums in the same order per element).
#if defined(__AVX512F__)
  constexpr bool kPairs = std::is_same_v<T, uint16_t> && V % 2 == 0;
#endif
  F32Vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = f32_zero();
  for (int j = first; j <= pos;) {
    const int block = j / s.block_size;
    const T* rows = head_rows(vc, blocks, block, kvh, s);
    const int end = std::min(pos + 1, (block + 1) * s.block_size);
    if (block < last_block)
      prefetch_block<_MM_HINT_T0>(head_rows(vc, blocks, block + 1, kvh, s), s);
    for (int c0 = 0; c0 < C; c0 += V) {
      F32Vec a[G][V];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < V; ++c) a[g][c] = acc[g][c0 + c];
      for (int i = j; i < end; ++i) {
        const T* v = rows + (i - block * s.block_size) * s.c_tok + kF32Lanes * c0;
        F32Vec vv[V];
#if defined(__AVX512F__)
        if constexpr (kPairs) {
          for (int c = 0; c < V; c += 2) {
            const __m512i raw = _mm512_loadu_si512(v + kF32Lanes * c);
            vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
            vv[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(-65536)));
          }
        } else
#endif
        for (int c = 0; c < V; ++c) vv[c] = load_lanes(v + kF32Lanes * c);
        for (int g = 0; g < G; ++g) {
          const F32Vec p = f32_broadcast(&scores[g * n + (i - first)]);
          for (int c = 0; c < V; ++c) a[g][c] = f32_fmadd(p, vv[c], a[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < V; ++c) acc[g][c0 + c] = a[g][c];
    }
    j = end;
  }
#if defined(__AVX512F__)
  if constexpr (kPairs) {
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; c += 2) {
        const __m512 even = acc[g][c], odd = acc[g][c + 1];
        acc[g][c] = _mm512_permutex2var_ps(even, low, odd);
        acc[g][c + 1] = _mm512_permutex2var_ps(even, high, odd);
      }
  }
#endif
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      store_lanes(out + (kvh * G + g) * s.out_head + kF32Lanes * c, acc[g][c]);
}

// The vector instance for (D, G), or nullptr when there is none.
template <typename T>
using AttendFn = void (*)(const T*, const T*, const T*, const int32_t*, int, int, T*,
                          const Shape&, bool, std::vector<float>&);

template <typename T, int C>
AttendFn<T> simd_for_groups(int groups) {
  switch (groups) {
    case 1: return attend_one_simd<T, C, 1>;
    case 2: return attend_one_simd<T, C, 2>;
    case 3: return attend_one_simd<T, C, 3>;
    case 4: return attend_one_simd<T, C, 4>;
    case 6: return attend_one_simd<T, C, 6>;
    case 8: return attend_one_simd<T, C, 8>;
    default: return nullptr;
  }
}

template <typename T>
AttendFn<T> simd_for(int head_size, int groups) {
  switch (head_size) {
    case 64: return simd_for_groups<T, 64 / kF32Lanes>(groups);
    case 128: return simd_for_groups<T, 128 / kF32Lanes>(groups);
    default: return nullptr;
  }
}
#endif

template <typename T, int kD>
void attend_all(const T* q, const T* kc, const T* vc, const int32_t* block_table,
                const int32_t* tok_req, const int32_t* tok_pos, int64_t num_tokens, T* out,
                const Shape& s, int num_threads) {
  const int64_t items = num_tokens * s.kv_heads;
#if defined(ENGINE_F32_SIMD)
  const AttendFn<T> fast = simd_for<T>(s.head_size, s.heads / s.kv_heads);
#endif
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / s.kv_heads;
      const int kvh = static_cast<int>(item % s.kv_heads);
#if defined(ENGINE_F32_SIMD)
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

// Returns 0, or 1 for an unknown dtype code. heads_kv: heads << 32 | kv_heads; dims:
// head_size << 32 | block_size (pairs in one argument: a step-graph entry takes at most 24).
int engine_paged_attention(int dtype, const void* q, int64_t q_tok, int64_t q_head,
                           const void* k_cache, const void* v_cache, int64_t c_block,
                           int64_t c_head, int64_t c_tok, const int32_t* block_table,
                           int64_t bt_stride, const int32_t* tok_req, const int32_t* tok_pos,
                           int64_t num_tokens, void* out, int64_t out_tok, int64_t out_head,
                           int64_t heads_kv, int64_t dims, int sliding_window, float scale,
                           float soft_cap, const float* sinks, int num_threads) {
  const int heads = static_cast<int>(heads_kv >> 32);
  const int kv_heads = static_cast<int>(heads_kv & 0xffffffff);
  const int head_size = static_cast<int>(dims >> 32);
  const int block_size = static_cast<int>(dims & 0xffffffff);
  const Shape s{q_tok, q_head, out_tok, out_head, c_block, c_head, c_tok, bt_stride,
                heads, kv_heads, head_size, block_size, sliding_window, scale, soft_cap, sinks};
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

// The step graph's entries (graph_call.h): the arguments as library.py passes them.
ENGINE_GRAPH_ENTRY(write_kv, 17) {
  engine_write_kv(x.i32(0), x.p(1), x.a[2], x.a[3], x.p(4), x.a[5], x.a[6], x.p(7), x.p(8),
                  x.a[9], x.a[10], x.a[11], x.ptr<const int64_t>(12), x.a[13], x.i32(14),
                  x.i32(15), x.i32(16));
  return 0;
}

ENGINE_GRAPH_ENTRY(paged_attention, 24) {
  return engine_paged_attention(
      x.i32(0), x.p(1), x.a[2], x.a[3], x.p(4), x.p(5), x.a[6], x.a[7], x.a[8],
      x.ptr<const int32_t>(9), x.a[10], x.ptr<const int32_t>(11), x.ptr<const int32_t>(12),
      x.a[13], x.p(14), x.a[15], x.a[16], x.a[17], x.a[18], x.i32(19), x.f(20), x.f(21),
      x.ptr<const float>(22), x.threads(23));
}
