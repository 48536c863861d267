/* attention.c's kernels on one span of chunks of keys: the scores of a tile's query vectors,
 * their online softmax, and the weighted values, register-blocked; in float32, widened bfloat16,
 * or bfloat16 on dot products of pairs. */
#ifndef SPECBATCH_ATTN_SPAN_H
#define SPECBATCH_ATTN_SPAN_H

#include "attn_plan.h"

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

#endif
