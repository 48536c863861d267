/* Attention over the paged KV cache for a ragged batch: prompts, prompt chunks, one-token
 * decodes, (k + 1)-row verifications and draft trees in one call, reading keys and values in
 * place through each sequence's block table (nothing is gathered into a temporary).
 *
 * Cache layout (this backend's own), per block and kv head: in float32, keys [d][block_size]
 * and values [block_size][d], so 16 consecutive keys of a block are one vector lane-wise and
 * their scores need no horizontal sums; in bfloat16 the same with pairs in 32-bit lanes, keys
 * [d / 2][block_size][2] (dimensions 2i and 2i + 1 of a key side by side) and values
 * [block_size / 2][d][2] (keys 2j and 2j + 1 of a dimension side by side), widened to float32
 * in registers, one load giving two vectors. The value rows of a block are padded to an even
 * count.
 *
 * Visibility: query row i of a sequence with q_len new tokens and seq_len positions sees its
 * context, keys 0 .. seq_len - q_len - 1, and of the new tokens either 0 .. i (causal, the
 * default) or, given a tree mask, the new tokens j whose bit j is set in the row's 64-bit mask
 * (sequences of at most 64 new tokens; longer ones are causal).
 *
 * One work item is one sequence's tile of up to QT query vectors (its rows times the heads that
 * share a kv head) over a group of kv heads: the item walks the sequence's keys once, SPAN
 * chunks of up to 16 keys at a time (a chunk lies inside one block), and for each kv head of
 * the group computes every vector's scores on the chunks while they sit in L1, one running-max
 * update per span (online softmax in float32, in powers of 2: q carries scale * log2(e)), then
 * the weighted values. Keys and values of
 * the span PF_AHEAD spans ahead, across items, are prefetched into L2 a share at a time, since
 * the pool hands blocks out in any order and no hardware prefetcher sees them coming.
 *
 * Batch invariance: every vector's sums run in one order fixed by the positions alone (per
 * lane, even and odd dimensions of a score in two sums added at the end; even and odd keys of
 * a span's weighted values in two sums added into the accumulator at the span's end; one max
 * per span), whatever the other vectors of its tile, the tile's extent or the thread. Keys a
 * vector does not see enter with probability exactly 0, and only written keys are ever read. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#define DMAX 256
#define QT 16        /* query vectors of one kv head in a tile */
#define SPAN 4       /* chunks of up to 16 keys sharing one running-max update */
#define TREE_ROWS 64 /* a sequence of at most this many new tokens may carry a tree mask */
/* An item takes as many kv heads as keep one span's keys and values about this size. */
#define ITEM_SPAN_BYTES (64L << 10)
#define PF_AHEAD 2 /* spans prefetched ahead of the one computing */

typedef struct {
    const int64_t* qsl;
    const int64_t* seq_lens;
    const int64_t* block_tables;
    long bt_stride;
    const char* q;
    long ldq;
    int hq, hkv, d, bs;
    const char* k_cache;
    const char* v_cache;
    float scale;
    char* out;
    const uint64_t* tree;
    long k_bytes, v_bytes; /* one block's keys, values of one kv head */
} attn_args;

/* query vectors v0 .. v0 + nv - 1 (vector r * G + g: row r, head g of the kv head) of sequence
 * b over kv heads h0 .. h1 - 1, reading keys 0 .. kend - 1 */
typedef struct {
    int b, v0, nv, h0, h1, kend;
} item_t;

/* ---- visibility ---------------------------------------------------------------------------- */

typedef struct {
    int ctx;       /* context positions (before the new tokens) */
    int vend[QT];  /* a vector sees positions 0 .. vend - 1 ... */
    uint64_t tm[QT]; /* ... and the new tokens whose bits are set here */
} vis_t;

SB_INLINE int seq_ctx(const attn_args* a, int b) {
    return (int)(a->seq_lens[b] - (a->qsl[b + 1] - a->qsl[b]));
}

SB_INLINE void row_vis(const attn_args* a, int b, int r, int* vend, uint64_t* tm) {
    const long row0 = a->qsl[b];
    const int q_len = (int)(a->qsl[b + 1] - row0), ctx = seq_ctx(a, b);
    if (a->tree && q_len <= TREE_ROWS) { /* bits past the sequence's tokens are dropped */
        *vend = ctx;
        *tm = q_len < 64 ? a->tree[row0 + r] & ((1ull << q_len) - 1) : a->tree[row0 + r];
    } else {
        *vend = ctx + r + 1;
        *tm = 0;
    }
}

SB_INLINE int vis_end(int ctx, int vend, uint64_t tm) {
    int e = tm ? ctx + 64 - __builtin_clzll(tm) : 0;
    return e > vend ? e : vend;
}

/* the lanes of a chunk of n keys from position pos that the vector sees */
SB_INLINE vmask chunk_mask(int ctx, int vend, uint64_t tm, int pos, int n) {
    vmask m = lanes(vend - pos);
    if (tm) {
        int off = pos - ctx; /* the new-token index of the chunk's first key */
        uint64_t bits = off >= 64 ? 0 : off >= 0 ? tm >> off : off > -64 ? tm << -off : 0;
        m |= (vmask)bits;
    }
    return m & lanes(n);
}

/* ---- chunks ---------------------------------------------------------------------------------- */

typedef struct {
    long phys; /* physical block */
    int c;     /* first slot in the block */
    int pos;   /* position of that slot */
    int n;     /* keys */
} chunk_t;

SB_INLINE int num_chunks(int bs, int kend) {
    const int cpb = (bs + 15) / 16;
    return kend / bs * cpb + (kend % bs + 15) / 16;
}

SB_INLINE chunk_t chunk_at(const attn_args* a, const int64_t* bt, int ci, int kend) {
    const int bs = a->bs, cpb = (bs + 15) / 16, j = ci / cpb;
    chunk_t k;
    k.phys = bt[j];
    k.c = ci % cpb * 16;
    k.pos = j * bs + k.c;
    k.n = bs - k.c < 16 ? bs - k.c : 16;
    if (kend - k.pos < k.n) k.n = kend - k.pos;
    return k;
}

/* ---- prefetching: a cursor PF_AHEAD spans ahead over the thread's items ---------------------- */

typedef struct {
    const attn_args* a;
    const item_t* items;
    int item, end, ci; /* the next span to prefetch: chunks ci .. of items[item]; items < end */
    const char* from[2 * SPAN];
    const char* to[2 * SPAN];
    int n, k;         /* regions queued, the next to issue */
    const char* p;    /* the region issuing: its next line ... */
    const char* e;    /* ... and its end */
    int per_tick;     /* lines a pf_tick issues */
} pf_t;

/* up to `lines` lines of the queue */
SB_INLINE void pf_issue(pf_t* pf, long lines) {
    for (; lines > 0; lines--) {
        if (pf->p >= pf->e) {
            if (pf->k >= pf->n) return;
            pf->p = pf->from[pf->k];
            pf->e = pf->to[pf->k++];
        }
        _mm_prefetch(pf->p, _MM_HINT_T1);
        pf->p += 64;
    }
}

/* Called from the kernels' inner loops, so that the lines go out while they compute rather than
 * in bursts that would stall the core on its fill buffers. */
SB_INLINE void pf_tick(pf_t* pf) { pf_issue(pf, pf->per_tick); }

/* Issues what is left of the queue, then queues the next span's blocks (their kv heads of the
 * item), to be issued over about `ticks` pf_ticks. */
static void pf_next(pf_t* pf, long ticks) {
    const attn_args* a = pf->a;
    pf_issue(pf, 1L << 40);
    pf->n = pf->k = 0;
    pf->p = pf->e = NULL;
    long bytes = 0;
    while (pf->item < pf->end) {
        const item_t* it = &pf->items[pf->item];
        const int total = num_chunks(a->bs, it->kend);
        if (pf->ci >= total) {
            pf->item++;
            pf->ci = 0;
            continue;
        }
        const int64_t* bt = a->block_tables + (long)it->b * a->bt_stride;
        const int nh = it->h1 - it->h0;
        for (int ch = 0; ch < SPAN && pf->ci + ch < total; ch++) {
            chunk_t ck = chunk_at(a, bt, pf->ci + ch, it->kend);
            if (ck.c) continue; /* the block was queued with its first chunk */
            long base = ck.phys * a->hkv + it->h0;
            pf->from[pf->n] = a->k_cache + base * a->k_bytes;
            pf->to[pf->n] = pf->from[pf->n] + nh * a->k_bytes;
            pf->n++;
            pf->from[pf->n] = a->v_cache + base * a->v_bytes;
            pf->to[pf->n] = pf->from[pf->n] + nh * a->v_bytes;
            pf->n++;
            bytes += nh * (a->k_bytes + a->v_bytes);
        }
        pf->ci += SPAN;
        break;
    }
    pf->per_tick = (int)((bytes / 64 + ticks - 1) / ticks);
}

/* ---- the kernels on one span's chunks --------------------------------------------------------- */

/* Register blocking: vectors per group, and the chunks (scores) or 16-dimension slices (values)
 * a group takes at once. */
#if SB_WIDE
#define VGMAX 12
#define WIDTH(nvg) ((nvg) <= 2 ? 4 : (nvg) <= 6 ? 2 : 1)
#else
#define VGMAX 2
#define WIDTH(nvg) ((nvg) <= 1 ? 2 : 1)
#endif

/* bfloat16 on dot products of pairs where the CPU has AVX512-BF16: a pair of q's (p's) values
 * against 16 pairs of keys (values) an instruction, p rounded to bfloat16 as on GPUs. Built with
 * SB_ATTN_PAIRS_TEST, the same code runs on the pairs' two FMAs (common.h), to be tested where
 * the instruction is missing. Elsewhere bfloat16 keys and values are widened to float32. */
#if defined(__AVX512BF16__) || defined(SB_ATTN_PAIRS_TEST)
#define PAIRS 1
#else
#define PAIRS 0
#endif

/* Dimensions 2i and 2i + 1 of 16 keys: the key rows of a chunk start at kb, rs bytes apart
 * (bfloat16: one row of pairs; float32: two rows). Lanes outside km read as 0. */
SB_INLINE void key_dims(const char* kb, int i, long rs, vmask km, const int bf16, vf* e, vf* o) {
    if (bf16) {
        bf16_pairs_masked((const uint16_t*)(kb + i * rs), km, e, o);
    } else {
        *e = load16(kb + 2 * i * rs, km, 0);
        *o = load16(kb + (2 * i + 1) * rs, km, 0);
    }
}

/* s[v][ch] = q_v . keys of chunk ch, for NVG vectors (q_v times the scale at qw + v * DMAX, so
 * that every vector's address is a constant offset) and NCH chunks (key rows at kb[ch]), every
 * sum as two chains (even, odd dimensions). */
SB_INLINE void scores_blk(const int NVG, const int NCH, const float* qw, int d,
                          const char* const* kb, long rs, const vmask* km, float* s, pf_t* pf,
                          const int bf16) {
    vf e[VGMAX][4], o[VGMAX][4]; /* fixed sizes (no VLA), so that they live in registers */
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int ch = 0; ch < NCH; ch++) e[v][ch] = o[v][ch] = vf_zero();
    for (int i = 0; i < d / 2; i++) {
        const float* q2 = qw + 2 * i;
#pragma GCC unroll 4
        for (int ch = 0; ch < NCH; ch++) {
            vf ke, ko;
            key_dims(kb[ch], i, rs, km[ch], bf16, &ke, &ko);
#pragma GCC unroll 16
            for (int v = 0; v < NVG; v++) {
                e[v][ch] = vf_fma(vf_set1(q2[v * DMAX]), ke, e[v][ch]);
                o[v][ch] = vf_fma(vf_set1(q2[v * DMAX + 1]), ko, o[v][ch]);
            }
        }
        pf_tick(pf);
    }
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int ch = 0; ch < NCH; ch++)
            vf_store(s + (v * SPAN + ch) * 16, vf_add(e[v][ch], o[v][ch]));
}

/* acc[v][i0 .. i0 + 16 NDB) += sum over the span's chunks and keys j of p[v][ch][j] value_j,
 * for NVG vectors: even keys (within a chunk) in one sum started from acc, odd keys in another
 * from 0, added at the end. Value rows of a chunk start at vb[ch], rs bytes apart (bfloat16: a
 * row of pairs of keys). */
SB_INLINE void values_blk(const int NVG, const int NDB, float* acc, int d, const float* p,
                          const char* const* vb, long rs, const int* n, int nch, int i0,
                          pf_t* pf, const int bf16) {
    vf ev[VGMAX][4], od[VGMAX][4];
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int u = 0; u < NDB; u++) {
            ev[v][u] = vf_load(acc + v * d + i0 + 16 * u);
            od[v][u] = vf_zero();
        }
    for (int ch = 0; ch < nch; ch++) {
        const float* pc = p + ch * 16;
        const int pairs = n[ch] / 2;
        for (int jj = 0; jj < pairs; jj++) {
#pragma GCC unroll 4
            for (int u = 0; u < NDB; u++) {
                vf xe, xo;
                if (bf16) {
                    bf16_pairs((const uint16_t*)(vb[ch] + jj * rs + (i0 + 16 * u) * 4), &xe, &xo);
                } else {
                    xe = vf_loadu((const float*)(vb[ch] + 2 * jj * rs) + i0 + 16 * u);
                    xo = vf_loadu((const float*)(vb[ch] + (2 * jj + 1) * rs) + i0 + 16 * u);
                }
#pragma GCC unroll 16
                for (int v = 0; v < NVG; v++) {
                    ev[v][u] = vf_fma(vf_set1(pc[v * SPAN * 16 + 2 * jj]), xe, ev[v][u]);
                    od[v][u] = vf_fma(vf_set1(pc[v * SPAN * 16 + 2 * jj + 1]), xo, od[v][u]);
                }
            }
            pf_tick(pf);
        }
        if (n[ch] & 1) { /* the last key's partner slot may never have been written */
            const int j = n[ch] - 1;
#pragma GCC unroll 4
            for (int u = 0; u < NDB; u++) {
                vf xe, xo;
                if (bf16)
                    bf16_pairs((const uint16_t*)(vb[ch] + j / 2 * rs + (i0 + 16 * u) * 4), &xe, &xo);
                else
                    xe = vf_loadu((const float*)(vb[ch] + j * rs) + i0 + 16 * u);
#pragma GCC unroll 16
                for (int v = 0; v < NVG; v++)
                    ev[v][u] = vf_fma(vf_set1(pc[v * SPAN * 16 + j]), xe, ev[v][u]);
            }
            pf_tick(pf);
        }
    }
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int u = 0; u < NDB; u++)
            vf_store(acc + v * d + i0 + 16 * u, vf_add(ev[v][u], od[v][u]));
}


#define SC(NVG, NCH)                                                                   \
    do {                                                                               \
        if (pairs)                                                                     \
            scores_blk_pairs(NVG, NCH, (const uint32_t*)qw, d, kb, rs, km, sc, s, pf); \
        else                                                                           \
            scores_blk(NVG, NCH, qw, d, kb, rs, km, s, pf, bf16);                      \
    } while (0)
#define VA(NVG, NDB)                                                                   \
    do {                                                                               \
        if (pairs)                                                                     \
            values_blk_pairs(NVG, NDB, acc, d, pp, vb, rs, n, nch, i0, pf);            \
        else                                                                           \
            values_blk(NVG, NDB, acc, d, p, vb, rs, n, nch, i0, pf, bf16);             \
    } while (0)
#define BY_WIDTH(F, NVG, W) \
    do {                    \
        if ((W) >= 4)       \
            F(NVG, 4);      \
        else if ((W) == 2)  \
            F(NVG, 2);      \
        else                \
            F(NVG, 1);      \
    } while (0)

#if SB_WIDE
#define BY_GROUP(F, nvg, w)                          \
    switch (nvg) {                                   \
        case 1: BY_WIDTH(F, 1, w); break;            \
        case 2: BY_WIDTH(F, 2, w); break;            \
        case 3: BY_WIDTH(F, 3, (w) > 2 ? 2 : w); break;  \
        case 4: BY_WIDTH(F, 4, (w) > 2 ? 2 : w); break;  \
        case 5: BY_WIDTH(F, 5, (w) > 2 ? 2 : w); break;  \
        case 6: BY_WIDTH(F, 6, (w) > 2 ? 2 : w); break;  \
        case 7: F(7, 1); break;                      \
        case 8: F(8, 1); break;                      \
        case 9: F(9, 1); break;                      \
        case 10: F(10, 1); break;                    \
        case 11: F(11, 1); break;                    \
        default: F(12, 1); break;                    \
    }
#else
#define BY_GROUP(F, nvg, w)                       \
    switch (nvg) {                                \
        case 1: BY_WIDTH(F, 1, (w) > 2 ? 2 : w); break; \
        default: F(2, 1); break;                  \
    }
#endif

/* The dot-product forms of scores_blk (q's bfloat16 pairs, dimensions 2i and 2i + 1, at
 * qp[v * DMAX + i]; the sums times sc) and values_blk (p's bfloat16 pairs, keys 2j and 2j + 1 of a
 * chunk, at pp[(v * SPAN + ch) * 8 + j]; even pairs in one sum, odd in the other). */
SB_INLINE void scores_blk_pairs(const int NVG, const int NCH, const uint32_t* qp, int d,
                                const char* const* kb, long rs, const vmask* km, float sc,
                                float* s, pf_t* pf) {
    vf acc[VGMAX][4];
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int ch = 0; ch < NCH; ch++) acc[v][ch] = vf_zero();
    for (int i = 0; i < d / 2; i++) {
#pragma GCC unroll 4
        for (int ch = 0; ch < NCH; ch++) {
            bpairs k = bpairs_load((const uint16_t*)(kb[ch] + i * rs), km[ch]);
#pragma GCC unroll 16
            for (int v = 0; v < NVG; v++)
                acc[v][ch] = vf_dot_pairs(acc[v][ch], qp[v * DMAX + i], k);
        }
        pf_tick(pf);
    }
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int ch = 0; ch < NCH; ch++)
            vf_store(s + (v * SPAN + ch) * 16, vf_mul(acc[v][ch], vf_set1(sc)));
}

SB_INLINE void values_blk_pairs(const int NVG, const int NDB, float* acc, int d,
                                const uint32_t* pp, const char* const* vb, long rs, const int* n,
                                int nch, int i0, pf_t* pf) {
    vf ev[VGMAX][4], od[VGMAX][4];
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int u = 0; u < NDB; u++) {
            ev[v][u] = vf_load(acc + v * d + i0 + 16 * u);
            od[v][u] = vf_zero();
        }
    for (int ch = 0; ch < nch; ch++) {
        const uint32_t* pc = pp + ch * 8;
        const int full = n[ch] / 2;
        int jj = 0;
        for (; jj + 1 < full; jj += 2) {
#pragma GCC unroll 4
            for (int u = 0; u < NDB; u++) {
                const char* x = vb[ch] + jj * rs + (i0 + 16 * u) * 4;
                bpairs x0 = bpairs_load((const uint16_t*)x, 0xffff);
                bpairs x1 = bpairs_load((const uint16_t*)(x + rs), 0xffff);
#pragma GCC unroll 16
                for (int v = 0; v < NVG; v++) {
                    ev[v][u] = vf_dot_pairs(ev[v][u], pc[v * SPAN * 8 + jj], x0);
                    od[v][u] = vf_dot_pairs(od[v][u], pc[v * SPAN * 8 + jj + 1], x1);
                }
            }
            pf_tick(pf);
            pf_tick(pf);
        }
        for (; jj < (n[ch] + 1) / 2; jj++) { /* an even pair, or the last key without partner */
            const int whole = jj < full;
#pragma GCC unroll 4
            for (int u = 0; u < NDB; u++) {
                const uint16_t* x = (const uint16_t*)(vb[ch] + jj * rs + (i0 + 16 * u) * 4);
                bpairs x0 = whole ? bpairs_load(x, 0xffff) : bpairs_load_low(x);
#pragma GCC unroll 16
                for (int v = 0; v < NVG; v++) {
                    if (jj & 1)
                        od[v][u] = vf_dot_pairs(od[v][u], pc[v * SPAN * 8 + jj], x0);
                    else
                        ev[v][u] = vf_dot_pairs(ev[v][u], pc[v * SPAN * 8 + jj], x0);
                }
            }
            pf_tick(pf);
        }
    }
#pragma GCC unroll 16
    for (int v = 0; v < NVG; v++)
#pragma GCC unroll 4
        for (int u = 0; u < NDB; u++)
            vf_store(acc + v * d + i0 + 16 * u, vf_add(ev[v][u], od[v][u]));
}

/* the largest width a group of nvg vectors takes that fits in `left` */
SB_INLINE int fit_width(int nvg, int left) {
    int w = WIDTH(nvg);
    while (w > left) w /= 2;
    return w;
}

SB_INLINE void scores_span(int nv, int nch, const float* qw0, int d, const char* const* kb0,
                           long rs, const vmask* km0, float sc, float* s0, pf_t* pf,
                           const int bf16) {
    const int pairs = PAIRS && bf16;
    const int groups = (nv + VGMAX - 1) / VGMAX;
    for (int g = 0, v0 = 0; g < groups; g++) {
        const int nvg = (nv - v0) / (groups - g);
        for (int ch0 = 0; ch0 < nch;) {
            const int w = fit_width(nvg, nch - ch0);
            const float* qw = qw0 + v0 * DMAX;
            const char* const* kb = kb0 + ch0;
            const vmask* km = km0 + ch0;
            float* s = s0 + (v0 * SPAN + ch0) * 16;
            BY_GROUP(SC, nvg, w);
            ch0 += w;
        }
        v0 += nvg;
    }
}

SB_INLINE void values_span(int nv, int nch, float* acc0, int d, const float* p0,
                           const uint32_t* pp0, const char* const* vb, long rs, const int* n,
                           pf_t* pf, const int bf16) {
    const int pairs = PAIRS && bf16;
    const int groups = (nv + VGMAX - 1) / VGMAX;
    for (int g = 0, v0 = 0; g < groups; g++) {
        const int nvg = (nv - v0) / (groups - g);
        for (int i0 = 0; i0 < d;) {
            const int w = fit_width(nvg, (d - i0) / 16);
            float* acc = acc0 + v0 * d;
            const float* p = p0 + v0 * SPAN * 16;
            const uint32_t* pp = pp0 + v0 * SPAN * 8;
            BY_GROUP(VA, nvg, w);
            i0 += 16 * w;
        }
        v0 += nvg;
    }
}

/* the pf_ticks of scores_span and values_span on one kv head */
SB_INLINE long span_ticks(int nv, int nch, const int* n, int d) {
    const int groups = (nv + VGMAX - 1) / VGMAX;
    int keypairs = 0;
    for (int ch = 0; ch < nch; ch++) keypairs += (n[ch] + 1) / 2;
    long t = 0;
    for (int g = 0, v0 = 0; g < groups; g++) {
        const int nvg = (nv - v0) / (groups - g);
        for (int ch0 = 0; ch0 < nch; ch0 += fit_width(nvg, nch - ch0)) t += d / 2;
        for (int i0 = 0; i0 < d; i0 += 16 * fit_width(nvg, (d - i0) / 16)) t += keypairs;
        v0 += nvg;
    }
    return t;
}

/* 2^x for x <= 0, about 1e-7 relative (a degree-7 polynomial on the fraction in [-1/2, 1/2]),
 * 0 below -127. */
SB_INLINE vf exp2_neg(vf x) {
    x = vf_max(x, vf_set1(-127.0f));
    vf n = vf_round(x);
    vf f = vf_sub(x, n);
    vf p = vf_set1(1.5252733804059840e-5f); /* ln(2)^k / k!, k = 7 .. 0 */
    p = vf_fma(p, f, vf_set1(1.5403530393381606e-4f));
    p = vf_fma(p, f, vf_set1(1.3333558146428443e-3f));
    p = vf_fma(p, f, vf_set1(9.6181291076284772e-3f));
    p = vf_fma(p, f, vf_set1(5.5504108664821580e-2f));
    p = vf_fma(p, f, vf_set1(2.4022650695910071e-1f));
    p = vf_fma(p, f, vf_set1(6.9314718055994531e-1f));
    p = vf_fma(p, f, vf_set1(1.0f));
    return vf_scale2(p, n);
}

/* Scores (in log2 units) of a span -> probabilities in place (0 where a vector does not see a
 * key; with pp, also as bfloat16 pairs), with the running max mx, the lane-wise running sums ls
 * and the accumulators acc of every vector. */
SB_INLINE void softmax_span(int nv, int nch, float* s, uint32_t* pp, const vmask (*vm)[SPAN],
                            float* mx, float* ls, float* acc, int d) {
    for (int v = 0; v < nv; v++) {
        float* sv = s + v * SPAN * 16;
        vmask any = 0;
        for (int ch = 0; ch < nch; ch++) any |= vm[v][ch];
        if (!any) {
            for (int ch = 0; ch < nch; ch++) {
                vf_store(sv + ch * 16, vf_zero());
                if (pp) memset(pp + (v * SPAN + ch) * 8, 0, 32);
            }
            continue;
        }
        vf m = vf_set1(-INFINITY);
        for (int ch = 0; ch < nch; ch++)
            m = vf_max(m, vf_select(vm[v][ch], vf_load(sv + ch * 16), vf_set1(-INFINITY)));
        const float m_new = vf_maxval(m);
        vf l = vf_load(ls + v * 16);
        if (m_new > mx[v]) {
            if (mx[v] != -INFINITY) {
                vf corr = vf_set1(exp2f(mx[v] - m_new));
                l = vf_mul(l, corr);
                for (int i = 0; i < d; i += 16)
                    vf_store(acc + v * d + i, vf_mul(vf_load(acc + v * d + i), corr));
            }
            mx[v] = m_new;
        }
        const vf mv = vf_set1(mx[v]);
        for (int ch = 0; ch < nch; ch++) {
            vf pv = vf_select(vm[v][ch], exp2_neg(vf_sub(vf_load(sv + ch * 16), mv)), vf_zero());
            l = vf_add(l, pv);
            vf_store(sv + ch * 16, pv);
            if (pp) _mm256_storeu_si256((__m256i*)(pp + (v * SPAN + ch) * 8), f32x16_to_bf16(pv));
        }
        vf_store(ls + v * 16, l);
    }
}

/* ---- one work item ---------------------------------------------------------------------------- */

/* Scratch floats of one thread for items of up to nh kv heads. */
SB_INLINE long scratch_floats(int nh, int d) {
    return (long)nh * QT * (DMAX + d + 32) + QT * SPAN * (16 + 8);
}

SB_INLINE void run_item(const attn_args* a, const item_t* it, float* ws, pf_t* pf,
                        const int bf16) {
    const int esz = bf16 ? 2 : 4, d = a->d, G = a->hq / a->hkv, nh = it->h1 - it->h0;
    const int pairs = PAIRS && bf16;
    const int nv = it->nv, b = it->b;
    const long row0 = a->qsl[b];
    float* qw = ws; /* [nh][QT][DMAX]: q times scale * log2(e); pairs: q's pairs */
    float* acc = qw + (long)nh * QT * DMAX; /* [nh][QT][d] */
    float* ls = acc + (long)nh * QT * d;   /* [nh][QT][16] */
    float* mx = ls + (long)nh * QT * 16;   /* [nh][QT] (padded to 16) */
    float* s = mx + (long)nh * QT * 16;    /* [QT][SPAN][16] */
    uint32_t* pp = pairs ? (uint32_t*)(s + QT * SPAN * 16) : NULL; /* [QT][SPAN][8] */
    vis_t vis;
    vis.ctx = seq_ctx(a, b);
    for (int v = 0; v < nv; v++) row_vis(a, b, (it->v0 + v) / G, &vis.vend[v], &vis.tm[v]);
    const float sc = a->scale * 1.44269504088896341f;
    const vf scale = vf_set1(sc);
    for (int h = 0; h < nh; h++)
        for (int v = 0; v < nv; v++) {
            const int r = (it->v0 + v) / G, head = (it->h0 + h) * G + (it->v0 + v) % G;
            const char* qr = a->q + ((row0 + r) * a->ldq + (long)head * d) * esz;
            float* qv = qw + ((long)h * QT + v) * DMAX;
            float* av = acc + ((long)h * QT + v) * d;
            if (pairs) memcpy(qv, qr, (size_t)d * 2);
            for (int i = 0; i < d; i += 16) {
                if (!pairs) vf_store(qv + i, vf_mul(load16(qr + (long)i * esz, 0xffff, bf16), scale));
                vf_store(av + i, vf_zero());
            }
            vf_store(ls + ((long)h * QT + v) * 16, vf_zero());
            mx[h * QT + v] = -INFINITY;
        }
    const int64_t* bt = a->block_tables + (long)b * a->bt_stride;
    const int total = num_chunks(a->bs, it->kend);
    const long krs = (long)a->bs * 4, vrs = (long)d * 4; /* bytes between key / value rows */
    for (int ci0 = 0; ci0 < total; ci0 += SPAN) {
        const int nch = total - ci0 < SPAN ? total - ci0 : SPAN;
        chunk_t ck[SPAN];
        vmask vm[QT][SPAN], km[SPAN];
        int n[SPAN];
        for (int ch = 0; ch < nch; ch++) {
            ck[ch] = chunk_at(a, bt, ci0 + ch, it->kend);
            n[ch] = ck[ch].n;
            km[ch] = lanes(n[ch]);
            for (int v = 0; v < nv; v++)
                vm[v][ch] = chunk_mask(vis.ctx, vis.vend[v], vis.tm[v], ck[ch].pos, n[ch]);
        }
        pf_next(pf, nh * span_ticks(nv, nch, n, d));
        for (int h = 0; h < nh; h++) {
            const char* kb[SPAN];
            const char* vb[SPAN];
            for (int ch = 0; ch < nch; ch++) {
                const long base = ck[ch].phys * a->hkv + it->h0 + h;
                kb[ch] = a->k_cache + base * a->k_bytes + (long)ck[ch].c * 4;
                vb[ch] = a->v_cache + base * a->v_bytes + (long)ck[ch].c * d * esz;
            }
            float* acc_h = acc + (long)h * QT * d;
            scores_span(nv, nch, qw + (long)h * QT * DMAX, d, kb, krs, km, sc, s, pf, bf16);
            softmax_span(nv, nch, s, pp, (const vmask(*)[SPAN])vm, mx + h * QT,
                         ls + (long)h * QT * 16, acc_h, d);
            values_span(nv, nch, acc_h, d, s, pp, vb, vrs, n, pf, bf16);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int v = 0; v < nv; v++) {
            const int r = (it->v0 + v) / G, head = (it->h0 + h) * G + (it->v0 + v) % G;
            char* orow = a->out + ((row0 + r) * a->hq + head) * (long)d * esz;
            const float* av = acc + ((long)h * QT + v) * d;
            const vf inv = vf_set1(1.0f / vf_sum(vf_load(ls + ((long)h * QT + v) * 16)));
            for (int i = 0; i < d; i += 16)
                store16(orow + (long)i * esz, 0xffff, vf_mul(vf_load(av + i), inv), bf16);
        }
}

/* ---- the call ------------------------------------------------------------------------------- */

static int item_kend(const attn_args* a, int b, int v0, int nv) {
    const int G = a->hq / a->hkv, ctx = seq_ctx(a, b);
    int kend = 0;
    for (int r = v0 / G; r <= (v0 + nv - 1) / G; r++) {
        int vend;
        uint64_t tm;
        row_vis(a, b, r, &vend, &tm);
        int e = vis_end(ctx, vend, tm);
        if (e > kend) kend = e;
    }
    return kend;
}

/* Items lo .. hi - 1 of work, on one thread (a function per dtype: the parallel region's body
 * is outlined before constants propagate into it). */
SB_INLINE void run_items(const attn_args* a, const item_t* work, int lo, int hi, int per,
                         const int bf16) {
    float* ws = (float*)aligned_alloc(64, (size_t)scratch_floats(per, a->d) * 4);
    pf_t pf = {.a = a, .items = work, .item = lo, .end = hi, .ci = 0};
    for (int s = 0; s < PF_AHEAD; s++) pf_next(&pf, 1);
    for (int i = lo; i < hi; i++) run_item(a, &work[i], ws, &pf, bf16);
    free(ws);
}

static void run_items_f32(const attn_args* a, const item_t* work, int lo, int hi, int per) {
    run_items(a, work, lo, hi, per, 0);
}

static void run_items_bf16(const attn_args* a, const item_t* work, int lo, int hi, int per) {
    run_items(a, work, lo, hi, per, 1);
}

static void attention_impl(const attn_args* a, int num_seqs, const int bf16) {
    const int G = a->hq / a->hkv, esz = bf16 ? 2 : 4;
    const int threads = omp_get_max_threads();
    /* kv heads per item: a span's keys and values about ITEM_SPAN_BYTES, and enough items for
     * the threads */
    long head_span = (long)SPAN * 16 * a->d * esz * 2;
    int per = (int)(ITEM_SPAN_BYTES / head_span);
    per = per < 1 ? 1 : per > a->hkv ? a->hkv : per;
    int groups = (a->hkv + per - 1) / per, tiles = 0;
    for (int b = 0; b < num_seqs; b++)
        tiles += ((int)(a->qsl[b + 1] - a->qsl[b]) * G + QT - 1) / QT;
    if (tiles * groups < threads && groups < a->hkv) {
        groups *= (threads + tiles * groups - 1) / (tiles * groups);
        if (groups > a->hkv) groups = a->hkv;
    }
    per = (a->hkv + groups - 1) / groups;
    groups = (a->hkv + per - 1) / per;
    const int items = tiles * groups;
    if (items == 0) return;
    item_t* work = (item_t*)malloc(sizeof(item_t) * (size_t)items);
    long* weight = (long*)malloc(sizeof(long) * ((size_t)items + 1));
    int it = 0;
    weight[0] = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int nvec = (int)(a->qsl[b + 1] - a->qsl[b]) * G;
        for (int v0 = 0; v0 < nvec; v0 += QT) {
            const int nv = nvec - v0 < QT ? nvec - v0 : QT, kend = item_kend(a, b, v0, nv);
            for (int g = 0; g < groups; g++) {
                const int h0 = g * per, h1 = h0 + per < a->hkv ? h0 + per : a->hkv;
                work[it] = (item_t){b, v0, nv, h0, h1, kend};
                weight[it + 1] = weight[it] + (long)num_chunks(a->bs, kend) * (h1 - h0) * (nv + 4);
                it++;
            }
        }
    }
    const int nthr = threads < items ? threads : items;
    /* thread t runs items bound(t) .. bound(t + 1) - 1: consecutive, of about equal weight */
#pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int lo = 0, hi = 0;
        for (int i = 0; i <= items; i++) {
            if (weight[i] * nt < weight[items] * t) lo = i + 1;
            if (weight[i] * nt < weight[items] * (t + 1)) hi = i + 1;
        }
        if (t == nt - 1) hi = items;
        if (lo < hi) {
            if (bf16)
                run_items_bf16(a, work, lo, hi, per);
            else
                run_items_f32(a, work, lo, hi, per);
        }
    }
    free(weight);
    free(work);
}

int sb_attention_max_head_dim(void) { return DMAX; }

int sb_attention_tree_rows(void) { return TREE_ROWS; }

void sb_paged_attention(int num_seqs, const int64_t* qsl, const int64_t* seq_lens,
                        const int64_t* block_tables, long bt_stride, const void* q, long ldq,
                        int hq, int hkv, int d, const void* k_cache, const void* v_cache,
                        int block_size, float scale, void* out, const uint64_t* tree, int bf16) {
    const int esz = bf16 ? 2 : 4;
    attn_args a = {qsl, seq_lens, block_tables, bt_stride, (const char*)q, ldq, hq, hkv, d,
                   block_size, (const char*)k_cache, (const char*)v_cache, scale, (char*)out,
                   tree, (long)d * block_size * esz, (long)d * (block_size + (block_size & 1)) * esz};
    attention_impl(&a, num_seqs, bf16);
}
