/* y = x W^T (+ bias) for more than four rows of x, over gemm.c's panels: float32 weights, and
 * bfloat16 weights where the CPU has no BF16 dot product (two FMAs per pair, k then k + 1).
 *
 * Tall tiles: up to TM rows x TP panels of sums in registers (8 x 3 on AVX-512's 32 registers,
 * 5 x 1 on AVX2's 16), the rows split evenly into as few tiles as hold them. A group of TP
 * panels is read in blocks of k that stay in L1 while every tile of rows runs over them (one
 * block of all of K when one tile holds the rows), the partial sums waiting in a scratch array
 * between blocks; while a block's tiles run, they prefetch the next block into L2, each tile
 * an even, contiguous share. x is copied once per call to float32 in chunks of k where a
 * tile's rows lie side by side, so each step broadcasts a tile's rows at fixed offsets.
 * bfloat16 pairs are widened in registers, once per tile for all its rows: the first elements
 * by a shift, the second by a masked load (AVX-512) or a mask (AVX2). Every output is summed
 * over k in one order, k = 0, 1, ..., K - 1, whatever the tile, the block or M, so a row's
 * result does not depend on the rest of the batch, and equals what gemm.c's kernels for four
 * rows or fewer give it. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#define NR 16
#if SB_WIDE
#define TM 8
#define TP 3
#else
#define TM 5
#define TP 1
#endif
/* Values of k in a block: TP panels of a block fill half of a 48 KiB L1 on AVX-512. */
#define KB_F32 128
#define KB_BF16 256
/* Values of k in a chunk of x. */
#define XC 16

SB_INLINE void prefetch_l2(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }

/* The first and the second elements of the 16 pairs at p (16 x (k, k + 1)), as float32. */
SB_INLINE vf pair_first(const uint16_t* p) {
    vf first, second;
    bf16_pairs(p, &first, &second);
    return first;
}

SB_INLINE vf pair_second(const uint16_t* p) {
#if SB_WIDE
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, p));
#else
    vf first, second;
    bf16_pairs(p, &first, &second);
    return second;
#endif
}

/* The loops over a tile's rows and panels are unrolled: a loop left rolled keeps the sums in
 * memory, stored at every step. */

/* One step: a value of k (float32) or a pair (bfloat16); row m's x at xk[m XC]. */
SB_INLINE void step_f32(const int tm, const int tp, const float* xk, const float* w,
                        long pstride, vf acc[TM][TP]) {
    vf b[TP];
#pragma GCC unroll 8
    for (int j = 0; j < tp; j++) b[j] = vf_loadu(w + j * pstride);
#pragma GCC unroll 8
    for (int m = 0; m < tm; m++) {
        vf a = vf_set1(xk[m * XC]);
#pragma GCC unroll 8
        for (int j = 0; j < tp; j++) acc[m][j] = vf_fma(a, b[j], acc[m][j]);
    }
}

SB_INLINE void step_bf16(const int tm, const int tp, const float* xk, const uint16_t* w,
                         long pstride, vf acc[TM][TP]) {
    vf b[TP];
#pragma GCC unroll 8
    for (int j = 0; j < tp; j++) b[j] = pair_first(w + j * pstride);
#pragma GCC unroll 8
    for (int m = 0; m < tm; m++) {
        vf a = vf_set1(xk[m * XC]);
#pragma GCC unroll 8
        for (int j = 0; j < tp; j++) acc[m][j] = vf_fma(a, b[j], acc[m][j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < tp; j++) b[j] = pair_second(w + j * pstride);
#pragma GCC unroll 8
    for (int m = 0; m < tm; m++) {
        vf a = vf_set1(xk[m * XC + 1]);
#pragma GCC unroll 8
        for (int j = 0; j < tp; j++) acc[m][j] = vf_fma(a, b[j], acc[m][j]);
    }
}

typedef struct {
    int kn;           /* values of k in the block */
    const float* xk;  /* the tile's x at the block's first k (a chunk's first) */
    const void* w;    /* the group's first panel at the block's first k */
    long pstride;     /* elements from one panel to the next */
    const char* pf;   /* the next block (the same layout), or NULL */
    int turn, ntile;  /* the tile's place among the block's tiles, and their number */
    float* part;      /* partial sums [tm][tp][16] between blocks, or NULL */
    int first, last;  /* the group's first and last block */
    int n_left;       /* outputs from the group's first to N */
    const void* bias; /* at the group's first output, or NULL */
    void* y;          /* the tile's first row at the group's first output */
    long ldy;
    int bf16_io; /* x and bias in bfloat16 */
    int y_bf16;
} tall_args;

/* The block's steps for one tile. The tiles of a block share the prefetching of the next one:
 * tile t prefetches the t-th of ntile equal runs of its steps, one step's lines every ntile
 * steps of its own. */
SB_INLINE void steps(const int tm, const int tp, const int wbf16, const tall_args* a,
                     vf acc[TM][TP]) {
    const int nstep = wbf16 ? a->kn / 2 : a->kn, per_chunk = wbf16 ? XC / 2 : XC;
    const long line = wbf16 ? 2 * NR * 2 : NR * 4; /* bytes of a step in a panel */
    const long pbytes = a->pstride * (wbf16 ? 2 : 4);
    const char* w = (const char*)a->w;
    const float* xk = a->xk;
    const char* pf = a->pf ? a->pf + a->turn * ((nstep + a->ntile - 1) / a->ntile) * line : 0;
    int c = 0, left = per_chunk;
    for (int s = 0; s < nstep; s++) {
        if (pf && c == 0) {
#pragma GCC unroll 8
            for (int j = 0; j < tp; j++) prefetch_l2(pf + j * pbytes);
            pf += line;
        }
        c = c + 1 == a->ntile ? 0 : c + 1;
        if (wbf16)
            step_bf16(tm, tp, xk, (const uint16_t*)(w + s * line), a->pstride, acc);
        else
            step_f32(tm, tp, xk, (const float*)(w + s * line), a->pstride, acc);
        xk += wbf16 ? 2 : 1;
        if (--left == 0) { /* on to the next chunk */
            xk += (tm - 1) * XC;
            left = per_chunk;
        }
    }
    if (wbf16 && (a->kn & 1)) { /* K's last value of k, the first of a pair */
        int k = a->kn - 1;
        xk = a->xk + (k / XC) * tm * XC + k % XC;
#pragma GCC unroll 8
        for (int j = 0; j < tp; j++) {
            vf b = pair_first((const uint16_t*)a->w + j * a->pstride + (long)k * NR);
#pragma GCC unroll 8
            for (int m = 0; m < tm; m++) acc[m][j] = vf_fma(vf_set1(xk[m * XC]), b, acc[m][j]);
        }
    }
}

SB_INLINE void tall_tile(const int tm, const int tp, const int wbf16, const tall_args* a) {
    vf acc[TM][TP];
#pragma GCC unroll 8
    for (int m = 0; m < tm; m++)
#pragma GCC unroll 8
        for (int j = 0; j < tp; j++)
            acc[m][j] = a->first ? vf_zero() : vf_loadu(a->part + (m * tp + j) * NR);
    steps(tm, tp, wbf16, a, acc);
    if (!a->last) {
#pragma GCC unroll 8
        for (int m = 0; m < tm; m++)
#pragma GCC unroll 8
            for (int j = 0; j < tp; j++) vf_storeu(a->part + (m * tp + j) * NR, acc[m][j]);
        return;
    }
    int esz = a->y_bf16 ? 2 : 4, bsz = a->bf16_io ? 2 : 4;
#pragma GCC unroll 8
    for (int j = 0; j < tp; j++) {
        vmask km = lanes(a->n_left - j * NR);
        const char* bj = (const char*)a->bias + (long)j * NR * bsz;
        vf b = a->bias ? load16(bj, km, a->bf16_io) : vf_zero();
#pragma GCC unroll 8
        for (int m = 0; m < tm; m++) {
            char* yr = (char*)a->y + ((long)m * a->ldy + (long)j * NR) * esz;
            store16(yr, km, vf_add(acc[m][j], b), a->y_bf16);
        }
    }
}

/* tall_tile with the tile's sizes as constants. */
#define PANELS(rows, wbf16)                                                           \
    do {                                                                              \
        if (TP == 1 || tp == 1) tall_tile(rows, 1, wbf16, a);                         \
        else if (TP == 2 || tp == 2) tall_tile(rows, TP < 2 ? TP : 2, wbf16, a);      \
        else tall_tile(rows, TP, wbf16, a);                                           \
    } while (0)
#define ROWS(n)                                      \
    case n:                                          \
        if (wbf16) PANELS(n < TM ? n : TM, 1);       \
        else PANELS(n < TM ? n : TM, 0);             \
        break;

static void run_tile(int tm, int tp, int wbf16, const tall_args* a) {
    switch (tm) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
}
#undef ROWS
#undef PANELS

/* x as float32 in chunks of XC values of k, tile after tile: a tile of tm rows starting at row
 * r0 lies at xc + r0 kc (kc: K rounded up to a chunk), chunk after chunk, each [tm][XC]. */
static float* chunk_rows(int M, int K, const void* x, long ldx, int x_bf16, int ntile, long kc) {
    float* xc = (float*)malloc(sizeof(float) * (size_t)M * (size_t)kc);
    int esz = x_bf16 ? 2 : 4;
    for (int t = 0, r0 = 0; t < ntile; r0 += M / ntile + (t < M % ntile), t++) {
        int tm = M / ntile + (t < M % ntile);
        for (int m = 0; m < tm; m++) {
            const char* src = (const char*)x + (long)(r0 + m) * ldx * esz;
            for (int k = 0; k < K; k += XC) {
                vf v = load16(src + (long)k * esz, lanes(K - k), x_bf16);
                vf_storeu(xc + (long)r0 * kc + (long)k * tm + m * XC, v);
            }
        }
    }
    return xc;
}

/* w_bf16: the weights, x and bias in bfloat16; y_bf16: y in bfloat16. */
void sb_linear_tall(int M, int N, int K, const void* x, long ldx, const void* wp, int w_bf16,
                    const void* bias, void* y, long ldy, int y_bf16) {
    int ntile = (M + TM - 1) / TM;
    long kc = (K + XC - 1) / XC * XC;
    float* xc = chunk_rows(M, K, x, ldx, w_bf16, ntile, kc);
    int npanel = (N + NR - 1) / NR, ngroup = (npanel + TP - 1) / TP;
    long pstride = w_bf16 ? (long)((K + 1) / 2) * 2 * NR : (long)K * NR; /* elements */
    int kb = ntile == 1 ? K : w_bf16 ? KB_BF16 : KB_F32;
    int nblock = (K + kb - 1) / kb;
    int wsz = w_bf16 ? 2 : 4, esz = y_bf16 ? 2 : 4;
    int par = omp_get_max_threads() > 1 && (double)M * N * K > 2e5;
#pragma omp parallel if (par)
    {
        float* part = nblock > 1 ? (float*)malloc(sizeof(float) * (size_t)M * TP * NR) : 0;
#pragma omp for schedule(static)
        for (int g = 0; g < ngroup; g++) {
            int p = g * TP;
            int np = npanel - p < TP ? npanel - p : TP;
            const char* wg = (const char*)wp + (long)p * pstride * wsz;
            for (int b = 0; b < nblock; b++) {
                int k0 = b * kb, kn = K - k0 < kb ? K - k0 : kb;
                const char* next = b + 1 < nblock ? wg + (long)(k0 + kb) * NR * wsz
                                   : g + 1 < ngroup ? wg + (long)TP * pstride * wsz
                                                    : 0;
                for (int t = 0, r0 = 0; t < ntile; t++) {
                    int tm = M / ntile + (t < M % ntile);
                    tall_args a = {
                        .kn = kn,
                        .xk = xc + (long)r0 * kc + (long)k0 * tm,
                        .w = wg + (long)k0 * NR * wsz,
                        .pstride = pstride,
                        .pf = next,
                        .turn = t,
                        .ntile = ntile,
                        .part = part ? part + (long)r0 * TP * NR : 0,
                        .first = b == 0,
                        .last = b + 1 == nblock,
                        .n_left = N - p * NR,
                        .bias = bias ? (const char*)bias + (long)p * NR * wsz : 0,
                        .y = (char*)y + ((long)r0 * ldy + (long)p * NR) * esz,
                        .ldy = ldy,
                        .bf16_io = w_bf16,
                        .y_bf16 = y_bf16,
                    };
                    run_tile(tm, np, w_bf16, &a);
                    r0 += tm;
                }
            }
        }
        free(part);
    }
    free(xc);
}
