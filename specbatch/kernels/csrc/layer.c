/* A decoder layer's attention and MLP as one call (cpu_forward.py's plans): the same kernel
 * calls, in the same order and on the same buffers' contents, as the op-by-op path, so the
 * results are bit for bit that path's; only the Python between them is gone.
 *
 * The layer's weights come as a descriptor, an int64 array written once when the plan is built
 * (LAYER_* below: sizes, then the packed weights' and norms' addresses, 0 for an absent one). */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

enum {
    LAYER_K_IN,     /* features of the normed input x (the hidden size; twice it for EAGLE-3) */
    LAYER_HIDDEN,   /* features of the residual stream and of y */
    LAYER_HQ,       /* query heads */
    LAYER_HKV,      /* key/value heads */
    LAYER_D,        /* head dim */
    LAYER_INTER,    /* the MLP's intermediate size (gate_up has twice it) */
    LAYER_QKV,      /* packed [q; k; v] projection, K = K_IN, N = (HQ + 2 HKV) D */
    LAYER_QKV_BIAS, /* and its bias (or 0) */
    LAYER_Q_NORM,   /* per-head RMSNorm weights of q and k (Qwen3), or 0 */
    LAYER_K_NORM,
    LAYER_O, /* output projection, K = HQ D, N = HIDDEN */
    LAYER_O_BIAS,
    LAYER_POST_NORM, /* the norm before the MLP */
    LAYER_GATE_UP,   /* packed [gate; up], K = HIDDEN, N = 2 INTER */
    LAYER_GATE_UP_BIAS,
    LAYER_DOWN, /* K = INTER, N = HIDDEN */
    LAYER_DOWN_BIAS,
    LAYER_COS, /* the rotary tables, float32 [position][D / 2] */
    LAYER_SIN,
    LAYER_QKV_Q, /* a projection kept as GGUF blocks: sb_linear_quant's descriptor (its panels 0),
                    or 0 */
    LAYER_O_Q,
    LAYER_GATE_UP_Q,
    LAYER_DOWN_Q,
    LAYER_FIELDS
};

#define PTR(i) ((const void*)(intptr_t)desc[i])

static void linear(int t, int n, int k, const void* x, const void* w, const void* q,
                   const void* bias, void* y, int bf16) {
    if (q)
        sb_linear_quant(t, n, k, x, k, bf16, (const int64_t*)q, bias, y, n, 0);
    else if (bf16)
        sb_linear_bf16(t, n, k, (const uint16_t*)x, k, (const uint16_t*)w,
                       (const uint16_t*)bias, y, n, 0);
    else
        sb_linear_f32(t, n, k, (const float*)x, k, (const float*)w, (const float*)bias,
                      (float*)y, n);
}

int sb_layer_fields(void) { return LAYER_FIELDS; }

int sb_layer_core(const int64_t* desc, int t, const void* x, void* residual, void* y,
                  const int64_t* positions, const int64_t* slots, void* k_cache, void* v_cache,
                  int kv_heads_stride, int block_size, int num_seqs, const int64_t* qsl,
                  const int64_t* seq_lens, const int64_t* block_tables, long bt_stride,
                  const uint64_t* tree, const int64_t* tree_starts, float eps, float scale,
                  int bf16) {
    const int k_in = (int)desc[LAYER_K_IN], h = (int)desc[LAYER_HIDDEN];
    const int hq = (int)desc[LAYER_HQ], hkv = (int)desc[LAYER_HKV], d = (int)desc[LAYER_D];
    const int inter = (int)desc[LAYER_INTER], nqkv = (hq + 2 * hkv) * d;
    const size_t esz = bf16 ? 2 : 4;
    /* one block for every intermediate: qkv, attn, proj, normed, gate_up, act */
    size_t sizes[6] = {(size_t)nqkv, (size_t)hq * d, (size_t)h, (size_t)h, (size_t)2 * inter,
                       (size_t)inter};
    size_t total = 0;
    for (int i = 0; i < 6; i++) total += sizes[i];
    char* block = (char*)malloc(total * (size_t)t * esz);
    if (!block) return -1;
    char* buf[6];
    char* at = block;
    for (int i = 0; i < 6; i++) {
        buf[i] = at;
        at += sizes[i] * (size_t)t * esz;
    }
    char *qkv = buf[0], *attn = buf[1], *proj = buf[2], *normed = buf[3], *gate_up = buf[4],
         *act = buf[5];

    linear(t, nqkv, k_in, x, PTR(LAYER_QKV), PTR(LAYER_QKV_Q), PTR(LAYER_QKV_BIAS), qkv, bf16);
    char* k = qkv + (size_t)hq * d * esz;
    char* v = qkv + (size_t)(hq + hkv) * d * esz;
    if (desc[LAYER_Q_NORM] && desc[LAYER_K_NORM]) {
        sb_head_rms_norm(t, hq, d, qkv, nqkv, PTR(LAYER_Q_NORM), eps, bf16);
        sb_head_rms_norm(t, hkv, d, k, nqkv, PTR(LAYER_K_NORM), eps, bf16);
    }
    const float* cos_t = (const float*)PTR(LAYER_COS);
    const float* sin_t = (const float*)PTR(LAYER_SIN);
    sb_rope(t, hq, d, qkv, nqkv, positions, cos_t, sin_t, bf16);
    sb_rope(t, hkv, d, k, nqkv, positions, cos_t, sin_t, bf16);
    sb_write_kv(t, hkv, d, k, nqkv, v, nqkv, slots, k_cache, v_cache, block_size, bf16);
    sb_paged_attention(num_seqs, qsl, seq_lens, block_tables, bt_stride, qkv, nqkv, hq,
                       kv_heads_stride, d, k_cache, v_cache, block_size, scale, attn, tree,
                       tree_starts, bf16);
    linear(t, h, hq * d, attn, PTR(LAYER_O), PTR(LAYER_O_Q), PTR(LAYER_O_BIAS), proj, bf16);
    sb_rms_norm(t, h, proj, h, residual, PTR(LAYER_POST_NORM), eps, normed, bf16);
    linear(t, 2 * inter, h, normed, PTR(LAYER_GATE_UP), PTR(LAYER_GATE_UP_Q),
           PTR(LAYER_GATE_UP_BIAS), gate_up, bf16);
    sb_silu_and_mul(t, inter, gate_up, act, bf16);
    linear(t, h, inter, act, PTR(LAYER_DOWN), PTR(LAYER_DOWN_Q), PTR(LAYER_DOWN_BIAS), y, bf16);
    free(block);
    return 0;
}

/* Layers lo .. hi - 1 of a decoder stack, each its input norm and then sb_layer_core: layer 0's
 * norm reads the residual stream alone, a later layer's adds x (the MLP's output before it)
 * into the stream first. layers: per layer, LAYER_STACK_FIELDS int64s (its descriptor's,
 * input norm's and K and V caches' addresses, the caches' kv heads and block size); x, residual
 * and normed: [t, h] buffers. The same calls, in the same order, as a layer at a time. */
enum { STACK_DESC, STACK_IN_NORM, STACK_K, STACK_V, STACK_KV_HEADS, STACK_BLOCK, STACK_FIELDS };

int sb_stack_fields(void) { return STACK_FIELDS; }

int sb_decoder_layers(const int64_t* layers, int lo, int hi, int t, int h, void* x,
                      void* residual, void* normed, const int64_t* positions,
                      const int64_t* slots, int num_seqs, const int64_t* qsl,
                      const int64_t* seq_lens, const int64_t* block_tables, long bt_stride,
                      const uint64_t* tree, const int64_t* tree_starts, float eps, float scale,
                      int bf16) {
    for (int i = lo; i < hi; i++) {
        const int64_t* f = layers + (long)i * STACK_FIELDS;
        const void* w = (const void*)(intptr_t)f[STACK_IN_NORM];
        if (i == 0)
            sb_rms_norm(t, h, residual, h, NULL, w, eps, normed, bf16);
        else
            sb_rms_norm(t, h, x, h, residual, w, eps, normed, bf16);
        int rc = sb_layer_core((const int64_t*)(intptr_t)f[STACK_DESC], t, normed, residual, x,
                               positions, slots, (void*)(intptr_t)f[STACK_K],
                               (void*)(intptr_t)f[STACK_V], (int)f[STACK_KV_HEADS],
                               (int)f[STACK_BLOCK], num_seqs, qsl, seq_lens, block_tables,
                               bt_stride, tree, tree_starts, eps, scale, bf16);
        if (rc != 0) return rc;
    }
    return 0;
}

/* a += b, rows of n contiguous elements, rounded to the dtype */
static void add_rows(int t, int n, void* a, const void* b, int bf16) {
    const size_t esz = bf16 ? 2 : 4;
    for (long i = 0; i < (long)t * n; i += 16) {
        int left = (int)((long)t * n - i);
        vmask m = lanes(left);
        char* pa = (char*)a + i * esz;
        vf v = vf_add(load16(pa, m, bf16), load16((const char*)b + i * esz, m, bf16));
        store16(pa, m, v, bf16);
    }
}

int sb_eagle3_pass(const int64_t* desc, int t, const void* embedded, const void* features,
                   long ldf, const void* embed_norm, const void* feature_norm,
                   const void* final_norm, const void* lm_head, int vocab, void* pre,
                   void* normed_out, float* logits, const int64_t* positions, const int64_t* slots, void* k_cache,
                   void* v_cache, int kv_heads_stride, int block_size, int num_seqs,
                   const int64_t* qsl, const int64_t* seq_lens, const int64_t* block_tables,
                   long bt_stride, const uint64_t* tree, const int64_t* tree_starts, float eps,
                   float scale, int bf16) {
    const int h = (int)desc[LAYER_HIDDEN];
    const size_t esz = bf16 ? 2 : 4, row = (size_t)h * esz;
    char* block = (char*)malloc((size_t)t * row * 5);
    if (!block) return -1;
    char *e = block, *f = e + t * row, *x = f + t * row, *down = x + 2 * t * row;
    char* normed = normed_out ? (char*)normed_out : e; /* e is spent once x holds it */
    sb_rms_norm(t, h, embedded, h, NULL, embed_norm, eps, e, bf16);
    sb_rms_norm(t, h, features, ldf, NULL, feature_norm, eps, f, bf16);
    for (int r = 0; r < t; r++) {
        memcpy(x + (size_t)r * 2 * row, e + (size_t)r * row, row);
        memcpy(x + (size_t)r * 2 * row + row, f + (size_t)r * row, row);
        memcpy((char*)pre + (size_t)r * row, (const char*)features + (size_t)r * ldf * esz, row);
    }
    int rc = sb_layer_core(desc, t, x, pre, down, positions, slots, k_cache, v_cache,
                           kv_heads_stride, block_size, num_seqs, qsl, seq_lens, block_tables,
                           bt_stride, tree, tree_starts, eps, scale, bf16);
    if (rc == 0) {
        add_rows(t, h, pre, down, bf16);
        sb_rms_norm(t, h, pre, h, NULL, final_norm, eps, normed, bf16);
        if (logits && bf16)
            sb_linear_bf16(t, vocab, h, (const uint16_t*)normed, h, (const uint16_t*)lm_head,
                           NULL, logits, vocab, 1);
        else if (logits)
            sb_linear_f32(t, vocab, h, (const float*)normed, h, (const float*)lm_head, NULL,
                          logits, vocab);
    }
    free(block);
    return rc;
}
