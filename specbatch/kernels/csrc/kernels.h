/* The functions the kernels' C files export: module.c calls them from Python, gemm.c calls the
 * AMX path and the tall tiles. Every C file includes this header, so that a definition that drifts from its
 * declaration does not compile. Pointers are to float32, bfloat16 (uint16_t) or, with a `bf16`
 * flag, either; leading dimensions (ld*) are in elements. */
#ifndef SPECBATCH_KERNELS_H
#define SPECBATCH_KERNELS_H

#include <stdint.h>

/* gemm.c: y[M, N] = x[M, K] W^T (+ bias) on weights packed in panels (cpu.py: pack_linear) */
void sb_linear_f32(int M, int N, int K, const float* x, long ldx, const float* wp,
                   const float* bias, float* y, long ldy);
void sb_linear_bf16(int M, int N, int K, const uint16_t* x, long ldx, const uint16_t* wp,
                    const uint16_t* bias, void* y, long ldy, int y_f32);
int sb_has_bf16_dot(void);
void sb_set_amx(int on);

/* gemm_tall.c: gemm.c's multiplies of more than four rows (w_bf16: x, weights and bias in
 * bfloat16; y_bf16: y) */
void sb_linear_tall(int M, int N, int K, const void* x, long ldx, const void* wp, int w_bf16,
                    const void* bias, void* y, long ldy, int y_bf16);

/* gemm_quant.c: y[M, N] = x[M, K] W^T (+ bias) on GGUF blocks; qdesc: the number of
 * segments, then per segment its ggml type, rows, first output feature, the address of its
 * panels and two fields left 0 (quantized.py: QuantizedRows); -1 for a type it does not run or
 * K not whole blocks */
int sb_quant_block(int type, int* block_bytes);
int sb_linear_quant(int M, int N, int K, const void* x, long ldx, int x_bf16,
                    const int64_t* qdesc, const void* bias, void* y, long ldy, int y_f32);
/* gemm_qpanel.c: one segment of rows of one type in panels (gemm_qpanel.c says how) */
void sb_linear_qpanel(int M, int n_rows, int K, int type, const uint8_t* q, const void* x,
                      long ldx, int x_bf16, const void* bias, void* y, long ldy, int y_bf16);

/* gemm_amx.c */
int sb_amx_available(void);
void sb_linear_bf16_amx(int M, int N, int K, const uint16_t* x, long ldx, const uint16_t* wp,
                        const uint16_t* bias, void* y, long ldy, int y_f32);

/* layer_ops.c */
void sb_rms_norm(int rows, int n, const void* x, long ldx, void* residual, const void* w,
                 float eps, void* out, int bf16);
void sb_head_rms_norm(int rows, int heads, int d, void* x, long ldx, const void* w, float eps,
                      int bf16);
void sb_rope(int rows, int heads, int d, void* x, long ldx, const int64_t* positions,
             const float* cos, const float* sin, int bf16);
void sb_silu_and_mul(int rows, int n, const void* x, void* out, int bf16);
void sb_write_kv(int rows, int hkv, int d, const void* k, long ldk, const void* v, long ldv,
                 const int64_t* slots, void* k_cache, void* v_cache, int block_size, int bf16);

/* attention.c: q [T, hq, d] (rows ldq apart) over the paged cache -> out [T, hq, d]; tree: NULL
 * (causal) or one 64-bit mask per row over the keys from its sequence's tree_starts[b] on
 * (tree_starts[b] < 0: that sequence is causal) */
void sb_paged_attention(int num_seqs, const int64_t* qsl, const int64_t* seq_lens,
                        const int64_t* block_tables, long bt_stride, const void* q, long ldq,
                        int hq, int hkv, int d, const void* k_cache, const void* v_cache,
                        int block_size, float scale, void* out, const uint64_t* tree,
                        const int64_t* tree_starts, int bf16);
int sb_attention_max_head_dim(void);
int sb_attention_tree_rows(void);

/* sampling.c: one token per row of probs [rows, v] (rows ld apart), u [rows] in [0, 1) */
void sb_sample_rows(int rows, int v, const float* probs, long ld, const float* u, int64_t* out);

/* rejection.c: a chain's rejection rule for each of batch requests (rejection_sampler.py):
 * p [batch, gamma + 1, v] and q [batch, gamma, v] (NULL: point masses) with the given batch and
 * row strides, residual a scratch row of v; tokens [batch, gamma + 1], accepted [batch] */
void sb_rejection_sample(int batch, int gamma, int v, const int64_t* draft_ids,
                         const int64_t* num_draft, const float* p, long p_sb, long p_sr,
                         const float* q, long q_sb, long q_sr, const float* accept_u,
                         const float* final_u, float* residual, int64_t* tokens,
                         int64_t* accepted);

/* layer.c: a decoder layer's attention and MLP on the normed input x [t, K_IN] (desc: the
 * layer's sizes and weights, layer.c's LAYER_*): residual += o_proj(attention), then
 * y = mlp(norm(residual)); -1 if out of memory */
int sb_layer_fields(void);
int sb_layer_core(const int64_t* desc, int t, const void* x, void* residual, void* y,
                  const int64_t* positions, const int64_t* slots, void* k_cache, void* v_cache,
                  int kv_heads_stride, int block_size, int num_seqs, const int64_t* qsl,
                  const int64_t* seq_lens, const int64_t* block_tables, long bt_stride,
                  const uint64_t* tree, const int64_t* tree_starts, float eps, float scale,
                  int bf16);
/* layer.c: layers lo .. hi - 1 of a decoder stack, each its input norm and sb_layer_core
 * (layers: sb_stack_fields() int64s per layer, layer.c's STACK_*) */
int sb_stack_fields(void);
int sb_decoder_layers(const int64_t* layers, int lo, int hi, int t, int h, void* x,
                      void* residual, void* normed, const int64_t* positions,
                      const int64_t* slots, int num_seqs, const int64_t* qsl,
                      const int64_t* seq_lens, const int64_t* block_tables, long bt_stride,
                      const uint64_t* tree, const int64_t* tree_starts, float eps, float scale,
                      int bf16);
/* An EAGLE-3 head's pass: x = [norm(embedded); norm(features)], the layer (sb_layer_core)
 * with the features as its residual, pre = residual + mlp (the next pass's feature), into
 * normed_out (unless NULL) norm(pre), into logits (unless NULL) float32 lm_head(norm(pre)) */
int sb_eagle3_pass(const int64_t* desc, int t, const void* embedded, const void* features,
                   long ldf, const void* embed_norm, const void* feature_norm,
                   const void* final_norm, const void* lm_head, int vocab, void* pre,
                   void* normed_out, float* logits, const int64_t* positions, const int64_t* slots, void* k_cache,
                   void* v_cache, int kv_heads_stride, int block_size, int num_seqs,
                   const int64_t* qsl, const int64_t* seq_lens, const int64_t* block_tables,
                   long bt_stride, const uint64_t* tree, const int64_t* tree_starts, float eps,
                   float scale, int bf16);

/* draft_chain.c: an EAGLE-3 head's draft chains of depths[r] drafts past their roots, a request
 * a row (temperature-only or greedy sampling; sb_eagle3_pass for each depth below the last):
 * tokens [a, max depth] (rows ldt apart), q [a, max depth, vocab] into probs unless NULL (rows
 * ldp apart); logits [a, vocab] the roots' on entry, overwritten */
int sb_eagle3_chain(const int64_t* desc, int hidden, int a, const int64_t* depths,
                    float* logits, const void* state, const void* embed, const void* embed_norm,
                    const void* feature_norm, const void* final_norm, const void* lm_head,
                    int vocab, const float* temperature, const float* u, long ldu,
                    int64_t* tokens, long ldt, float* probs, long ldp, const int64_t* base,
                    const int64_t* block_tables, long bt_stride, void* k_cache, void* v_cache,
                    int kv_heads_stride, int block_size, float eps, float scale, int bf16);

/* draft_round.c: the head's pass (hidden features) over t rows it has not seen (embedding rows of ids, the
 * target's features [t, fc_in] through fc), each drafting row's root at its row rows[r] of
 * that pass, then sb_eagle3_chain past the roots; the seconds until the chain starts into
 * catch_up_seconds */
int sb_eagle3_round(const int64_t* desc, int hidden, int t, const int64_t* ids, const void* target_features,
                    long ldtf, int fc_in, const void* fc, const void* fc_bias,
                    const int64_t* positions, const int64_t* slots, int num_seqs,
                    const int64_t* qsl, const int64_t* seq_lens, const int64_t* catch_tables,
                    long catch_stride, int a, const int64_t* rows, const int64_t* depths,
                    const void* embed, const void* embed_norm, const void* feature_norm,
                    const void* final_norm, const void* lm_head, int vocab,
                    const float* temperature, const float* u, long ldu, int64_t* tokens,
                    long ldt, float* probs, long ldp, const int64_t* base,
                    const int64_t* block_tables, long bt_stride, void* k_cache, void* v_cache,
                    int kv_heads_stride, int block_size, float eps, float scale, int bf16,
                    double* catch_up_seconds);

#endif
