/* y = x W^T (+ bias) for float32 and bfloat16 weights packed in panels of 16 output features.
 *
 * float32 panels: [ceil(N/16)][K][16]; bfloat16 panels: [ceil(N/16)][ceil(K/2)][16][2] (pairs
 * along K, the operand layout of AVX512-BF16's dot product). A micro-kernel computes a tile of
 * rows of x against a group of panels with every partial sum in a register, streaming each
 * panel once per tile: MR rows x NP panels (4 x 4 on AVX-512's 32 registers, 4 x 1 on AVX2's
 * 16); fewer rows take more panels (on AVX2 one row four, two rows two, a panel's vector used
 * as soon as it is loaded), so that enough independent sums are in flight while the weights
 * stream past (decoding at batch 1 sends one row). With several rows, a group's first tile
 * prefetches the next group, whose panels then arrive while the other tiles compute. bfloat16
 * runs on the BF16 dot product where the CPU has it, else as two FMAs per pair (k, then
 * k + 1) with x widened to float32 once per call. More than MR rows go to gemm_tall.c's taller
 * tiles, except bfloat16 on the dot product. Every output is summed over k in the same order
 * whatever the tile, M or the row's place in x, so a row's result does not depend on the rest
 * of the batch. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#define MR 4
#if SB_WIDE
#define NP 4
#define NP1 8  /* panels of a one-row tile */
#define NP2 8  /* of a two-row tile */
#define NP3 5  /* of a three-row tile */
#define NPMAX 16
#else
#define NP 1
#define NP1 4  /* a one-row tile: four panels' sums, eight chains of FMAs in flight */
#define NP2 2
#define NP3 1
#define NPMAX 4
#endif
#define NR 16

/* One cache line of the next group's panels, into L1. */
SB_INLINE void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }

/* A panel vector read by every row of a tile stays in registers: on AVX2, GCC would otherwise
 * fold its load into each row's FMA, and the loads, not the FMAs, would set the pace. */
SB_INLINE void keep_in_register(vf* v) {
#if SB_WIDE
    (void)v;
#else
    __asm__("" : "+x"(v->lo), "+x"(v->hi));
#endif
}

/* Whether tile m of panel group g (of ngroup) prefetches the next group: a group's first tile,
 * when there are several rows (one row streams best alone) and a next group. */
SB_INLINE int prefetches(int M, int m, int g, int ngroup) {
    return M > 1 && m == 0 && g + 1 < ngroup;
}

/* The tile (TM rows x TP panels, both constants where a kernel is called) for M rows. */
SB_INLINE int tile_rows(int M) { return M < MR ? M : MR; }
SB_INLINE int tile_panels(int tm) { return tm == 1 ? NP1 : tm == 2 ? NP2 : tm == 3 ? NP3 : NP; }

SB_INLINE void finish(const int TM, const int TP, vf acc[MR][NPMAX], int mr, int np, int n_left,
                      const void* bias, const int bias_bf16, void* y, long ldy,
                      const int y_bf16) {
    for (int j = 0; j < TP; j++) {
        if (j >= np) break;
        int nl = n_left - j * NR;
        vmask km = lanes(nl);
        vf b = vf_zero();
        if (bias) {
            const char* bp = (const char*)bias + (long)j * NR * (bias_bf16 ? 2 : 4);
            b = load16(bp, km, bias_bf16);
        }
        for (int m = 0; m < TM; m++) {
            if (m >= mr) break;
            char* yr = (char*)y + ((long)m * ldy + (long)j * NR) * (y_bf16 ? 2 : 4);
            store16(yr, km, vf_add(acc[m][j], b), y_bf16);
        }
    }
}

SB_INLINE void kernel_f32(const int TM, const int TP, int mr, int np, int K, const float* x,
                          long ldx, const float* w, long pstride, int n_left, const float* bias,
                          float* y, long ldy, const float* pf) {
    vf acc[MR][NPMAX];
    for (int m = 0; m < TM; m++)
        for (int j = 0; j < TP; j++) acc[m][j] = vf_zero();
    for (int k = 0; k < K; k++) {
        vf b[NPMAX];
        if (pf)
            for (int j = 0; j < TP; j++) prefetch(pf + j * pstride + (long)k * NR);
        if (!SB_WIDE && TM <= 2) { /* a panel at a time: its vector is read by few rows */
            vf a[2];
            for (int m = 0; m < TM; m++) a[m] = vf_set1(m < mr ? x[m * ldx + k] : 0.0f);
            for (int j = 0; j < TP; j++) {
                if (j >= np) break;
                vf bj = vf_loadu(w + j * pstride + (long)k * NR);
                for (int m = 0; m < TM; m++) acc[m][j] = vf_fma(a[m], bj, acc[m][j]);
            }
            continue;
        }
        for (int j = 0; j < TP; j++)
            b[j] = j < np ? vf_loadu(w + j * pstride + (long)k * NR) : vf_zero();
        for (int j = 0; j < TP; j++) keep_in_register(&b[j]);
        for (int m = 0; m < TM; m++) {
            if (m < mr) {
                vf a = vf_set1(x[m * ldx + k]);
                for (int j = 0; j < TP; j++) acc[m][j] = vf_fma(a, b[j], acc[m][j]);
            }
        }
    }
    finish(TM, TP, acc, mr, np, n_left, bias, 0, y, ldy, 0);
}

/* kernel_f32 with the tile of tm rows (the call's constants let every tile keep its sums in
 * registers). */
SB_INLINE void tile_f32(int tm, int mr, int np, int K, const float* x, long ldx, const float* w,
                        long pstride, int n_left, const float* bias, float* y, long ldy,
                        const float* pf) {
    if (tm == 1)
        kernel_f32(1, NP1, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, pf);
    else if (tm == 2)
        kernel_f32(2, NP2, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, pf);
    else if (tm == 3)
        kernel_f32(3, NP3, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, pf);
    else
        kernel_f32(MR, NP, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, pf);
}

void sb_linear_f32(int M, int N, int K, const float* x, long ldx, const float* wp,
                   const float* bias, float* y, long ldy) {
    if (M > MR) {
        sb_linear_tall(M, N, K, x, ldx, wp, 0, bias, y, ldy, 0);
        return;
    }
    int npanel = (N + NR - 1) / NR;
    int tm = tile_rows(M), tp = tile_panels(tm);
    int ngroup = (npanel + tp - 1) / tp;
    long pstride = (long)K * NR;
    int par = omp_get_max_threads() > 1 && (double)M * N * K > 2e5;
#pragma omp parallel for schedule(static) if (par)
    for (int g = 0; g < ngroup; g++) {
        int p = g * tp;
        int np = npanel - p < tp ? npanel - p : tp;
        for (int m = 0; m < M; m += tm) {
            int mr = M - m < tm ? M - m : tm;
            const float* pf = prefetches(M, m, g, ngroup) ? wp + (p + tp) * pstride : 0;
            tile_f32(tm, mr, np, K, x + (long)m * ldx, ldx, wp + p * pstride, pstride, N - p * NR,
                     bias ? bias + p * NR : 0, y + (long)m * ldy + p * NR, ldy, pf);
        }
    }
}

int sb_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
typedef uint16_t xbf_t; /* the dot product reads x's pairs as they are */
SB_INLINE void kernel_bf16(const int TM, const int TP, int mr, int np, int K, const uint16_t* x,
                           long ldx, const uint16_t* w, long pstride, int n_left,
                           const uint16_t* bias, void* y, long ldy, const int y_bf16,
                           const uint16_t* pf) {
    __m512 acc[MR][NPMAX];
    for (int m = 0; m < TM; m++)
        for (int j = 0; j < TP; j++) acc[m][j] = _mm512_setzero_ps();
    int K2 = K / 2;
    for (int k2 = 0; k2 < K2; k2++) {
        __m512i b[NPMAX];
        if (pf)
            for (int j = 0; j < TP; j++) prefetch(pf + j * pstride + (long)k2 * 2 * NR);
        for (int j = 0; j < TP; j++)
            b[j] = j < np ? _mm512_loadu_si512(w + j * pstride + (long)k2 * 2 * NR)
                          : _mm512_setzero_si512();
        for (int m = 0; m < TM; m++) {
            if (m < mr) {
                uint32_t pair;
                memcpy(&pair, x + m * ldx + 2 * k2, 4);
                __m512i a = _mm512_set1_epi32((int)pair);
                for (int j = 0; j < TP; j++)
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)a, (__m512bh)b[j]);
            }
        }
    }
    if (K & 1) { /* the last pair holds one real element; its partner in the panel is 0 */
        for (int j = 0; j < TP; j++) {
            if (j >= np) break;
            __m512i bj = _mm512_loadu_si512(w + j * pstride + (long)K2 * 2 * NR);
            for (int m = 0; m < TM; m++) {
                if (m < mr) {
                    uint32_t pair = x[m * ldx + K - 1];
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)_mm512_set1_epi32((int)pair),
                                                 (__m512bh)bj);
                }
            }
        }
    }
    finish(TM, TP, acc, mr, np, n_left, bias, 1, y, ldy, y_bf16);
}
#else
typedef float xbf_t;
/* Without the dot product: per pair, acc += x[k] w[k], then acc += x[k + 1] w[k + 1]; x comes
 * widened to float32 (widen_rows), so a row's value is broadcast straight from memory. */
SB_INLINE void kernel_bf16(const int TM, const int TP, int mr, int np, int K, const float* x,
                           long ldx, const uint16_t* w, long pstride, int n_left,
                           const uint16_t* bias, void* y, long ldy, const int y_bf16,
                           const uint16_t* pf) {
    vf acc[MR][NPMAX];
    for (int m = 0; m < TM; m++)
        for (int j = 0; j < TP; j++) acc[m][j] = vf_zero();
    int K2 = K / 2;
    for (int k2 = 0; k2 < K2; k2++) {
        vf be[NPMAX], bo[NPMAX];
        if (pf)
            for (int j = 0; j < TP; j++) prefetch(pf + j * pstride + (long)k2 * 2 * NR);
        if (!SB_WIDE && TM <= 2) { /* a panel at a time, as in kernel_f32 */
            vf ae[2], ao[2];
            for (int m = 0; m < TM; m++) {
                ae[m] = vf_set1(m < mr ? x[m * ldx + 2 * k2] : 0.0f);
                ao[m] = vf_set1(m < mr ? x[m * ldx + 2 * k2 + 1] : 0.0f);
            }
            for (int j = 0; j < TP; j++) {
                if (j >= np) break;
                vf e, o;
                bf16_pairs(w + j * pstride + (long)k2 * 2 * NR, &e, &o);
                for (int m = 0; m < TM; m++)
                    acc[m][j] = vf_fma(ao[m], o, vf_fma(ae[m], e, acc[m][j]));
            }
            continue;
        }
        for (int j = 0; j < TP; j++) {
            if (j < np)
                bf16_pairs(w + j * pstride + (long)k2 * 2 * NR, &be[j], &bo[j]);
            else
                be[j] = bo[j] = vf_zero();
        }
        for (int m = 0; m < TM; m++) {
            if (m < mr) {
                vf ae = vf_set1(x[m * ldx + 2 * k2]);
                vf ao = vf_set1(x[m * ldx + 2 * k2 + 1]);
                for (int j = 0; j < TP; j++) acc[m][j] = vf_fma(ao, bo[j], vf_fma(ae, be[j], acc[m][j]));
            }
        }
    }
    if (K & 1) { /* the last pair holds one real element */
        for (int j = 0; j < TP; j++) {
            if (j >= np) break;
            vf be, bo;
            bf16_pairs(w + j * pstride + (long)K2 * 2 * NR, &be, &bo);
            for (int m = 0; m < TM; m++)
                if (m < mr) acc[m][j] = vf_fma(vf_set1(x[m * ldx + K - 1]), be, acc[m][j]);
        }
    }
    finish(TM, TP, acc, mr, np, n_left, bias, 1, y, ldy, y_bf16);
}
#endif

#ifndef __AVX512BF16__
/* x's M rows as float32 in a buffer of the calling thread's, row after row (K apart). */
static const float* widen_rows(int M, int K, const uint16_t* x, long ldx) {
    static __thread float* buf = 0;
    static __thread long cap = 0;
    long need = (long)M * K;
    if (need > cap) {
        free(buf);
        buf = malloc(need * sizeof(float));
        if (!buf) abort();
        cap = need;
    }
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) buf[(long)m * K + k] = bf16_to_f32(x[(long)m * ldx + k]);
    return buf;
}
#endif

SB_INLINE void tile_bf16(int tm, int mr, int np, int K, const xbf_t* x, long ldx,
                         const uint16_t* w, long pstride, int n_left, const uint16_t* bias,
                         void* y, long ldy, const int y_bf16, const uint16_t* pf) {
    if (tm == 1)
        kernel_bf16(1, NP1, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, y_bf16, pf);
    else if (tm == 2)
        kernel_bf16(2, NP2, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, y_bf16, pf);
    else if (tm == 3)
        kernel_bf16(3, NP3, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, y_bf16, pf);
    else
        kernel_bf16(MR, NP, mr, np, K, x, ldx, w, pstride, n_left, bias, y, ldy, y_bf16, pf);
}

/* Set by sb_set_amx: bfloat16 multiplies with K a multiple of 32 go to gemm_amx.c. */
static int use_amx = 0;

void sb_set_amx(int on) { use_amx = on; }

/* y_f32: write float32 outputs (the LM head's logits) instead of bfloat16. */
void sb_linear_bf16(int M, int N, int K, const uint16_t* x, long ldx, const uint16_t* wp,
                    const uint16_t* bias, void* y, long ldy, int y_f32) {
    if (use_amx && K % 32 == 0) {
        sb_linear_bf16_amx(M, N, K, x, ldx, wp, bias, y, ldy, y_f32);
        return;
    }
#ifdef __AVX512BF16__
    const xbf_t* xk = x;
    long ldk = ldx;
#else
    if (M > MR) {
        sb_linear_tall(M, N, K, x, ldx, wp, 1, bias, y, ldy, !y_f32);
        return;
    }
    const xbf_t* xk = widen_rows(M, K, x, ldx);
    long ldk = K;
#endif
    int npanel = (N + NR - 1) / NR;
    int tm = tile_rows(M), tp = tile_panels(tm);
    int ngroup = (npanel + tp - 1) / tp;
    long pstride = (long)((K + 1) / 2) * 2 * NR;
    int par = omp_get_max_threads() > 1 && (double)M * N * K > 2e5;
    int esz = y_f32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (par)
    for (int g = 0; g < ngroup; g++) {
        int p = g * tp;
        int np = npanel - p < tp ? npanel - p : tp;
        for (int m = 0; m < M; m += tm) {
            int mr = M - m < tm ? M - m : tm;
            char* yp = (char*)y + ((long)m * ldy + (long)p * NR) * esz;
            const uint16_t* pf = prefetches(M, m, g, ngroup) ? wp + (p + tp) * pstride : 0;
            if (y_f32)
                tile_bf16(tm, mr, np, K, xk + (long)m * ldk, ldk, wp + p * pstride, pstride,
                          N - p * NR, bias ? bias + p * NR : 0, yp, ldy, 0, pf);
            else
                tile_bf16(tm, mr, np, K, xk + (long)m * ldk, ldk, wp + p * pstride, pstride,
                          N - p * NR, bias ? bias + p * NR : 0, yp, ldy, 1, pf);
        }
    }
}
