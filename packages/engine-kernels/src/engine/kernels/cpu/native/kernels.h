// The library's C entry points, declared once: every .cpp that defines or calls one includes
// this header, so a definition that drifts from its declaration is a compile error (each
// kernel's step-graph entry, graph_call.h, calls it directly). library.py declares the same
// signatures for ctypes (NativeKernels.__init__).
#pragma once

#include <cstdint>

extern "C" {

// paged_attention.cpp
int engine_paged_attention(int dtype, const void* q, int64_t q_tok, int64_t q_head,
                           const void* k_cache, const void* v_cache, int64_t c_block,
                           int64_t c_head, int64_t c_tok, const int32_t* block_table,
                           int64_t bt_stride, const int32_t* tok_req, const int32_t* tok_pos,
                           int64_t num_tokens, void* out, int64_t out_tok, int64_t out_head,
                           int64_t heads_kv, int64_t dims,
                           int sliding_window, float scale, float soft_cap,
                           const float* sinks, int num_threads);
void engine_write_kv(int elem_size, const void* key, int64_t k_tok, int64_t k_head,
                     const void* value, int64_t v_tok, int64_t v_head, void* k_cache,
                     void* v_cache, int64_t c_block, int64_t c_head, int64_t c_tok,
                     const int64_t* slots, int64_t num_tokens, int kv_heads, int head_size,
                     int block_size);

// elementwise.cpp
int engine_rms_norm(int dtype, void* x, int64_t x_row, void* residual, int64_t r_row,
                    const void* weight, int64_t rows, int64_t n, float eps, int num_threads);
int engine_rotary_embedding(int dtype, const int64_t* positions, int64_t tokens,
                            const float* cache, int64_t cache_row, int64_t cache_rows,
                            int rotary_dim, int neox, void* query, int64_t q_tok,
                            int64_t q_head, int q_heads, void* key, int64_t k_tok,
                            int64_t k_head, int k_heads, int num_threads);
int engine_silu_and_mul(int dtype, const void* x, int64_t x_row, void* out, int64_t out_row,
                        int64_t rows, int64_t d, int num_threads);
int engine_gelu_and_mul(int dtype, const void* x, int64_t x_row, void* out, int64_t out_row,
                        int64_t rows, int64_t d, int approximate, int num_threads);

// small_matmul.cpp
int engine_small_matmul_dtypes();
int engine_small_matmul(int dtype, const void* x, int64_t x_row, int64_t M, const void* w,
                        int64_t N, int64_t K, const void* bias, void* out, int64_t out_row,
                        int num_threads);
int engine_small_matmul_q8_0(int dtype, const void* x, int64_t x_row, int64_t M,
                             const void* blocks, int64_t N, int64_t K, const void* bias,
                             void* out, int64_t out_row, int num_threads);

// packed_matmul.cpp
int engine_packed_matmul_dtypes();
int engine_pack_matmul_weight(int dtype, const void* w, int64_t N, int64_t K, void* packed,
                              int num_threads);
int engine_packed_matmul(int dtype, const void* x, int64_t x_row, int64_t M,
                         const void* packed, int64_t N, int64_t K, const void* bias, void* out,
                         int64_t out_row, int num_threads);

// amx_matmul.cpp
int engine_amx_packed_matmul(const void* x, int64_t x_row, int64_t M, const void* packed,
                             int64_t N, int64_t K, const void* bias, void* out,
                             int64_t out_row, int num_threads);

// gguf_dequant.cpp
int engine_gguf_dequant(int type, const uint8_t* blocks, int64_t num_blocks, int dtype,
                        void* out, int num_threads);
int engine_int4pack_dequant_t(const uint8_t* packed, int64_t cols, int block, int64_t first_row,
                              int64_t rows, const void* scales_zeros, int64_t total_rows,
                              int dtype, void* out, int num_threads);

// matmul.cpp
int engine_matmul(int dtype, const void* x, int64_t x_row, int64_t M, const void* w,
                  const void* packed, int64_t N, int64_t K, const void* bias, void* out,
                  int64_t out_row, int num_threads);

// fused_moe.cpp
int64_t engine_fused_moe_workspace(int64_t tokens, int64_t top_k, int64_t E, int64_t H,
                                   int64_t I, int64_t elem);
int engine_fused_moe(int code, const void* hidden, int64_t h_row, int64_t tokens,
                     int logits_dtype, const void* logits, int64_t l_row, int64_t E,
                     int64_t top_k, int options, float swiglu_alpha, float swiglu_limit,
                     const void* w13, const void* w13_bias, const void* gate_panels,
                     const void* up_panels, const void* w2, const void* w2_bias,
                     const void* down_panels, int64_t sizes, void* out, int64_t out_row,
                     void* workspace, int num_threads);

}  // extern "C"
