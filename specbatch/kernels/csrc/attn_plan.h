/* attention.c's plan of a call: its arguments, work items, which keys each query vector sees,
 * the chunks of keys an item walks, and the prefetch cursor that runs ahead of them. */
#ifndef SPECBATCH_ATTN_PLAN_H
#define SPECBATCH_ATTN_PLAN_H

#include "common.h"

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
    const uint64_t* tree;        /* per row: its mask over the keys from its tree's start */
    const int64_t* tree_starts;  /* per sequence: the first key of its tree, -1: causal */
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

/* a tree: its first key (keys before it are visible, from it on by the row's bits), or -1 */
SB_INLINE int tree_start(const attn_args* a, int b) {
    if (!a->tree || !a->tree_starts || a->tree_starts[b] < 0) return -1;
    return a->seq_lens[b] - a->tree_starts[b] <= TREE_ROWS ? (int)a->tree_starts[b] : -1;
}

/* where a sequence's mask bits start: its tree's first key, else its first new token */
SB_INLINE int mask_base(const attn_args* a, int b) {
    int t = tree_start(a, b);
    return t >= 0 ? t : seq_ctx(a, b);
}

SB_INLINE void row_vis(const attn_args* a, int b, int r, int* vend, uint64_t* tm) {
    const long row0 = a->qsl[b];
    const int t = tree_start(a, b);
    if (t >= 0) { /* bits past the sequence's keys are dropped */
        const int span = (int)(a->seq_lens[b] - t);
        *vend = t;
        *tm = span < 64 ? a->tree[row0 + r] & ((1ull << span) - 1) : a->tree[row0 + r];
    } else {
        *vend = seq_ctx(a, b) + r + 1;
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

#endif
