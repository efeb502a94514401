// The mixture-of-experts MLP in one call (the `fused_moe` custom op's CPU path,
// engine.kernels.cpu.moe): routing, tokens grouped by expert, each active expert's
// gate/up product, gated activation and down product over only its tokens, and the
// weighted sum into the output. No Python loop over experts and nothing read back to the
// host: the routing's sizes live in here, so the CPU step graph records the whole layer as
// one call.
//
// Routing, as engine.sdk.ops.FusedMoEOp.route: p = softmax(logits) in float32; each
// token keeps its top_k largest p, chosen as torch.topk chooses them on the CPU (the same
// std::partial_sort / std::nth_element + std::sort on (value, index) pairs with torch's
// comparator, so ties go the way they do in torch); with renormalize the kept weights are
// divided by their sum. The (token, slot) pairs are ordered by expert, stably (as the
// reference's argsort), and each expert's rows gathered into one block.
//
// Products: engine_matmul (matmul.cpp) on column chunks of each expert's weights, every
// chunk of every active expert one work item of one OpenMP team (each item's product runs
// on its thread): gate and up chunks side by side, then the activation on them; then the
// down product's chunks. The weights are read as the `cpu` linear kernel reads them:
// the dense rows for 1-3 tokens, the panels of engine_pack_matmul_weight otherwise (gate
// and up halves packed separately, so any intermediate size splits at panel boundaries).
// Each product rounds to the dtype as torch's does; with biases (GPT-OSS), each expert's
// bias row enters its product before that rounding (engine_matmul's bias, as the `cpu`
// linear kernel adds a dense layer's).
//
// Activations (FusedMoEOp.activate): SiLU-and-mul (engine_silu_and_mul), or GPT-OSS's
// clamped SwiGLU, g = min(gate, limit), u = clamp(up, -limit, limit),
// (u + 1) * (g * sigmoid(alpha * g)), each of its five operations rounded to the dtype as
// torch's bfloat16 ops round theirs (float32 math in between).
//
// The last pass sums each token's k rows in float32 in ascending expert order, each
// weighted in float32 (the reference's index_add_ order), rounded once: compiled without
// FMA contraction (library.py), so with the same expert outputs the sum is the
// reference's bit for bit.
//
// Threads: torch's count (num_threads), at most one per work item, as the products'
// kernels choose theirs; one team runs the gather, the two products' passes and the sums
// (one fork per layer). Chunks are whole panels (32 columns), sized so that the items are
// two per thread: enough to balance, as few as that allows (each rereads its rows).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "engine_graph_call.h"
#include "kernels.h"
#include "numerics.h"

namespace {

constexpr int64_t kPanel = 32;       // columns of a packed panel (PACKED_MATMUL_PANEL)
constexpr int64_t kItemsPerThread = 2;
constexpr int64_t kAlign = 64;
constexpr int kWidened = 2;          // float32 activations on bfloat16 panels

inline int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
inline int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }

// The workspace's parts for P = tokens * top_k pairs, in bytes from its start.
struct Layout {
  int64_t weights, experts, position, offsets, x, gate_up, act, down, total;
  Layout(int64_t pairs, int64_t E, int64_t H, int64_t I, int64_t elem) {
    weights = 0;                                               // float [P] (token-major)
    experts = weights + aligned(pairs * 4);                    // int32 [P]
    position = experts + aligned(pairs * 4);                   // int32 [P]: pair -> row
    offsets = position + aligned(pairs * 4);                   // int64 [E + 1]
    x = offsets + aligned((E + 1) * 8);                        // T [P, H], grouped rows
    gate_up = x + aligned(pairs * H * elem);                   // T [P, 2I]
    act = gate_up + aligned(pairs * 2 * I * elem);             // T [P, I]
    down = act + aligned(pairs * I * elem);                    // T [P, H]
    total = down + aligned(pairs * H * elem);
  }
};

inline bool is_nan(float v) {  // a bit test: the build may assume no NaNs elsewhere
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// torch.topk(p, k, largest=True, sorted=True) on the CPU (ATen's TopKImpl.h), one row.
void top_k(const float* p, int64_t E, int64_t k, std::vector<std::pair<float, int64_t>>& queue,
           float* values, int32_t* ids) {
  using Elem = std::pair<float, int64_t>;
  queue.resize(static_cast<size_t>(E));
  for (int64_t j = 0; j < E; ++j) queue[j] = {p[j], j};
  const auto larger = [](const Elem& x, const Elem& y) {
    return (is_nan(x.first) && !is_nan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= E) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
  for (int64_t j = 0; j < k; ++j) {
    values[j] = queue[j].first;
    ids[j] = static_cast<int32_t>(queue[j].second);
  }
}

// Softmax, top-k and renormalisation of each token's logits (float32 or bfloat16 rows).
template <typename L>
void route(const L* logits, int64_t l_row, int64_t tokens, int64_t E, int64_t k,
           bool renormalize, float* weights, int32_t* experts, int num_threads) {
  const int threads = static_cast<int>(std::min<int64_t>(tokens, num_threads));
#pragma omp parallel num_threads(threads) if (tokens * E >= 4096)
  {
    std::vector<float> p(static_cast<size_t>(E));
    std::vector<std::pair<float, int64_t>> queue;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const L* row = logits + t * l_row;
      float top = load(row, 0);
      for (int64_t j = 1; j < E; ++j) top = std::max(top, load(row, j));
      float sum = 0.f;
      for (int64_t j = 0; j < E; ++j) {
        p[j] = std::exp(load(row, j) - top);
        sum += p[j];
      }
      for (int64_t j = 0; j < E; ++j) p[j] = p[j] / sum;
      float* w = weights + t * k;
      top_k(p.data(), E, k, queue, w, experts + t * k);
      if (renormalize) {
        float kept = 0.f;
        for (int64_t j = 0; j < k; ++j) kept += w[j];
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / kept;
      }
    }
  }
}

// One product's weights: expert e's output columns [first, first + cols) of N, K inputs;
// its dense rows (e * dense_rows + dense_first + column) and/or its panels (N per expert,
// packed by engine_pack_matmul_weight); either may be null. bias (null: none): the
// activations' dtype, expert e's at e * dense_rows + dense_first + column.
struct Weights {
  const char* dense;
  int64_t dense_rows, dense_first;
  const char* panels;
  int64_t N, K;
  int64_t dense_elem, panel_elem;  // bytes per value
  const char* bias;
  int64_t bias_elem;
};

inline int product(int code, const void* x, int64_t x_row, int64_t rows, const Weights& w,
                   int64_t e, int64_t first, int64_t cols, void* out, int64_t out_row) {
  const char* dense =
      w.dense == nullptr
          ? nullptr
          : w.dense + (e * w.dense_rows + w.dense_first + first) * w.K * w.dense_elem;
  const char* panels =
      w.panels == nullptr
          ? nullptr
          : w.panels + (e * panels_of(w.N) * kPanel + first) * w.K * w.panel_elem;
  const char* bias =
      w.bias == nullptr ? nullptr
                        : w.bias + (e * w.dense_rows + w.dense_first + first) * w.bias_elem;
  return engine_matmul(code, x, x_row, rows, dense, panels, cols, w.K, bias, out, out_row, 1);
}

// The activation's kind (engine_fused_moe's options >> 1) and GPT-OSS's constants.
constexpr int kSilu = 0;
constexpr int kSwigluOai = 1;
struct Activation {
  int kind;
  float alpha, limit;
};

// out [rows, d] = the clamped SwiGLU of x [rows, 2d] (gate x[:, :d], up x[:, d:]), as
// FusedMoEOp.activate computes it in T: every operation's result rounded to T.
template <typename T>
void swiglu_oai(const T* x, int64_t x_row, T* out, int64_t out_row, int64_t rows, int64_t d,
                float alpha, float limit) {
  limit = round_to<T>(limit);  // torch.clamp's bound is the tensor's dtype
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * x_row;
    const T* up = gate + d;
    T* y = out + r * out_row;
    for (int64_t i = 0; i < d; ++i) {
      float g = load(gate, i), u = load(up, i);
      g = g > limit ? limit : g;  // comparisons, not fmin/fmax: a NaN passes (torch.clamp)
      u = u > limit ? limit : (u < -limit ? -limit : u);
      const float scaled = round_to<T>(g * alpha);
      const float sigmoid = round_to<T>(1.f / (1.f + std::exp(-scaled)));
      const float glu = round_to<T>(g * sigmoid);
      store(y, i, round_to<T>(u + 1.f) * glu);
    }
  }
}

// act's columns of the gate/up chunk gu ([rows, 2 * cols] in rows gu_row apart).
template <typename T>
int activate(int act_code, const Activation& how, const T* gu, int64_t gu_row, T* out,
             int64_t out_row, int64_t rows, int64_t cols) {
  if (how.kind == kSilu) {
    return engine_silu_and_mul(act_code, gu, gu_row, out, out_row, rows, cols, 1);
  }
  swiglu_oai(gu, gu_row, out, out_row, rows, cols, how.alpha, how.limit);
  return 0;
}

struct Item {
  int64_t expert, first, cols;
};

// Each active expert's columns [0, N) in chunks of whole panels, kItemsPerThread items per
// thread where there are enough panels (larger items reread fewer activation rows and make
// fewer calls: 1.2x at 1 token on one thread for whole experts against 4-panel items).
std::vector<Item> items_of(const int64_t* offsets, int64_t E, int64_t N, int num_threads) {
  int64_t panels = 0;
  for (int64_t e = 0; e < E; ++e) panels += offsets[e + 1] > offsets[e] ? panels_of(N) : 0;
  const int64_t per_item = std::clamp<int64_t>(
      panels / (kItemsPerThread * std::max(num_threads, 1)), 1, panels_of(N));
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t first = 0; first < N; first += per_item * kPanel) {
      items.push_back({e, first, std::min(N - first, per_item * kPanel)});
    }
  }
  return items;
}

template <typename T>
int fused_moe(int code, const T* hidden, int64_t h_row, int64_t tokens, const float* weights,
              const int32_t* experts, int64_t E, int64_t k, const Weights& gate,
              const Weights& up, const Weights& down, const Activation& how, int64_t H,
              int64_t I, T* out, int64_t out_row, char* workspace, const Layout& at,
              int num_threads) {
  const int64_t pairs = tokens * k;
  auto* position = reinterpret_cast<int32_t*>(workspace + at.position);
  auto* offsets = reinterpret_cast<int64_t*>(workspace + at.offsets);
  T* x = reinterpret_cast<T*>(workspace + at.x);
  T* gate_up = reinterpret_cast<T*>(workspace + at.gate_up);
  T* act = reinterpret_cast<T*>(workspace + at.act);
  T* y = reinterpret_cast<T*>(workspace + at.down);

  // Group the pairs by expert, stably (token order within an expert).
  std::fill(offsets, offsets + E + 1, int64_t{0});
  for (int64_t q = 0; q < pairs; ++q) ++offsets[experts[q] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> next(offsets, offsets + E);
    for (int64_t q = 0; q < pairs; ++q) position[q] = static_cast<int32_t>(next[experts[q]]++);
  }
  const int64_t elem = static_cast<int64_t>(sizeof(T));
  // Gate and up chunks side by side in gate_up's row (columns 2 * first ..), then the
  // activation of that chunk into act's columns first ..; then the down chunks.
  const std::vector<Item> first_items = items_of(offsets, E, I, num_threads);
  const std::vector<Item> down_items = items_of(offsets, E, H, num_threads);
  const int64_t most = std::max<int64_t>(
      {static_cast<int64_t>(first_items.size()), static_cast<int64_t>(down_items.size()),
       tokens});
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(most,
                                                                             num_threads)));
  int status = 0;
  // One team for the four passes (a fork and join per layer, a barrier between passes).
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs; ++q) {
      std::memcpy(x + position[q] * H, hidden + (q / k) * h_row, static_cast<size_t>(H * elem));
    }
#pragma omp for schedule(static) reduction(| : status)
    for (size_t i = 0; i < first_items.size(); ++i) {
      const Item& item = first_items[i];
      const int64_t start = offsets[item.expert], rows = offsets[item.expert + 1] - start;
      const T* xe = x + start * H;
      T* gu = gate_up + start * 2 * I + 2 * item.first;
      status |= product(code, xe, H, rows, gate, item.expert, item.first, item.cols, gu, 2 * I);
      status |= product(code, xe, H, rows, up, item.expert, item.first, item.cols,
                        gu + item.cols, 2 * I);
      status |= activate(code == kWidened ? kFloat32 : code, how, gu, 2 * I,
                         act + start * I + item.first, I, rows, item.cols);
    }
#pragma omp for schedule(static) reduction(| : status)
    for (size_t i = 0; i < down_items.size(); ++i) {
      const Item& item = down_items[i];
      const int64_t start = offsets[item.expert], rows = offsets[item.expert + 1] - start;
      status |= product(code, act + start * I, I, rows, down, item.expert, item.first,
                        item.cols, y + start * H + item.first, H);
    }
    // out[t] = sum over t's experts, ascending, of weight * row, in float32; rounded once.
    std::vector<int64_t> slots(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::sort(slots.begin(), slots.end(),
                [&](int64_t a, int64_t b) { return experts[a] < experts[b]; });
      T* o = out + t * out_row;
      for (int64_t h = 0; h < H; ++h) {
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t q = slots[j];
          sum += load(y + position[q] * H, h) * weights[q];
        }
        store(o, h, sum);
      }
    }
  }
  // A product's nonzero status (a build without that dtype): out is not to be used.
  return status;
}

}  // namespace

extern "C" {

int64_t engine_fused_moe_workspace(int64_t tokens, int64_t top_k, int64_t E, int64_t H,
                                   int64_t I, int64_t elem) {
  return Layout(tokens * top_k, E, H, I, elem).total;
}

// out [tokens, H] = the mixture of experts of hidden [tokens, H] routed by logits
// [tokens, E] (logits_dtype 0 float32, 1 bfloat16). code: the products' dtype code
// (engine_matmul's: 0 float32, 1 bfloat16, 2 float32 on bfloat16 panels); the
// activations are float32 for 0 and 2, bfloat16 for 1. options: bit 0 renormalize, bits
// 1.. the activation (0 SiLU-and-mul, 1 GPT-OSS's clamped SwiGLU with swiglu_alpha and
// swiglu_limit). w13 [E, 2I, H] dense (null with code 2), gate_panels / up_panels
// [E, panels(I) * 32 * H] its halves packed, w2 [E, H, I] and down_panels
// [E, panels(H) * 32 * I]; panels null: 1-3 rows per expert only. w13_bias [E, 2I] and
// w2_bias [E, H] in the activations' dtype, or null (no biases). sizes: H << 32 | I (one
// argument: a step-graph call takes at most 24). workspace:
// engine_fused_moe_workspace(tokens, ...) bytes. Returns 0, 1 for an unknown dtype code or
// activation, 2 for an expert count or top_k out of range, or a product's status.
int engine_fused_moe(int code, const void* hidden, int64_t h_row, int64_t tokens,
                     int logits_dtype, const void* logits, int64_t l_row, int64_t E,
                     int64_t top_k, int options, float swiglu_alpha, float swiglu_limit,
                     const void* w13, const void* w13_bias, const void* gate_panels,
                     const void* up_panels, const void* w2, const void* w2_bias,
                     const void* down_panels, int64_t sizes, void* out, int64_t out_row,
                     void* workspace, int num_threads) {
  const int64_t H = sizes >> 32, I = sizes & 0xFFFFFFFF;
  const bool renormalize = (options & 1) != 0;
  const Activation how{options >> 1, swiglu_alpha, swiglu_limit};
  if (E < 1 || top_k < 1 || top_k > E || E > INT32_MAX) return 2;
  if (code < 0 || code > kWidened || logits_dtype < 0 || logits_dtype > kBFloat16) return 1;
  if (how.kind != kSilu && how.kind != kSwigluOai) return 1;
  if (tokens <= 0) return 0;
  const int act = code == kWidened ? kFloat32 : code;
  const int64_t elem = act == kBFloat16 ? 2 : 4;
  const int64_t dense_elem = code == kFloat32 ? 4 : 2;
  const int64_t panel_elem = code == kFloat32 ? 4 : 2;
  const Layout at(tokens * top_k, E, H, I, elem);
  char* space = static_cast<char*>(workspace);
  auto* weights = reinterpret_cast<float*>(space + at.weights);
  auto* experts = reinterpret_cast<int32_t*>(space + at.experts);
  with_dtype(logits_dtype, [&](auto tag) {
    using L = decltype(tag);
    route(static_cast<const L*>(logits), l_row, tokens, E, top_k, renormalize, weights,
          experts, num_threads);
  });
  // Dense rows only where engine_matmul reads them (not on widened panels).
  const char* dense13 = code == kWidened ? nullptr : static_cast<const char*>(w13);
  const char* dense2 = code == kWidened ? nullptr : static_cast<const char*>(w2);
  const auto* bias13 = static_cast<const char*>(w13_bias);
  const auto* bias2 = static_cast<const char*>(w2_bias);
  const Weights gate{dense13, 2 * I, 0, static_cast<const char*>(gate_panels), I, H,
                     dense_elem, panel_elem, bias13, elem};
  const Weights up{dense13, 2 * I, I, static_cast<const char*>(up_panels), I, H, dense_elem,
                   panel_elem, bias13, elem};
  const Weights down{dense2, H, 0, static_cast<const char*>(down_panels), H, I, dense_elem,
                     panel_elem, bias2, elem};
  int status = 0;
  with_dtype(act, [&](auto tag) {
    using T = decltype(tag);
    status = fused_moe<T>(code, static_cast<const T*>(hidden), h_row, tokens, weights,
                          experts, E, top_k, gate, up, down, how, H, I, static_cast<T*>(out),
                          out_row, space, at, num_threads);
  });
  return status;
}

}  // extern "C"

ENGINE_GRAPH_ENTRY(fused_moe, 24) {
  return engine_fused_moe(x.i32(0), x.p(1), x.a[2], x.a[3], x.i32(4), x.p(5), x.a[6], x.a[7],
                          x.a[8], x.i32(9), x.f(10), x.f(11), x.p(12), x.p(13), x.p(14),
                          x.p(15), x.p(16), x.p(17), x.p(18), x.a[19], x.p(20), x.a[21],
                          x.p(22), x.threads(23));
}
