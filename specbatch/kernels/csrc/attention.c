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
 * context, keys 0 .. seq_len - q_len - 1, and of the new tokens 0 .. i (causal, the default).
 * A draft tree replaces that rule for its sequence: given its first key t (tree_starts) and a
 * 64-bit mask per row, the row sees keys 0 .. t - 1 and the keys t + j whose bit j is set (a
 * tree of at most 64 keys; a longer one is causal).
 *
 * One work item is one sequence's tile of up to QT query vectors (its rows times the heads that
 * share a kv head) over a group of kv heads: the item walks the sequence's keys once, SPAN
 * chunks of up to 16 keys at a time (a chunk lies inside one block), and for each kv head of
 * the group computes every vector's scores on the chunks while they sit in L1, one running-max
 * update per span (online softmax in float32, in powers of 2: q carries scale * log2(e)), then
 * the weighted values (attn_span.h). The keys and values of the span PF_AHEAD spans ahead,
 * across items, go to L2 a few lines at a time from the kernels' inner loops (attn_plan.h),
 * since the pool hands blocks out in any order and no hardware prefetcher sees them coming,
 * and prefetches issued in bursts stall the core on its fill buffers.
 *
 * Batch invariance: every vector's sums run in one order fixed by the positions alone (per
 * lane, even and odd dimensions of a score in two sums added at the end; even and odd keys of
 * a span's weighted values in two sums added into the accumulator at the span's end; one max
 * per span), whatever the other vectors of its tile, the tile's extent or the thread. Keys a
 * vector does not see enter with probability exactly 0, and only written keys are ever read. */
#include <omp.h>
#include <stdlib.h>

#include "attn_plan.h"
#include "attn_span.h"
#include "kernels.h"

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
    vis.ctx = mask_base(a, b);
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
    const int G = a->hq / a->hkv, ctx = mask_base(a, b);
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
                        int block_size, float scale, void* out, const uint64_t* tree,
                        const int64_t* tree_starts, int bf16) {
    const int esz = bf16 ? 2 : 4;
    attn_args a = {qsl, seq_lens, block_tables, bt_stride, (const char*)q, ldq, hq, hkv, d,
                   block_size, (const char*)k_cache, (const char*)v_cache, scale, (char*)out,
                   tree, tree_starts, (long)d * block_size * esz,
                   (long)d * (block_size + (block_size & 1)) * esz};
    attention_impl(&a, num_seqs, bf16);
}
