/* Attention over the paged KV cache for a ragged batch: prompts, prompt chunks, one-token
 * decodes and (gamma + 1)-token verifications in one call, reading keys and values in place
 * through each sequence's block table (nothing is gathered into a temporary).
 *
 * Cache layout (this backend's own), per block and kv head: in float32, keys [d][block_size]
 * and values [block_size][d], so 16 consecutive keys of a block are one vector lane-wise and
 * their scores need no horizontal sums; in bfloat16 the same with pairs in 32-bit lanes, keys
 * [d / 2][block_size][2] (dimensions 2i and 2i + 1 of a key side by side) and values
 * [block_size / 2][d][2] (keys 2j and 2j + 1 of a dimension side by side), so that q . k and
 * p . v take two products a lane per instruction (AVX512-BF16's dot product; elsewhere two
 * FMAs), p rounded to bfloat16 for the second as on GPUs. The value rows of a block are padded
 * to an even count. Query row i of a sequence with q_len new tokens and seq_len positions sees
 * keys 0 .. seq_len - q_len + i. The query heads that share a kv head are processed together
 * (up to 16 query vectors a tile), each key block loaded once a tile. Softmax is the online
 * (streaming) form, in float32. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"

#define QT 16   /* query vectors per tile */
#define DMAX 256
/* A call that reads more keys and values than this (about a core's L2) prefetches each work
 * item's during the one before; below it they mostly come from the caches, and prefetches
 * only cost instructions. A thread's first item, up to PREFETCH_BLOCKS blocks of it, is
 * prefetched as it starts. */
#define PREFETCH_MIN_BYTES (3L << 18)
#define PREFETCH_BLOCKS 16

typedef struct {
    const int64_t* qsl;
    const int64_t* seq_lens;
    const int64_t* block_tables;
    long bt_stride;
    const char* q;
    long ldq;
    int hq, hkv, d, block_size;
    const char* k_cache;
    const char* v_cache;
    float scale;
    char* out;
} attn_args;

/* Query vectors per group and partial sums per vector: sized to the registers (32 on AVX-512,
 * 16 on AVX2, where a vf takes two). */
#if SB_WIDE
#define VG 4
#define PARTS 4
#else
#define VG 2
#define PARTS 2
#endif

/* float32 scores s[v][lane] = q_v . key(c + lane) for NV query vectors and 16 keys of a block,
 * VG vectors at a time with PARTS partial sums each (enough independent FMA chains in flight).
 * Every vector's sums run in the same order whatever NV is: a score does not depend on which
 * other query vectors share its tile. */
SB_INLINE void scores(const int NV, const float* qv, const float* kb, int c, int bs, int d,
                      vmask km, vf* s) {
    for (int v0 = 0; v0 < NV; v0 += VG) {
        vf part[VG][PARTS];
        for (int v = 0; v < VG; v++)
            for (int u = 0; u < PARTS; u++) part[v][u] = vf_zero();
        for (int i = 0; i < d; i += PARTS) {
            for (int u = 0; u < PARTS; u++) {
                vf kd = load16(kb + (long)(i + u) * bs + c, km, 0);
                for (int v = 0; v < VG; v++)
                    if (v0 + v < NV)
                        part[v][u] = vf_fma(vf_set1(qv[(v0 + v) * DMAX + i + u]), kd, part[v][u]);
            }
        }
        for (int v = 0; v < VG; v++) {
            if (v0 + v >= NV) continue;
            vf sum = vf_add(part[v][0], part[v][1]);
#if PARTS == 4
            sum = vf_add(sum, vf_add(part[v][2], part[v][3]));
#endif
            s[v0 + v] = sum;
        }
    }
}

/* float32 acc[v] += sum_j p[v][j] * value(c + j), j < n: up to VG vectors at once, even and
 * odd keys in separate sums, every value row loaded once per group of vectors. */
SB_INLINE void add_values(const int NV, float* acc, const float (*p)[16], const float* vb, int c,
                          int n, int d) {
    for (int i = 0; i < d; i += 16) {
        for (int v0 = 0; v0 < NV; v0 += VG) {
            vf a[VG][2];
            for (int u = 0; u < VG; u++)
                if (v0 + u < NV) {
                    a[u][0] = vf_load(acc + (v0 + u) * DMAX + i);
                    a[u][1] = vf_zero();
                }
            int j = 0;
            for (; j + 1 < n; j += 2) {
                vf x0 = vf_loadu(vb + (long)(c + j) * d + i);
                vf x1 = vf_loadu(vb + (long)(c + j + 1) * d + i);
                for (int u = 0; u < VG; u++)
                    if (v0 + u < NV) {
                        a[u][0] = vf_fma(vf_set1(p[v0 + u][j]), x0, a[u][0]);
                        a[u][1] = vf_fma(vf_set1(p[v0 + u][j + 1]), x1, a[u][1]);
                    }
            }
            if (j < n) {
                vf x0 = vf_loadu(vb + (long)(c + j) * d + i);
                for (int u = 0; u < VG; u++)
                    if (v0 + u < NV)
                        a[u][0] = vf_fma(vf_set1(p[v0 + u][j]), x0, a[u][0]);
            }
            for (int u = 0; u < VG; u++)
                if (v0 + u < NV)
                    vf_store(acc + (v0 + u) * DMAX + i, vf_add(a[u][0], a[u][1]));
        }
    }
}

/* The bfloat16 forms of scores() (unscaled q pairs; the sums times `scale`) and add_values()
 * (p as bfloat16 pairs, pp[v][j] = keys c + 2j and c + 2j + 1), on the paired layouts. */
SB_INLINE void scores_bf16(const int NV, const uint32_t* qp, const uint16_t* kb, int c, int bs,
                           int d, vmask km, float scale, vf* s) {
    for (int v0 = 0; v0 < NV; v0 += VG) {
        vf part[VG][PARTS];
        for (int v = 0; v < VG; v++)
            for (int u = 0; u < PARTS; u++) part[v][u] = vf_zero();
        for (int i = 0; i < d / 2; i += PARTS) {
            for (int u = 0; u < PARTS; u++) {
                bpairs kd = bpairs_load(kb + ((long)(i + u) * bs + c) * 2, km);
                for (int v = 0; v < VG; v++)
                    if (v0 + v < NV)
                        part[v][u] =
                            vf_dot_pairs(part[v][u], qp[(v0 + v) * (DMAX / 2) + i + u], kd);
            }
        }
        for (int v = 0; v < VG; v++) {
            if (v0 + v >= NV) continue;
            vf sum = vf_add(part[v][0], part[v][1]);
#if PARTS == 4
            sum = vf_add(sum, vf_add(part[v][2], part[v][3]));
#endif
            s[v0 + v] = vf_mul(sum, vf_set1(scale));
        }
    }
}

SB_INLINE void add_values_bf16(const int NV, float* acc, const uint32_t (*pp)[8],
                               const uint16_t* vb, int c, int n, int d) {
    const int full = n / 2;
    for (int i = 0; i < d; i += 16) {
        for (int v0 = 0; v0 < NV; v0 += VG) {
            vf a[VG][2];
            for (int u = 0; u < VG; u++)
                if (v0 + u < NV) {
                    a[u][0] = vf_load(acc + (v0 + u) * DMAX + i);
                    a[u][1] = vf_zero();
                }
            int j = 0;
            for (; j + 1 < full; j += 2) {
                bpairs x0 = bpairs_load(vb + ((long)(c / 2 + j) * d + i) * 2, 0xffff);
                bpairs x1 = bpairs_load(vb + ((long)(c / 2 + j + 1) * d + i) * 2, 0xffff);
                for (int u = 0; u < VG; u++)
                    if (v0 + u < NV) {
                        a[u][0] = vf_dot_pairs(a[u][0], pp[v0 + u][j], x0);
                        a[u][1] = vf_dot_pairs(a[u][1], pp[v0 + u][j + 1], x1);
                    }
            }
            if (j < full) {
                bpairs x0 = bpairs_load(vb + ((long)(c / 2 + j) * d + i) * 2, 0xffff);
                for (int u = 0; u < VG; u++)
                    if (v0 + u < NV) a[u][0] = vf_dot_pairs(a[u][0], pp[v0 + u][j], x0);
            }
            if (n & 1) { /* the last key's partner slot may never have been written */
                bpairs x1 = bpairs_load_low(vb + ((long)(c / 2 + full) * d + i) * 2);
                for (int u = 0; u < VG; u++)
                    if (v0 + u < NV) a[u][1] = vf_dot_pairs(a[u][1], pp[v0 + u][full], x1);
            }
            for (int u = 0; u < VG; u++)
                if (v0 + u < NV)
                    vf_store(acc + (v0 + u) * DMAX + i, vf_add(a[u][0], a[u][1]));
        }
    }
}

SB_INLINE void prefetch_block(const char* p, long bytes) {
    for (long off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* Blocks j0 .. j1 - 1 of sequence b's keys and values of kv head kvh, asked for into L2: the
 * next work item's, a share at each block of the item computing now, since its blocks lie
 * anywhere in the pool and the hardware prefetchers cannot see them coming. */
SB_INLINE void prefetch_blocks(const attn_args* a, int b, int kvh, int j0, int j1, const int bf16) {
    const int esz = bf16 ? 2 : 4, bs = a->block_size;
    const long k_bytes = (long)a->d * bs * esz, v_bytes = (long)a->d * (bs + (bs & 1)) * esz;
    const int64_t* bt = a->block_tables + (long)b * a->bt_stride;
    const int nblk = (int)((a->seq_lens[b] + bs - 1) / bs);
    for (int j = j0; j < j1 && j < nblk; j++) {
        const char* kb = a->k_cache + (bt[j] * a->hkv + kvh) * k_bytes;
        const char* vb = a->v_cache + (bt[j] * a->hkv + kvh) * v_bytes;
        for (long off = 0; off < k_bytes; off += 64) _mm_prefetch(kb + off, _MM_HINT_T1);
        for (long off = 0; off < v_bytes; off += 64) _mm_prefetch(vb + off, _MM_HINT_T1);
    }
}

/* One work item: query vectors v0 .. v0 + nv - 1 of sequence b's kv head kvh. `next` is the
 * item this thread runs next, {b, kvh}, or b = -1 when its blocks are not to be prefetched. */
SB_INLINE void tile(const int NV, const attn_args* a, int b, int kvh, int v0, int nv,
                    const int next[2], const int bf16) {
    const int esz = bf16 ? 2 : 4;
    const int G = a->hq / a->hkv, d = a->d, bs = a->block_size;
    const long row0 = a->qsl[b];
    const int q_len = (int)(a->qsl[b + 1] - row0);
    const int ctx = (int)a->seq_lens[b] - q_len;
    float qv[QT * DMAX] __attribute__((aligned(64)));   /* float32: q * scale */
    uint32_t qp[QT * DMAX / 2] __attribute__((aligned(64)));  /* bfloat16: q's pairs */
    float acc[QT * DMAX] __attribute__((aligned(64)));
    float mx[QT], l[QT];
    int vis[QT];
    int kend = 0;
    for (int v = 0; v < NV; v++) {
        mx[v] = -INFINITY;
        l[v] = 0.0f;
        int vv = v0 + (v < nv ? v : nv - 1);
        int r = vv / G, h = kvh * G + vv % G;
        vis[v] = v < nv ? ctx + r + 1 : 0;
        if (vis[v] > kend) kend = vis[v];
        const char* qr = a->q + ((row0 + r) * a->ldq + (long)h * d) * esz;
        if (bf16) memcpy(qp + v * (DMAX / 2), qr, (size_t)d * 2);
        for (int i = 0; i < d; i += 16) {
            if (!bf16) {
                vf x = vf_mul(load16(qr + (long)i * esz, 0xffff, 0), vf_set1(a->scale));
                vf_store(qv + v * DMAX + i, x);
            }
            vf_store(acc + v * DMAX + i, vf_zero());
        }
    }
    const int64_t* bt = a->block_tables + (long)b * a->bt_stride;
    const long k_elems = (long)d * bs, v_elems = (long)d * (bs + (bs & 1));
    const int nblk = (kend + bs - 1) / bs;
    const int next_blocks = next[0] < 0 ? 0 : (int)((a->seq_lens[next[0]] + bs - 1) / bs);
    const int next_share = (next_blocks + nblk - 1) / nblk; /* its blocks per block of this one */
    for (int start = 0; start < kend; start += bs) {
        long phys = bt[start / bs];
        if (next_share) {
            int j = start / bs * next_share;
            prefetch_blocks(a, next[0], next[1], j, j + next_share, bf16);
        }
        const char* kb = a->k_cache + ((phys * a->hkv + kvh) * k_elems) * esz;
        const char* vb = a->v_cache + ((phys * a->hkv + kvh) * v_elems) * esz;
        if (start == 0 && bs < kend) { /* the first two blocks are fetched together */
            long next = bt[1];
            prefetch_block(a->k_cache + ((next * a->hkv + kvh) * k_elems) * esz, k_elems * esz);
            prefetch_block(a->v_cache + ((next * a->hkv + kvh) * v_elems) * esz, v_elems * esz);
        }
        if (start + 2 * bs < kend) {
            long next = bt[start / bs + 2];
            prefetch_block(a->k_cache + ((next * a->hkv + kvh) * k_elems) * esz, k_elems * esz);
            prefetch_block(a->v_cache + ((next * a->hkv + kvh) * v_elems) * esz, v_elems * esz);
        }
        for (int c = 0; c < bs && start + c < kend; c += 16) {
            int n = bs - c < 16 ? bs - c : 16;
            if (kend - (start + c) < n) n = kend - (start + c);
            vf s[QT];
            if (bf16)
                scores_bf16(NV, qp, (const uint16_t*)kb, c, bs, d, lanes(n), a->scale, s);
            else
                scores(NV, qv, (const float*)kb, c, bs, d, lanes(n), s);
            float p[QT][16] __attribute__((aligned(64)));
            uint32_t pp[QT][8] __attribute__((aligned(64)));
            for (int v = 0; v < NV; v++) {
                int seen = vis[v] - (start + c);
                vmask vm = lanes(seen < 0 ? 0 : seen) & lanes(n);
                if (!vm) {
                    vf_store(p[v], vf_zero());
                    if (bf16) memset(pp[v], 0, sizeof pp[v]);
                    continue;
                }
                vf sv = vf_select(vm, s[v], vf_set1(-INFINITY));
                float m_new = vf_maxval(sv);
                if (m_new > mx[v]) {
                    float corr = mx[v] == -INFINITY ? 0.0f : expf(mx[v] - m_new);
                    l[v] *= corr;
                    vf vc = vf_set1(corr);
                    for (int i = 0; i < d; i += 16)
                        vf_store(acc + v * DMAX + i, vf_mul(vf_load(acc + v * DMAX + i), vc));
                    mx[v] = m_new;
                }
                vf pv = vf_select(vm, exp16(vf_sub(sv, vf_set1(mx[v]))), vf_zero());
                l[v] += vf_sum(pv);
                if (bf16)
                    _mm256_store_si256((__m256i*)pp[v], f32x16_to_bf16(pv));
                else
                    vf_store(p[v], pv);
            }
            if (bf16)
                add_values_bf16(NV, acc, (const uint32_t (*)[8])pp, (const uint16_t*)vb, c, n, d);
            else
                add_values(NV, acc, (const float (*)[16])p, (const float*)vb, c, n, d);
        }
    }
    for (int v = 0; v < nv; v++) {
        int vv = v0 + v;
        int r = vv / G, h = kvh * G + vv % G;
        char* orow = a->out + (((row0 + r) * a->hq + h) * (long)d) * esz;
        vf inv = vf_set1(1.0f / l[v]);
        for (int i = 0; i < d; i += 16)
            store16(orow + (long)i * esz, 0xffff, vf_mul(vf_load(acc + v * DMAX + i), inv), bf16);
    }
}

SB_INLINE void run_tile(const attn_args* a, int b, int kvh, int v0, int nv, const int next[2],
                        const int bf16) {
    switch (nv) {
        case 1: tile(1, a, b, kvh, v0, nv, next, bf16); break;
        case 2: tile(2, a, b, kvh, v0, nv, next, bf16); break;
        case 3: tile(3, a, b, kvh, v0, nv, next, bf16); break;
        case 4: tile(4, a, b, kvh, v0, nv, next, bf16); break;
        case 5: case 6: tile(6, a, b, kvh, v0, nv, next, bf16); break;
        case 7: case 8: tile(8, a, b, kvh, v0, nv, next, bf16); break;
        case 9: case 10: case 11: case 12: tile(12, a, b, kvh, v0, nv, next, bf16); break;
        default: tile(16, a, b, kvh, v0, nv, next, bf16); break;
    }
}

SB_INLINE void attention_impl(const attn_args* a, int num_seqs, const int bf16) {
    const int G = a->hq / a->hkv;
    /* one work item per (sequence, kv head, tile of query vectors) */
    int items = 0;
    long kv_bytes = 0;
    for (int b = 0; b < num_seqs; b++) {
        int nvec = (int)(a->qsl[b + 1] - a->qsl[b]) * G;
        items += a->hkv * ((nvec + QT - 1) / QT);
        kv_bytes += a->seq_lens[b] * a->hkv * a->d * 2 * (bf16 ? 2 : 4);
    }
    const int prefetch = kv_bytes > PREFETCH_MIN_BYTES;
    int* work = (int*)malloc(sizeof(int) * 3 * (size_t)(items > 0 ? items : 1));
    int it = 0;
    for (int b = 0; b < num_seqs; b++) {
        int nvec = (int)(a->qsl[b + 1] - a->qsl[b]) * G;
        for (int kvh = 0; kvh < a->hkv; kvh++)
            for (int v0 = 0; v0 < nvec; v0 += QT) {
                work[3 * it] = b;
                work[3 * it + 1] = kvh;
                work[3 * it + 2] = v0;
                it++;
            }
    }
    const int threads = omp_get_max_threads(), par = threads > 1 && items > 1;
    /* a thread takes `chunk` consecutive items, so that it knows which one it runs next */
    const int chunk = !prefetch ? 1 : threads == 1 ? (items > 0 ? items : 1) : 8;
#pragma omp parallel for schedule(dynamic, chunk) if (par)
    for (int i = 0; i < items; i++) {
        int b = work[3 * i], kvh = work[3 * i + 1], v0 = work[3 * i + 2];
        int nvec = (int)(a->qsl[b + 1] - a->qsl[b]) * G;
        int next[2] = {-1, 0};
        if (prefetch) {
            if (i % chunk == 0) /* nothing prefetched this item: the start of the thread's run */
                prefetch_blocks(a, b, kvh, 0, PREFETCH_BLOCKS, bf16);
            int n = i + 1;
            if (n < items && n % chunk != 0 && (work[3 * n] != b || work[3 * n + 1] != kvh)) {
                next[0] = work[3 * n];
                next[1] = work[3 * n + 1];
            }
        }
        run_tile(a, b, kvh, v0, nvec - v0 < QT ? nvec - v0 : QT, next, bf16);
    }
    free(work);
}

int sb_attention_max_head_dim(void) { return DMAX; }

void sb_paged_attention(int num_seqs, const int64_t* qsl, const int64_t* seq_lens,
                        const int64_t* block_tables, long bt_stride, const void* q, long ldq,
                        int hq, int hkv, int d, const void* k_cache, const void* v_cache,
                        int block_size, float scale, void* out, int bf16) {
    attn_args a = {qsl, seq_lens, block_tables, bt_stride, (const char*)q, ldq, hq, hkv, d,
                   block_size, (const char*)k_cache, (const char*)v_cache, scale, (char*)out};
    if (bf16)
        attention_impl(&a, num_seqs, 1);
    else
        attention_impl(&a, num_seqs, 0);
}
