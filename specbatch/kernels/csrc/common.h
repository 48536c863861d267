/* Shared helpers of specbatch's CPU kernels: a 16-lane float32 vector `vf` with the operations
 * the kernels use, loads and stores of float32 or bfloat16 data (computation is always float32),
 * a vectorised exp, and lane reductions.
 *
 * Built with -O3 -march=native. On AVX-512 `vf` is one zmm register; on AVX2 + FMA it is a pair
 * of ymm registers with the same lane semantics, so every kernel has one source for both. Masks
 * (`vmask`) are 16 bits, bit i for lane i, on both. */
#ifndef SPECBATCH_COMMON_H
#define SPECBATCH_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SB_INLINE static inline __attribute__((always_inline))

#if !(defined(__AVX2__) && defined(__FMA__))
#error "specbatch's CPU kernels need AVX2 and FMA (and use AVX-512 where the CPU has it)"
#endif

typedef uint16_t vmask;

SB_INLINE vmask lanes(int n) { return n >= 16 ? (vmask)0xffff : n <= 0 ? 0 : (vmask)((1u << n) - 1u); }

/* bfloat16 <-> float32. Rounding is to nearest even, as torch's conversion. */
SB_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

SB_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* ---- AVX-512 (F, BW, VL): one register --------------------------------------------------- */
#define SB_WIDE 1
typedef __m512 vf;

SB_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
SB_INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
SB_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
SB_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
SB_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
SB_INLINE vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
SB_INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
SB_INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
/* a * b + c, c - a * b, a * b - c, each rounded once */
SB_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
SB_INLINE vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
SB_INLINE vf vf_fms(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
SB_INLINE vf vf_load(const float* p) { return _mm512_load_ps(p); }   /* 64-byte aligned */
SB_INLINE vf vf_loadu(const float* p) { return _mm512_loadu_ps(p); }
SB_INLINE void vf_store(float* p, vf v) { _mm512_store_ps(p, v); }
SB_INLINE void vf_storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
SB_INLINE float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
SB_INLINE float vf_maxval(vf v) { return _mm512_reduce_max_ps(v); }
/* lanes in m from a, the others from b */
SB_INLINE vf vf_select(vmask m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); }
SB_INLINE vmask vf_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
SB_INLINE vf vf_round(vf v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* v * 2^n for integral n in [-150, 128] */
SB_INLINE vf vf_scale2(vf v, vf n) { return _mm512_scalef_ps(v, n); }

SB_INLINE vf bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SB_INLINE __m256i f32x16_to_bf16(vf v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

/* Load / store 16 values (mask: the lanes to touch; others load as 0). */
SB_INLINE vf load16(const void* p, vmask m, const int bf16) {
    if (bf16) return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_maskz_loadu_ps(m, p);
}

SB_INLINE void store16(void* p, vmask m, vf v, const int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16(p, m, f32x16_to_bf16(v));
    else
        _mm512_mask_storeu_ps(p, m, v);
}

/* 16 pairs (k, k + 1) of bfloat16 as two vectors: the k elements and the k + 1 elements. */
SB_INLINE void bf16_pairs(const uint16_t* p, vf* even, vf* odd) {
    __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The same from 16 32-bit lanes of which those outside m read as 0 (and are not touched). */
SB_INLINE void bf16_pairs_masked(const uint16_t* p, vmask m, vf* even, vf* odd) {
    __m512i v = m == 0xffff ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(m, p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

#else
/* ---- AVX2 + FMA: two registers, lanes 0-7 and 8-15 --------------------------------------- */
#define SB_WIDE 0
typedef struct {
    __m256 lo, hi;
} vf;

#define VF2(expr_lo, expr_hi) ((vf){expr_lo, expr_hi})
SB_INLINE vf vf_zero(void) { return VF2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
SB_INLINE vf vf_set1(float x) { return VF2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
SB_INLINE vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
SB_INLINE vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
SB_INLINE vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
SB_INLINE vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
SB_INLINE vf vf_min(vf a, vf b) { return VF2(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
SB_INLINE vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
SB_INLINE vf vf_fma(vf a, vf b, vf c) {
    return VF2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
SB_INLINE vf vf_fnma(vf a, vf b, vf c) {
    return VF2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
SB_INLINE vf vf_fms(vf a, vf b, vf c) {
    return VF2(_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi));
}
SB_INLINE vf vf_load(const float* p) { return VF2(_mm256_load_ps(p), _mm256_load_ps(p + 8)); }
SB_INLINE vf vf_loadu(const float* p) { return VF2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
SB_INLINE void vf_store(float* p, vf v) {
    _mm256_store_ps(p, v.lo);
    _mm256_store_ps(p + 8, v.hi);
}
SB_INLINE void vf_storeu(float* p, vf v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}

SB_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

SB_INLINE float vf_sum(vf v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }

SB_INLINE float vf_maxval(vf v) {
    __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* bits 0-7 of b as eight all-ones / all-zeros lanes */
SB_INLINE __m256i mask8(unsigned b) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)b), sel), sel);
}

SB_INLINE vf vf_select(vmask m, vf a, vf b) {
    return VF2(_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(mask8(m & 0xffu))),
               _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(mask8(m >> 8))));
}

SB_INLINE vmask vf_gt(vf a, vf b) {
    unsigned lo = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ));
    unsigned hi = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ));
    return (vmask)(lo | hi << 8);
}

SB_INLINE vf vf_round(vf v) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return VF2(_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode));
}

/* 2^n for integral n in [-126, 127], built in the exponent field */
SB_INLINE __m256 pow2_8(__m256 n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

/* v * 2^n for integral n in [-150, 128]: two normal factors, so only the last product can
 * round (into the subnormals), as a single scaling would. */
SB_INLINE vf vf_scale2(vf v, vf n) {
    vf h = vf_round(vf_mul(n, vf_set1(0.5f)));
    vf r = vf_sub(n, h);
    return VF2(_mm256_mul_ps(_mm256_mul_ps(v.lo, pow2_8(h.lo)), pow2_8(r.lo)),
               _mm256_mul_ps(_mm256_mul_ps(v.hi, pow2_8(h.hi)), pow2_8(r.hi)));
}

SB_INLINE vf bf16x16_to_f32(__m256i h) {
    __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
    __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
    return VF2(_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
               _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
}

SB_INLINE __m256i round_bf16_8(__m256 v) { /* the rounded value's top 16 bits, in 32-bit lanes */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i qnan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    return _mm256_srli_epi32(_mm256_blendv_epi8(r, qnan, nan), 16);
}

SB_INLINE __m256i f32x16_to_bf16(vf v) {
    __m256i packed = _mm256_packus_epi32(round_bf16_8(v.lo), round_bf16_8(v.hi));
    return _mm256_permute4x64_epi64(packed, 0xd8); /* undo packus's per-128-bit interleave */
}

SB_INLINE vf load16(const void* p, vmask m, const int bf16) {
    if (bf16) {
        if (m == 0xffff) return bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)p));
        uint16_t tmp[16] = {0};
        for (int i = 0; i < 16; i++)
            if (m >> i & 1) tmp[i] = ((const uint16_t*)p)[i];
        return bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)tmp));
    }
    if (m == 0xffff) return vf_loadu((const float*)p);
    return VF2(_mm256_maskload_ps((const float*)p, mask8(m & 0xffu)),
               _mm256_maskload_ps((const float*)p + 8, mask8(m >> 8)));
}

SB_INLINE void store16(void* p, vmask m, vf v, const int bf16) {
    if (bf16) {
        __m256i h = f32x16_to_bf16(v);
        if (m == 0xffff) {
            _mm256_storeu_si256((__m256i*)p, h);
            return;
        }
        uint16_t tmp[16];
        _mm256_storeu_si256((__m256i*)tmp, h);
        for (int i = 0; i < 16; i++)
            if (m >> i & 1) ((uint16_t*)p)[i] = tmp[i];
        return;
    }
    if (m == 0xffff) {
        _mm256_storeu_ps((float*)p, v.lo);
        _mm256_storeu_ps((float*)p + 8, v.hi);
        return;
    }
    _mm256_maskstore_ps((float*)p, mask8(m & 0xffu), v.lo);
    _mm256_maskstore_ps((float*)p + 8, mask8(m >> 8), v.hi);
}

SB_INLINE void bf16_pairs(const uint16_t* p, vf* even, vf* odd) {
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
    __m256i lo = _mm256_loadu_si256((const __m256i*)p);
    __m256i hi = _mm256_loadu_si256((const __m256i*)p + 1);
    *even = VF2(_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
    *odd = VF2(_mm256_castsi256_ps(_mm256_and_si256(lo, top)),
               _mm256_castsi256_ps(_mm256_and_si256(hi, top)));
}

SB_INLINE void bf16_pairs_masked(const uint16_t* p, vmask m, vf* even, vf* odd) {
    if (m == 0xffff) {
        bf16_pairs(p, even, odd);
        return;
    }
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
    __m256i lo = _mm256_maskload_epi32((const int*)p, mask8(m & 0xffu));
    __m256i hi = _mm256_maskload_epi32((const int*)p + 8, mask8(m >> 8));
    *even = VF2(_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
    *odd = VF2(_mm256_castsi256_ps(_mm256_and_si256(lo, top)),
               _mm256_castsi256_ps(_mm256_and_si256(hi, top)));
}
#endif

/* Pairs of bfloat16 values: a 32-bit lane holds elements 2i (low half) and 2i + 1 (high half).
 * vf_dot_pairs(acc, pair, b) adds pair.low * b.low + pair.high * b.high to every lane of acc,
 * `pair` one pair broadcast, with AVX512-BF16's dot product where the CPU has it, else as two
 * FMAs on the pairs widened to float32. Loads read 16 pairs; lanes outside m read as 0, and
 * bpairs_load_low reads every lane's low half only (its high half as 0). */
#ifdef __AVX512BF16__
typedef __m512i bpairs;
SB_INLINE bpairs bpairs_load(const uint16_t* p, vmask m) { return _mm512_maskz_loadu_epi32(m, p); }
SB_INLINE bpairs bpairs_load_low(const uint16_t* p) {
    return _mm512_maskz_loadu_epi16(0x55555555u, p);
}
SB_INLINE vf vf_dot_pairs(vf acc, uint32_t pair, bpairs b) {
    /* the broadcast pair last, where the instruction takes it from memory ({1to16}) */
    return _mm512_dpbf16_ps(acc, (__m512bh)b, (__m512bh)_mm512_set1_epi32((int)pair));
}
#else
typedef struct {
    vf low, high;
} bpairs;
SB_INLINE bpairs bpairs_load(const uint16_t* p, vmask m) {
    bpairs b;
    if (m == 0xffff) {
        bf16_pairs(p, &b.low, &b.high);
        return b;
    }
    uint32_t tmp[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) memcpy(tmp + i, p + 2 * i, 4);
    bf16_pairs((const uint16_t*)tmp, &b.low, &b.high);
    return b;
}
SB_INLINE bpairs bpairs_load_low(const uint16_t* p) {
    bpairs b;
    bf16_pairs(p, &b.low, &b.high);
    b.high = vf_zero();
    return b;
}
SB_INLINE vf vf_dot_pairs(vf acc, uint32_t pair, bpairs b) {
    acc = vf_fma(vf_set1(bf16_to_f32((uint16_t)pair)), b.low, acc);
    return vf_fma(vf_set1(bf16_to_f32((uint16_t)(pair >> 16))), b.high, acc);
}
#endif

/* exp(x), relative error about 1e-7 on the whole float range; exp(-inf) = 0. */
SB_INLINE vf exp16(vf x) {
    const vf lo = vf_set1(-104.0f), hi = vf_set1(88.7f);
    vf xc = vf_min(vf_max(x, lo), hi);
    vf n = vf_round(vf_mul(xc, vf_set1(1.44269504088896341f)));
    vf r = vf_fnma(n, vf_set1(0.693359375f), xc);
    r = vf_fnma(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.0f / 5040.0f);
    p = vf_fma(p, r, vf_set1(1.0f / 720.0f));
    p = vf_fma(p, r, vf_set1(1.0f / 120.0f));
    p = vf_fma(p, r, vf_set1(1.0f / 24.0f));
    p = vf_fma(p, r, vf_set1(1.0f / 6.0f));
    p = vf_fma(p, r, vf_set1(0.5f));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_select(vf_gt(x, lo), vf_scale2(p, n), vf_zero());
}

#endif
