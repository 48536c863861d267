/* y = x W^T (+ bias) with W kept as GGUF blocks: the dispatch over a weight's segments, and
 * ggml's Q5_K and Q6_K as the file stores their blocks (Q4_0, Q4_1, Q8_0 and Q4_K run in
 * gemm_qpanel.c's panels).
 *
 * The kernel takes such a weight's output features in groups of R rows: each group's blocks are
 * unpacked once, in registers (the block's integers widened to float32 and its sub-blocks'
 * scales and minimums applied, d q - m as ggml computes them), into a scratch row of the
 * model's dtype that stays in L1 or L2; every row of x then multiplies that scratch, MT rows at
 * a time with every partial sum in a register, so each block is unpacked once for all rows. A
 * weight is thus the value the dequantized model holds (rounded to bfloat16 where the model
 * runs in bfloat16). The products run along K: lane i of a sum holds its output's products at
 * k = 32 c + 2 i and 2 i + 1 (bfloat16 on the BF16 dot product) or at 32 c + i and
 * 32 c + 16 + i (float32, and bfloat16 without the dot product, x widened once per call), for
 * every chunk c of 32 values in turn; the 16 lanes are then summed in one order. Every row's
 * output is thus summed in one order whatever M, the tile or the row's place in x. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define R 4 /* output rows unpacked together */
#if SB_WIDE
#define MT 4 /* rows of x in a tile */
#else
#define MT 1
#endif

int sb_quant_block(int type, int* block_bytes) {
    switch (type) {
        case Q4_0: *block_bytes = 18; return 32;
        case Q4_1: *block_bytes = 20; return 32;
        case Q8_0: *block_bytes = 34; return 32;
        case Q4_K: *block_bytes = 144; return 256;
        case Q5_K: *block_bytes = 176; return 256;
        case Q6_K: *block_bytes = 210; return 256;
        default: *block_bytes = 0; return 0;
    }
}

/* ---- 16 lanes of int32 ------------------------------------------------------------------- */
#if SB_WIDE
typedef __m512i vi;
SB_INLINE vi vi_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
SB_INLINE vi vi_s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
SB_INLINE vi vi_and(vi a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
SB_INLINE vi vi_srl(vi a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
SB_INLINE vi vi_sll(vi a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
SB_INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
SB_INLINE vi vi_subc(vi a, int c) { return _mm512_sub_epi32(a, _mm512_set1_epi32(c)); }
SB_INLINE vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
#else
typedef struct {
    __m256i lo, hi;
} vi;
#define VI2(a, b) ((vi){a, b})
SB_INLINE vi vi_u8(const uint8_t* p) {
    return VI2(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)),
               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
}
SB_INLINE vi vi_s8(const uint8_t* p) {
    return VI2(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)),
               _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
}
SB_INLINE vi vi_and(vi a, int m) {
    __m256i v = _mm256_set1_epi32(m);
    return VI2(_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v));
}
SB_INLINE vi vi_srl(vi a, int n) {
    __m128i c = _mm_cvtsi32_si128(n);
    return VI2(_mm256_srl_epi32(a.lo, c), _mm256_srl_epi32(a.hi, c));
}
SB_INLINE vi vi_sll(vi a, int n) {
    __m128i c = _mm_cvtsi32_si128(n);
    return VI2(_mm256_sll_epi32(a.lo, c), _mm256_sll_epi32(a.hi, c));
}
SB_INLINE vi vi_or(vi a, vi b) { return VI2(_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)); }
SB_INLINE vi vi_subc(vi a, int c) {
    __m256i v = _mm256_set1_epi32(c);
    return VI2(_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v));
}
SB_INLINE vf vi_float(vi a) { return (vf){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
#endif

SB_INLINE float half(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 weights, values i .. i + 15 of the row, into the scratch row (bfloat16 or float32) */
SB_INLINE void put(void* dst, int i, vf v, const int bf16) {
    if (bf16)
        store16((uint16_t*)dst + i, 0xffff, v, 1);
    else
        vf_storeu((float*)dst + i, v);
}

/* d q + m and d q as ggml computes them (one rounding each) */
SB_INLINE vf scale_min(vi q, float d, float m) {
    vf p = vf_mul(vi_float(q), vf_set1(d));
#if SB_WIDE /* no FMA: the product is rounded before the minimum is added */
    __asm__("" : "+v"(p));
#else
    __asm__("" : "+x"(p.lo), "+x"(p.hi));
#endif
    return vf_add(p, vf_set1(m));
}
SB_INLINE vf scale(vi q, float d) { return vf_mul(vi_float(q), vf_set1(d)); }

/* Q4_K and Q5_K: sub-block j's 6-bit scale and minimum from the block's 12 bytes */
SB_INLINE void scale_min_k(const uint8_t* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}


typedef struct {
    int type, nb;     /* ggml type, blocks in a row */
    const uint8_t* q; /* the blocks */
    long q_row;       /* bytes of a row */
} qrows;

/* Block blk of row r, values i0 .. i0 + 255, into dst. */
SB_INLINE void unpack_block(const int type, const qrows* w, int r, int blk, void* dst, int i0,
                            const int bf16) {
    const uint8_t* b = w->q + r * w->q_row + (long)blk * (type == Q4_K ? 144 : type == Q5_K ? 176 : 210);
    switch (type) {
        case Q4_K:
        case Q5_K: {
            float d = half(b), dmin = half(b + 2);
            const uint8_t* s = b + 4;
            const uint8_t* qh = b + 16;
            const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
            for (int j = 0; j < 8; j++) { /* sub-blocks of 32 */
                int sc, mn;
                scale_min_k(s, j, &sc, &mn);
                float dj = d * (float)sc, mj = dmin * (float)mn;
                for (int h = 0; h < 2; h++) {
                    vi q = vi_and(vi_srl(vi_u8(qs + 32 * (j / 2) + 16 * h), 4 * (j & 1)), 15);
                    if (type == Q5_K) q = vi_or(q, vi_sll(vi_and(vi_srl(vi_u8(qh + 16 * h), j), 1), 4));
                    put(dst, i0 + 32 * j + 16 * h, scale_min(q, dj, -mj), bf16);
                }
            }
            return;
        }
        case Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t* sc = (const int8_t*)(b + 192);
            float d = half(b + 208);
            for (int g = 0; g < 8; g++) { /* groups of 32 values */
                int hh = g / 4, j = g % 4, s = j / 2, t = j % 2;
                for (int h = 0; h < 2; h++) {
                    int l = 16 * h;
                    vi lo = vi_and(vi_srl(vi_u8(ql + 64 * hh + 32 * t + l), 4 * s), 15);
                    vi hi = vi_and(vi_srl(vi_u8(qh + 32 * hh + l), 2 * j), 3);
                    vi q = vi_subc(vi_or(lo, vi_sll(hi, 4)), 32);
                    int sub = (32 * g + l) / 16;
                    put(dst, i0 + 32 * g + l, scale(q, d * (float)sc[sub]), bf16);
                }
            }
            return;
        }
    }
}

/* Row r's K weights into dst. */
SB_INLINE void unpack_row_of(const int type, const qrows* w, int r, void* dst, const int bf16) {
    int bb, qk = sb_quant_block(type, &bb);
    for (int blk = 0; blk < w->nb; blk++) unpack_block(type, w, r, blk, dst, blk * qk, bf16);
}

static void unpack_row(const qrows* w, int r, void* dst, int bf16) {
#define CASE(t)                                  \
    case t:                                      \
        if (bf16)                                \
            unpack_row_of(t, w, r, dst, 1);      \
        else                                     \
            unpack_row_of(t, w, r, dst, 0);      \
        break;
    switch (w->type) {
        CASE(Q4_K)
        CASE(Q5_K)
        CASE(Q6_K)
    }
#undef CASE
}

static qrows rows_of(const int64_t* f, int K) {
    int bb, qk = sb_quant_block((int)f[0], &bb);
    qrows w = {(int)f[0], qk ? K / qk : 0, (const uint8_t*)(intptr_t)f[3], (long)(K / qk) * bb};
    return w;
}

void sb_quant_unpack(const int64_t* seg, int K, void* out, int bf16) {
    qrows w = rows_of(seg, K);
    for (int r = 0; r < (int)seg[1]; r++)
        unpack_row(&w, r, (char*)out + (long)r * K * (bf16 ? 2 : 4), bf16);
}

/* ---- the products ------------------------------------------------------------------------ */
#ifdef __AVX512BF16__
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

/* Rows m0 .. m0 + TM - 1 of x against the TR unpacked rows of w (K values each, K apart):
 * x and w of one type, bfloat16 (the dot product) or float32. */
SB_INLINE void tile(const int TM, const int TR, int mr, int rr, int K, const void* x, long ldx,
                    const void* w, const int bf16, const void* bias, void* y, long ldy,
                    const int y_bf16) {
    vf acc[MT][R];
    for (int m = 0; m < TM; m++)
        for (int r = 0; r < TR; r++) acc[m][r] = vf_zero();
    for (int c = 0; c < K; c += 32) {
#if DOT_BF16
        if (bf16) {
            __m512i wv[R];
            for (int r = 0; r < TR; r++)
                wv[r] = r < rr ? _mm512_loadu_si512((const uint16_t*)w + (long)r * K + c)
                               : _mm512_setzero_si512();
            for (int m = 0; m < TM; m++) {
                if (m >= mr) break;
                __m512i xv = _mm512_loadu_si512((const uint16_t*)x + m * ldx + c);
                for (int r = 0; r < TR; r++)
                    acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)wv[r]);
            }
            continue;
        }
#endif
        vf wa[R], wb[R];
        for (int r = 0; r < TR; r++) {
            if (r < rr) {
                if (bf16) {
                    const uint16_t* p = (const uint16_t*)w + (long)r * K + c;
                    wa[r] = load16(p, 0xffff, 1);
                    wb[r] = load16(p + 16, 0xffff, 1);
                } else {
                    const float* p = (const float*)w + (long)r * K + c;
                    wa[r] = vf_loadu(p);
                    wb[r] = vf_loadu(p + 16);
                }
            } else {
                wa[r] = wb[r] = vf_zero();
            }
        }
        for (int m = 0; m < TM; m++) {
            if (m >= mr) break;
            const float* xp = (const float*)x + m * ldx + c;
            vf xa = vf_loadu(xp), xb = vf_loadu(xp + 16);
            for (int r = 0; r < TR; r++) acc[m][r] = vf_fma(xb, wb[r], vf_fma(xa, wa[r], acc[m][r]));
        }
    }
    for (int m = 0; m < TM; m++) {
        if (m >= mr) break;
        for (int r = 0; r < TR; r++) {
            if (r >= rr) break;
            float s = vf_sum(acc[m][r]);
            if (bias) s += bf16 ? bf16_to_f32(((const uint16_t*)bias)[r]) : ((const float*)bias)[r];
            if (y_bf16)
                ((uint16_t*)y)[m * ldy + r] = f32_to_bf16(s);
            else
                ((float*)y)[m * ldy + r] = s;
        }
    }
}

/* Thread-local scratch, grown as needed. */
static void* scratch(void** buf, long* cap, long need) {
    if (need > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
        if (!*buf) abort();
        *cap = need;
    }
    return *buf;
}

static __thread void* w_buf = 0;
static __thread long w_cap = 0;
static __thread void* x_buf = 0;
static __thread long x_cap = 0;

/* One segment through unpacked rows. xk: x in the products' type (rows ldk apart). */
static void segment(int M, int rows, int K, const qrows* w, const void* xk, long ldk, int bf16w,
                    const void* bias, void* y, long ldy, int y_bf16) {
    int ngroup = (rows + R - 1) / R;
    int esz_w = bf16w ? 2 : 4, esz_x = bf16w && DOT_BF16 ? 2 : 4, esz_y = y_bf16 ? 2 : 4;
    int par = omp_get_max_threads() > 1 && (double)M * rows * K > 2e5;
#pragma omp parallel for schedule(static) if (par)
    for (int g = 0; g < ngroup; g++) {
        int n0 = g * R, rr = rows - n0 < R ? rows - n0 : R;
        char* buf = (char*)scratch(&w_buf, &w_cap, (long)R * K * esz_w);
        for (int r = 0; r < rr; r++) unpack_row(w, n0 + r, buf + (long)r * K * esz_w, bf16w);
        const char* bp = bias ? (const char*)bias + (long)n0 * esz_w : 0;
        for (int m = 0; m < M; m += MT) {
            int mr = M - m < MT ? M - m : MT;
            const char* xm = (const char*)xk + (long)m * ldk * esz_x;
            char* ym = (char*)y + ((long)m * ldy + n0) * esz_y;
            if (mr == 1 && MT > 1) {
                if (y_bf16)
                    tile(1, R, 1, rr, K, xm, ldk, buf, bf16w, bp, ym, ldy, 1);
                else
                    tile(1, R, 1, rr, K, xm, ldk, buf, bf16w, bp, ym, ldy, 0);
            } else if (y_bf16) {
                tile(MT, R, mr, rr, K, xm, ldk, buf, bf16w, bp, ym, ldy, 1);
            } else {
                tile(MT, R, mr, rr, K, xm, ldk, buf, bf16w, bp, ym, ldy, 0);
            }
        }
    }
}

int sb_linear_quant(int M, int N, int K, const void* x, long ldx, int x_bf16,
                    const int64_t* qdesc, const void* bias, void* y, long ldy, int y_f32) {
    (void)N;
    int nseg = (int)qdesc[0];
    for (int s = 0; s < nseg; s++) {
        int bb, qk = sb_quant_block((int)qdesc[1 + 6 * s], &bb);
        if (qk == 0 || K % qk) return -1;
    }
    const int y_bf16 = x_bf16 && !y_f32, esz_y = y_bf16 ? 2 : 4, esz = x_bf16 ? 2 : 4;
    const void* xk = 0;
    long ldk = ldx;
    for (int s = 0; s < nseg; s++) {
        const int64_t* f = qdesc + 1 + 6 * s;
        int type = (int)f[0], rows = (int)f[1];
        long n0 = (long)f[2];
        const void* bs = bias ? (const char*)bias + n0 * esz : 0;
        void* ys = (char*)y + n0 * esz_y;
        if (type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K) {
            sb_linear_qpanel(M, rows, K, type, (const uint8_t*)(intptr_t)f[3], x, ldx, x_bf16, bs,
                             ys, ldy, y_bf16);
            continue;
        }
        if (!xk) {
            xk = x;
            if (x_bf16 && !DOT_BF16) { /* x widened once; the weights unpack to bfloat16 still */
                float* xf = (float*)scratch(&x_buf, &x_cap, (long)M * K * 4);
                for (int m = 0; m < M; m++)
                    for (int k = 0; k < K; k += 16)
                        vf_storeu(xf + (long)m * K + k,
                                  load16((const uint16_t*)x + m * ldx + k, lanes(K - k), 1));
                xk = xf;
                ldk = K;
            }
        }
        qrows w = rows_of(f, K);
        segment(M, rows, K, &w, xk, ldk, x_bf16, bs, ys, ldy, y_bf16);
    }
    return 0;
}
