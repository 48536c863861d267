/* y = x W^T (+ bias) for GGUF weights (ggml's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) repacked in
 * panels of 16 output features; a K-quant's block as its sub-blocks (of 32 values, Q6_K's of
 * 16), each a block of its own scale (and minimum).
 *
 * A panel holds, block after block (32 values of k), the block's quants of its 16 outputs laid
 * out as pairs along k: the 32-bit lane o of pair (k, k + 1) holds output o's two quants
 * (quantized.py: QuantizedRows). Four-bit quants (Q4_0, Q4_1, Q4_K) take 256 bytes a block,
 * chunk c (32 bytes) holding pair 2c in its low nibbles and pair 2c + 1 in its high ones; the
 * others a byte each (Q5_K's 0-31, Q6_K's -32-31), a pair per 32 bytes. The block's 16 scales d
 * (and Q4_1's, Q4_K's and Q5_K's 16 minimums m) follow its quants, float16 (the K-quants:
 * float32, d and dmin times the sub-block's factors), so that a panel is read in one stream.
 *
 * A tile of rows x panels sums each block apart, q x over the block's pairs (the quants as
 * exact bfloat16 integers on the BF16 dot product, or widened to float32 against x in float32),
 * and scales the block's sum in registers: acc = fma(d, block sum, acc), and for Q4_1
 * acc = fma(m, sum of x over the block, acc). So the outputs are the dequantized weights'
 * products in float arithmetic, and each unpacked pair serves every row of the tile (up to
 * eight rows on AVX-512); on the dot product, more rows than a tile read each panel unpacked
 * once into a scratch, so a step's rows unpack each block once whatever their number. Every
 * output is summed in one order whatever M, the tile or the row's place in x. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define NR 16

/* Q8_0, Q5_K and Q6_K keep a byte a quant; Q4_0, Q4_1 and Q4_K a nibble */
SB_INLINE int byte_quants(int type) { return type == Q8_0 || type == Q5_K || type == Q6_K; }
SB_INLINE int block_values(int type) { return type == Q6_K ? 16 : 32; } /* Q6_K: sub-blocks of 16 */
SB_INLINE int block_pairs(int type) { return block_values(type) / 2; }
SB_INLINE long block_bytes(int type) { return byte_quants(type) ? 32L * block_pairs(type) : 256; }
SB_INLINE int has_min(int type) { return type == Q4_1 || type == Q4_K || type == Q5_K; }
SB_INLINE int f32_scales(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
SB_INLINE long scale_bytes(int type) { return f32_scales(type) ? 64 : 32; } /* 16 of them */
/* a panel's block: its quants, then its 16 scales d and (Q4_1, Q4_K) 16 minimums */
SB_INLINE long stride_of(int type) {
    return block_bytes(type) + scale_bytes(type) * (has_min(type) ? 2 : 1);
}

/* ---- 16 lanes of int32 from 16 16-bit words --------------------------------------------- */
#if SB_WIDE
typedef __m512i vi;
SB_INLINE vi vi_u16(const uint8_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
SB_INLINE vi vi_s16(const uint8_t* p) { return _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
SB_INLINE vi vi_nib(vi a, int shift) {
    return _mm512_and_si512(_mm512_srli_epi32(a, (unsigned)shift), _mm512_set1_epi32(15));
}
SB_INLINE vi vi_low_s8(vi a) { return _mm512_srai_epi32(_mm512_slli_epi32(a, 24), 24); }
SB_INLINE vi vi_high_s8(vi a) { return _mm512_srai_epi32(a, 8); }
SB_INLINE vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
#else
typedef struct {
    __m256i lo, hi;
} vi;
SB_INLINE vi vi_u16(const uint8_t* p) {
    return (vi){_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)),
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
SB_INLINE vi vi_s16(const uint8_t* p) {
    return (vi){_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)p)),
                _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
SB_INLINE vi vi_nib(vi a, int shift) {
    __m128i c = _mm_cvtsi32_si128(shift);
    __m256i m = _mm256_set1_epi32(15);
    return (vi){_mm256_and_si256(_mm256_srl_epi32(a.lo, c), m),
                _mm256_and_si256(_mm256_srl_epi32(a.hi, c), m)};
}
SB_INLINE vi vi_low_s8(vi a) {
    return (vi){_mm256_srai_epi32(_mm256_slli_epi32(a.lo, 24), 24),
                _mm256_srai_epi32(_mm256_slli_epi32(a.hi, 24), 24)};
}
SB_INLINE vi vi_high_s8(vi a) { return (vi){_mm256_srai_epi32(a.lo, 8), _mm256_srai_epi32(a.hi, 8)}; }
SB_INLINE vf vi_float(vi a) { return (vf){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
#endif

/* 16 float16 -> float32 */
SB_INLINE vf halves16(const uint16_t* p) {
#if SB_WIDE
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
    return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
#endif
}

/* a block's 16 scales (or minimums): float32 for Q4_K, else float16 */
SB_INLINE vf scales16(const int type, const uint16_t* p) {
    return f32_scales(type) ? vf_loadu((const float*)p) : halves16(p);
}

/* Pair i (0-15) of a block as float32: the 16 outputs' quants at k (e) and k + 1 (o). */
SB_INLINE void pair_f32(const int type, const uint8_t* blk, int i, vf* e, vf* o) {
    if (byte_quants(type)) {
        vi w = vi_s16(blk + 32 * i);
        *e = vi_float(vi_low_s8(w));
        *o = vi_float(vi_high_s8(w));
        return;
    }
    vi w = vi_u16(blk + 32 * (i / 2));
    int s = 4 * (i & 1);
    *e = vi_float(vi_nib(w, s));
    *o = vi_float(vi_nib(w, s + 8));
    if (type == Q4_0) {
        *e = vf_sub(*e, vf_set1(8.0f));
        *o = vf_sub(*o, vf_set1(8.0f));
    }
}

#ifdef __AVX512BF16__
#define DOT 1
/* Pairs 2c and 2c + 1 (Q4) or pair c (Q8_0, b unset) of a block as bfloat16 pairs. Q4: the
 * chunk's bytes widened to words look their nibbles up in `table` (entry i: the quant of
 * nibble i mod 16): the low nibble through the word's low five bits, the high one shifted. */
SB_INLINE __m512i pairs_bf16(const int type, const uint8_t* blk, int c, __m512i table, __m512i* b) {
    if (byte_quants(type)) {
        const uint8_t* p = blk + 32 * c;
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(blk + 32 * c)));
    *b = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
    return _mm512_permutexvar_epi16(w, table);
}
#else
#define DOT 0
#endif

#if SB_WIDE
#define TM_MAX 8
#define NP_MAX 4
#define NP_2 2 /* panels of a two-row tile */
#else
#define TM_MAX 2
#define NP_MAX 2
#define NP_2 1
#endif

/* TM rows of x (mr real) against NP panels (np real) from panel p0 on. xb: x in bfloat16
 * (the dot product) or NULL; xf: x in float32 (else). xsum: the rows' block sums (Q4_1). */
SB_INLINE void qtile(const int TM, const int NP, const int type, const int dot, int mr, int np,
                     const uint8_t* q, const uint16_t* d, const uint16_t* mins, int nb,
                     const void* x, long ldx, const float* xsum, int n_left, const void* bias,
                     const int bias_bf16, void* y, long ldy, const int y_bf16,
                     const uint16_t* unpacked, int pf_left) {
    vf acc[TM_MAX][NP_MAX];
    for (int m = 0; m < TM; m++)
        for (int j = 0; j < NP; j++) acc[m][j] = vf_zero();
    const long pq = (long)nb * stride_of(type), pd = pq / 2, hb = stride_of(type) / 2;
#if DOT
    __m512 base = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (type == Q4_0) base = _mm512_sub_ps(base, _mm512_set1_ps(8.0f));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(base, base);
#endif
    for (int b = 0; b < nb; b++) {
        if (pf_left > 0) /* the next group's panels, block for block (gemm.c's way) */
            for (int j = 0; j < NP; j++) {
                if (j >= pf_left) break;
                const char* f = (const char*)(q + (NP + j) * pq + (long)b * stride_of(type));
                for (int l = 0; l < stride_of(type); l += 64) _mm_prefetch(f + l, _MM_HINT_T0);
            }
        vf blk[TM_MAX][NP_MAX];
        for (int m = 0; m < TM; m++)
            for (int j = 0; j < NP; j++) blk[m][j] = vf_zero();
        const int k0 = block_values(type) * b;
#if DOT
        if (dot) {
            const uint16_t* xb = (const uint16_t*)x;
            const int steps = byte_quants(type) ? block_pairs(type) : 8;
            for (int c = 0; c < steps; c++) {
                for (int j = 0; j < NP; j++) {
                    if (j >= np) break;
                    __m512i wa, wb = _mm512_setzero_si512();
                    if (unpacked) { /* one panel's pairs, unpacked before (unpack_panel) */
                        const uint16_t* u = unpacked + ((long)b * block_pairs(type) +
                                                        (byte_quants(type) ? c : 2 * c)) * 32;
                        wa = _mm512_loadu_si512(u);
                        if (!byte_quants(type)) wb = _mm512_loadu_si512(u + 32);
                    } else {
                        wa = pairs_bf16(type, q + j * pq + b * stride_of(type), c, table, &wb);
                    }
                    const int ka = k0 + (byte_quants(type) ? 2 * c : 4 * c);
                    for (int m = 0; m < TM; m++) {
                        if (m >= mr) break;
                        uint32_t pa;
                        memcpy(&pa, xb + m * ldx + ka, 4);
                        blk[m][j] = _mm512_dpbf16_ps(blk[m][j], (__m512bh)wa,
                                                     (__m512bh)_mm512_set1_epi32((int)pa));
                        if (!byte_quants(type)) {
                            uint32_t pb;
                            memcpy(&pb, xb + m * ldx + ka + 2, 4);
                            blk[m][j] = _mm512_dpbf16_ps(blk[m][j], (__m512bh)wb,
                                                         (__m512bh)_mm512_set1_epi32((int)pb));
                        }
                    }
                }
            }
        } else
#endif
        {
            const float* xf = (const float*)x;
            for (int i = 0; i < block_pairs(type); i++) {
                /* pair i holds k0 + 2i and + 1 (a byte a quant); for Q4, chunk i / 2 holds pairs
                 * 4c and 4c + 2 */
                const int ka = byte_quants(type) ? k0 + 2 * i : k0 + 4 * (i / 2) + 2 * (i & 1);
                for (int j = 0; j < NP; j++) {
                    if (j >= np) break;
                    vf e, o;
                    pair_f32(type, q + j * pq + b * stride_of(type), i, &e, &o);
                    for (int m = 0; m < TM; m++) {
                        if (m >= mr) break;
                        const float* xr = xf + m * ldx + ka;
                        blk[m][j] = vf_fma(vf_set1(xr[1]), o, vf_fma(vf_set1(xr[0]), e, blk[m][j]));
                    }
                }
            }
        }
        for (int j = 0; j < NP; j++) {
            if (j >= np) break;
            vf dj = scales16(type, d + j * pd + (long)b * hb);
            vf mj = has_min(type) ? scales16(type, mins + j * pd + (long)b * hb) : vf_zero();
            for (int m = 0; m < TM; m++) {
                if (m >= mr) break;
                acc[m][j] = vf_fma(dj, blk[m][j], acc[m][j]);
                if (has_min(type)) acc[m][j] = vf_fma(mj, vf_set1(xsum[(long)m * nb + b]), acc[m][j]);
            }
        }
    }
    for (int j = 0; j < NP; j++) {
        if (j >= np) break;
        vmask km = lanes(n_left - j * NR);
        vf bj = bias ? load16((const char*)bias + (long)j * NR * (bias_bf16 ? 2 : 4), km, bias_bf16)
                     : vf_zero();
        for (int m = 0; m < TM; m++) {
            if (m >= mr) break;
            char* yr = (char*)y + ((long)m * ldy + (long)j * NR) * (y_bf16 ? 2 : 4);
            store16(yr, km, vf_add(acc[m][j], bj), y_bf16);
        }
    }
}

/* The tile for tm rows: one row takes NP_MAX panels, more rows fewer. */
SB_INLINE int panels_of(int tm) { return tm == 1 ? NP_MAX : tm == 2 ? NP_2 : 1; }

SB_INLINE void tile_for(int tm, const int type, const int dot, int mr, int np, const uint8_t* q,
                        const uint16_t* d, const uint16_t* mins, int nb, const void* x, long ldx,
                        const float* xsum, int n_left, const void* bias, int bias_bf16, void* y,
                        long ldy, int y_bf16, int pf_left) {
#define T(TM_, NP_, YB) \
    qtile(TM_, NP_, type, dot, mr, np, q, d, mins, nb, x, ldx, xsum, n_left, bias, bias_bf16, y, ldy, YB, 0, pf_left)
#define BY_Y(TM_, NP_)     \
    if (y_bf16)            \
        T(TM_, NP_, 1);    \
    else                   \
        T(TM_, NP_, 0);
    if (tm == 1) {
        BY_Y(1, NP_MAX)
    } else if (tm == 2) {
        BY_Y(2, NP_2)
    } else {
        BY_Y(TM_MAX, 1)
    }
#undef BY_Y
#undef T
}

#if DOT
/* A panel's pairs as bfloat16, block after block ([nb][16 pairs][32 words]), for many rows. */
static void unpack_panel(const int type, const uint8_t* q, int nb, uint16_t* out) {
    __m512 base = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (type == Q4_0) base = _mm512_sub_ps(base, _mm512_set1_ps(8.0f));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(base, base);
    for (int b = 0; b < nb; b++) {
        const uint8_t* blk = q + b * stride_of(type);
        uint16_t* o = out + (long)b * block_pairs(type) * 32;
        if (byte_quants(type)) {
            for (int c = 0; c < block_pairs(type); c++)
                _mm512_storeu_si512(o + c * 32, pairs_bf16(type, blk, c, table, 0));
        } else {
            for (int c = 0; c < 8; c++) {
                __m512i wb;
                _mm512_storeu_si512(o + 2 * c * 32, pairs_bf16(type, blk, c, table, &wb));
                _mm512_storeu_si512(o + (2 * c + 1) * 32, wb);
            }
        }
    }
}

static __thread uint16_t* u_buf = 0;
static __thread long u_cap = 0;

/* More rows than a tile: each panel unpacked once into a scratch that stays in L1 or L2, then
 * every tile of rows reads it: the same words, so the same sums, as the tiles unpacking in
 * registers. */
static void many_rows(int M, int n_rows, int nb, int type, const uint8_t* q, const uint16_t* d,
                      const uint16_t* mins, const uint16_t* x, long ldx, const float* xsum,
                      const void* bias, void* y, long ldy, int y_bf16) {
    const int npanel = (n_rows + NR - 1) / NR, esz_y = y_bf16 ? 2 : 4;
    const long pq = (long)nb * stride_of(type), pd = pq / 2;
    const int par = omp_get_max_threads() > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int p = 0; p < npanel; p++) {
        if ((long)nb * block_pairs(type) * 32 > u_cap) {
            free(u_buf);
            u_cap = (long)nb * block_pairs(type) * 32;
            u_buf = (uint16_t*)aligned_alloc(64, (size_t)u_cap * 2);
            if (!u_buf) abort();
        }
        unpack_panel(type, q + p * pq, nb, u_buf);
        const int tiles = (M + TM_MAX - 1) / TM_MAX, rows = (M + tiles - 1) / tiles;
        for (int m = 0; m < M; m += rows) { /* even tiles: a lone row would wait on its sums */
            int mr = M - m < rows ? M - m : rows;
            const uint16_t* xm = x + (long)m * ldx;
            char* ym = (char*)y + ((long)m * ldy + (long)p * NR) * esz_y;
            const char* bp = bias ? (const char*)bias + (long)p * NR * 2 : 0;
            const uint16_t* mp = mins ? mins + p * pd : 0;
            const float* xs = xsum ? xsum + (long)m * nb : 0;
#define U(t, yb) qtile(TM_MAX, 1, t, 1, mr, 1, q + p * pq, d + p * pd, mp, nb, xm, ldx, xs, \
                       n_rows - p * NR, bp, 1, ym, ldy, yb, u_buf, 0)
            if (type == Q4_0)
                y_bf16 ? U(Q4_0, 1) : U(Q4_0, 0);
            else if (type == Q4_1)
                y_bf16 ? U(Q4_1, 1) : U(Q4_1, 0);
            else if (type == Q4_K)
                y_bf16 ? U(Q4_K, 1) : U(Q4_K, 0);
            else if (type == Q5_K)
                y_bf16 ? U(Q5_K, 1) : U(Q5_K, 0);
            else if (type == Q6_K)
                y_bf16 ? U(Q6_K, 1) : U(Q6_K, 0);
            else
                y_bf16 ? U(Q8_0, 1) : U(Q8_0, 0);
#undef U
        }
    }
}
#endif

static __thread float* xs_buf = 0;
static __thread long xs_cap = 0;
static __thread float* xf_buf = 0;
static __thread long xf_cap = 0;

static float* grow(float** buf, long* cap, long need) {
    if (need > *cap) {
        free(*buf);
        *buf = (float*)malloc((size_t)need * sizeof(float));
        if (!*buf) abort();
        *cap = need;
    }
    return *buf;
}

/* One segment: rows (a multiple of 16 in the panels, n_rows real) of one type. */
void sb_linear_qpanel(int M, int n_rows, int K, int type, const uint8_t* q, const void* x,
                      long ldx, int x_bf16, const void* bias, void* y, long ldy, int y_bf16) {
    const int nb = K / block_values(type), npanel = (n_rows + NR - 1) / NR;
    const uint16_t* d = (const uint16_t*)(q + block_bytes(type));
    const uint16_t* mins = has_min(type) ? d + scale_bytes(type) / 2 : 0;
    const int dot = DOT && x_bf16;
    const void* xk = x;
    long ldk = ldx;
    if (x_bf16 && !dot) { /* x widened to float32 once */
        float* xf = grow(&xf_buf, &xf_cap, (long)M * K);
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k += 16)
                vf_storeu(xf + (long)m * K + k, load16((const uint16_t*)x + m * ldx + k, lanes(K - k), 1));
        xk = xf;
        ldk = K;
    }
    float* xsum = 0;
    if (has_min(type)) { /* each row's sum over each block, in one order */
        xsum = grow(&xs_buf, &xs_cap, (long)M * nb);
        for (int m = 0; m < M; m++)
            for (int b = 0; b < nb; b++) {
                const char* xr = (const char*)x + ((long)m * ldx + 32 * b) * (x_bf16 ? 2 : 4);
                vf s = vf_add(load16(xr, 0xffff, x_bf16), load16(xr + 16 * (x_bf16 ? 2 : 4), 0xffff, x_bf16));
                xsum[(long)m * nb + b] = vf_sum(s);
            }
    }
#if DOT
    if (dot && M > TM_MAX) {
        many_rows(M, n_rows, nb, type, q, d, mins, (const uint16_t*)x, ldx, xsum, bias, y, ldy,
                  y_bf16);
        return;
    }
#endif
    const int tm = M == 1 ? 1 : M == 2 ? 2 : TM_MAX, tp = panels_of(tm);
    const int ngroup = (npanel + tp - 1) / tp;
    const long pq = (long)nb * stride_of(type), pd = pq / 2;
    const int esz_y = y_bf16 ? 2 : 4, esz_b = x_bf16 ? 2 : 4;
    const int par = omp_get_max_threads() > 1 && (double)M * n_rows * K > 2e5;
#pragma omp parallel for schedule(static) if (par)
    for (int g = 0; g < ngroup; g++) {
        int p = g * tp, np = npanel - p < tp ? npanel - p : tp;
        for (int m = 0; m < M; m += tm) {
            int mr = M - m < tm ? M - m : tm;
            const char* xm = (const char*)xk + (long)m * ldk * (dot ? 2 : 4);
            char* ym = (char*)y + ((long)m * ldy + (long)p * NR) * esz_y;
            const char* bp = bias ? (const char*)bias + (long)p * NR * esz_b : 0;
            const uint16_t* mp = mins ? mins + p * pd : 0;
            const float* xs = xsum ? xsum + (long)m * nb : 0;
            int pf_left = m == 0 ? npanel - p - tp : 0; /* the first tile prefetches */
#define CALL(t) tile_for(tm, t, dot, mr, np, q + p * pq, d + p * pd, mp, nb, xm, ldk, xs, \
                         n_rows - p * NR, bp, x_bf16, ym, ldy, y_bf16, pf_left)
            if (type == Q4_0)
                CALL(Q4_0);
            else if (type == Q4_1)
                CALL(Q4_1);
            else if (type == Q4_K)
                CALL(Q4_K);
            else if (type == Q5_K)
                CALL(Q5_K);
            else if (type == Q6_K)
                CALL(Q6_K);
            else
                CALL(Q8_0);
#undef CALL
        }
    }
}
