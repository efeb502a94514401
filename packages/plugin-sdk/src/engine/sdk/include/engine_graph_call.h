// The CPU step graph's function ABI (engine.sdk.graph_calls) for C++ kernels: shipped with
// the SDK and on the include path of every engine.sdk.native build, so a plugin's kernel
// and the engine's own write their entries the same way. Each kernel a graph may record
// has an entry
//
//     int engine_graph_<kernel>(const int64_t* args, int64_t num_args, int max_threads);
//
// beside it, which reads its arguments (in the order its GraphFunction is called with)
// from `args` and calls the kernel:
//
//     ENGINE_GRAPH_ENTRY(scale_rows, 4) {  // x.ptr<T>(i), x.i32(i), x.f(i), x.threads(i)
//       return my_scale_rows(x.ptr<float>(0), x.a[1], x.f(2), x.threads(3));
//     }
#pragma once

#include <cstdint>
#include <cstring>

namespace engine_graph {

// A call's arguments: pointers and integers as they are, a float as its 32 bits.
struct Args {
  const int64_t* a;
  int max_threads;
  void* p(int i) const { return reinterpret_cast<void*>(a[i]); }
  template <typename T>
  T* ptr(int i) const { return reinterpret_cast<T*>(a[i]); }
  int i32(int i) const { return static_cast<int>(a[i]); }
  float f(int i) const {
    const auto bits = static_cast<uint32_t>(a[i]);
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }
  // The thread count recorded at i, capped at what the graph allows now.
  int threads(int i) const {
    const int cap = max_threads < 1 ? 1 : max_threads;
    return a[i] < cap ? static_cast<int>(a[i]) : cap;
  }
};

}  // namespace engine_graph

// Defines engine_graph_<name>: status 254 unless it got exactly `count` arguments.
#define ENGINE_GRAPH_ENTRY(name, count)                                               \
  static int engine_graph_body_##name(const engine_graph::Args& x);                   \
  extern "C" int engine_graph_##name(const int64_t* args, int64_t num_args,           \
                                     int max_threads) {                               \
    if (num_args != (count)) return 254;                                               \
    return engine_graph_body_##name(engine_graph::Args{args, max_threads});           \
  }                                                                                   \
  static int engine_graph_body_##name(const engine_graph::Args& x)
