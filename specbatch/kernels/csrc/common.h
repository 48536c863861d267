/* Shared helpers of specbatch's CPU kernels: 16-lane loads and stores of float32 or bfloat16
 * data (computation is always float32), a vectorised exp, and lane reductions.
 * Built with -O3 -march=native; every kernel needs AVX-512F (checked by the loader). */
#ifndef SPECBATCH_COMMON_H
#define SPECBATCH_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SB_INLINE static inline __attribute__((always_inline))

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

SB_INLINE __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SB_INLINE __m256i f32x16_to_bf16(__m512 v) {
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
SB_INLINE __m512 load16(const void* p, __mmask16 m, const int bf16) {
    if (bf16) return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_maskz_loadu_ps(m, p);
}

SB_INLINE void store16(void* p, __mmask16 m, __m512 v, const int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16(p, m, f32x16_to_bf16(v));
    else
        _mm512_mask_storeu_ps(p, m, v);
}

SB_INLINE __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* exp(x), relative error about 1e-7 on the whole float range; exp(-inf) = 0. */
SB_INLINE __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(88.7f);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512 y = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ), y);
}

#endif
