/* The elementwise work of a decoder layer, one call per op for the whole batch: RMSNorm with
 * the residual add fused in, rotary embedding in place, SiLU-and-multiply, and the scatter of
 * new keys and values into the paged cache. Rows are float32 or bfloat16 (flag bf16); the
 * arithmetic is float32, rounded to bfloat16 where the reference rounds. */
#include <omp.h>

#include "common.h"
#include "kernels.h"

/* If residual: residual = x + residual (rounded to the dtype), normalised from it; else from x.
 * out = w * dtype(v / sqrt(mean(v^2) + eps)). Rows of n elements; x rows ldx apart. */
SB_INLINE void rms_norm_impl(int rows, int n, const void* x, long ldx, void* residual,
                             const void* w, float eps, void* out, const int bf16) {
    const int esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && rows >= 64)
    for (int r = 0; r < rows; r++) {
        const char* xr = (const char*)x + (long)r * ldx * esz;
        char* rr = residual ? (char*)residual + (long)r * n * esz : 0;
        char* orow = (char*)out + (long)r * n * esz;
        vf ss = vf_zero();
        for (int i = 0; i < n; i += 16) {
            vmask m = lanes(n - i);
            vf v = load16(xr + (long)i * esz, m, bf16);
            if (rr) {
                v = vf_add(v, load16(rr + (long)i * esz, m, bf16));
                store16(rr + (long)i * esz, m, v, bf16);
                if (bf16) v = load16(rr + (long)i * esz, m, bf16); /* the rounded sum */
            }
            ss = vf_fma(v, v, ss);
        }
        float inv = 1.0f / sqrtf(vf_sum(ss) / (float)n + eps);
        vf vinv = vf_set1(inv);
        const char* src = rr ? rr : xr;
        for (int i = 0; i < n; i += 16) {
            vmask m = lanes(n - i);
            vf v = vf_mul(load16(src + (long)i * esz, m, bf16), vinv);
            if (bf16) v = bf16x16_to_f32(f32x16_to_bf16(v));
            v = vf_mul(v, load16((const char*)w + (long)i * esz, m, bf16));
            store16(orow + (long)i * esz, m, v, bf16);
        }
    }
}

void sb_rms_norm(int rows, int n, const void* x, long ldx, void* residual, const void* w,
                 float eps, void* out, int bf16) {
    if (bf16)
        rms_norm_impl(rows, n, x, ldx, residual, w, eps, out, 1);
    else
        rms_norm_impl(rows, n, x, ldx, residual, w, eps, out, 0);
}

/* Rotate-half rotary embedding in place on `heads` heads of head_dim d per row (rows ldx apart,
 * heads d apart): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, cos/sin float32 [pos][d/2]. */
SB_INLINE void rope_impl(int rows, int heads, int d, void* x, long ldx, const int64_t* positions,
                         const float* cos_t, const float* sin_t, const int bf16) {
    const int esz = bf16 ? 2 : 4, half = d / 2;
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && rows >= 64)
    for (int r = 0; r < rows; r++) {
        const float* c = cos_t + positions[r] * half;
        const float* s = sin_t + positions[r] * half;
        for (int h = 0; h < heads; h++) {
            char* x1 = (char*)x + ((long)r * ldx + (long)h * d) * esz;
            char* x2 = x1 + (long)half * esz;
            for (int i = 0; i < half; i += 16) {
                vmask m = lanes(half - i);
                vf vc = load16(c + i, m, 0), vs = load16(s + i, m, 0);
                vf a = load16(x1 + (long)i * esz, m, bf16);
                vf b = load16(x2 + (long)i * esz, m, bf16);
                store16(x1 + (long)i * esz, m, vf_fms(a, vc, vf_mul(b, vs)), bf16);
                store16(x2 + (long)i * esz, m, vf_fma(b, vc, vf_mul(a, vs)), bf16);
            }
        }
    }
}

void sb_rope(int rows, int heads, int d, void* x, long ldx, const int64_t* positions,
             const float* cos_t, const float* sin_t, int bf16) {
    if (bf16)
        rope_impl(rows, heads, d, x, ldx, positions, cos_t, sin_t, 1);
    else
        rope_impl(rows, heads, d, x, ldx, positions, cos_t, sin_t, 0);
}

/* out[r] = silu(x[r, :n]) * x[r, n:2n]; bfloat16 rounds silu's result before the product. */
SB_INLINE void silu_mul_impl(int rows, int n, const void* x, void* out, const int bf16) {
    const int esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && rows >= 16)
    for (int r = 0; r < rows; r++) {
        const char* g = (const char*)x + (long)r * 2 * n * esz;
        const char* u = g + (long)n * esz;
        char* o = (char*)out + (long)r * n * esz;
        for (int i = 0; i < n; i += 16) {
            vmask m = lanes(n - i);
            vf vg = load16(g + (long)i * esz, m, bf16);
            vf e = exp16(vf_sub(vf_zero(), vg));
            vf sg = vf_div(vg, vf_add(vf_set1(1.0f), e));
            if (bf16) sg = bf16x16_to_f32(f32x16_to_bf16(sg));
            store16(o + (long)i * esz, m, vf_mul(sg, load16(u + (long)i * esz, m, bf16)),
                    bf16);
        }
    }
}

void sb_silu_and_mul(int rows, int n, const void* x, void* out, int bf16) {
    if (bf16)
        silu_mul_impl(rows, n, x, out, 1);
    else
        silu_mul_impl(rows, n, x, out, 0);
}

/* Scatter the new tokens' keys and values (rows ldk / ldv elements apart, hkv heads of d) into
 * the CPU cache layout (attention.c): per block and head, float32 keys [d][block_size] and
 * values [block_size][d]; bfloat16 keys [d / 2][block_size][2] and values
 * [block_size / 2][d][2]; value rows padded to an even count. */
void sb_write_kv(int rows, int hkv, int d, const void* k, long ldk, const void* v, long ldv,
                 const int64_t* slots, void* k_cache, void* v_cache, int block_size, int bf16) {
    const int esz = bf16 ? 2 : 4;
    const long k_elems = (long)d * block_size;
    const long v_elems = (long)d * (block_size + (block_size & 1));
    for (int r = 0; r < rows; r++) {
        long blk = slots[r] / block_size, off = slots[r] % block_size;
        for (int h = 0; h < hkv; h++) {
            const char* kr = (const char*)k + ((long)r * ldk + (long)h * d) * esz;
            const char* vr = (const char*)v + ((long)r * ldv + (long)h * d) * esz;
            long kbase = (blk * hkv + h) * k_elems, vbase = (blk * hkv + h) * v_elems;
            if (bf16) {
                const uint16_t *ks = (const uint16_t*)kr, *vs = (const uint16_t*)vr;
                uint16_t* kc = (uint16_t*)k_cache + kbase + off * 2;
                uint16_t* vc = (uint16_t*)v_cache + vbase + (off / 2) * d * 2 + (off & 1);
                for (int i = 0; i < d; i += 2) memcpy(kc + (long)i * block_size, ks + i, 4);
                for (int i = 0; i < d; i++) vc[2 * i] = vs[i];
            } else {
                memcpy((char*)v_cache + (vbase + off * d) * esz, vr, (size_t)d * esz);
                float* kc = (float*)k_cache + kbase + off;
                for (int i = 0; i < d; i++) kc[(long)i * block_size] = ((const float*)kr)[i];
            }
        }
    }
}

/* Per-head RMSNorm in place (Qwen3's q_norm / k_norm): `heads` heads of d per row. */
SB_INLINE void head_norm_impl(int rows, int heads, int d, void* x, long ldx, const void* w,
                              float eps, const int bf16) {
    const int esz = bf16 ? 2 : 4;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            char* xr = (char*)x + ((long)r * ldx + (long)h * d) * esz;
            vf ss = vf_zero();
            for (int i = 0; i < d; i += 16) {
                vf v = load16(xr + (long)i * esz, lanes(d - i), bf16);
                ss = vf_fma(v, v, ss);
            }
            vf vinv = vf_set1(1.0f / sqrtf(vf_sum(ss) / (float)d + eps));
            for (int i = 0; i < d; i += 16) {
                vmask m = lanes(d - i);
                vf v = vf_mul(load16(xr + (long)i * esz, m, bf16), vinv);
                if (bf16) v = bf16x16_to_f32(f32x16_to_bf16(v));
                v = vf_mul(v, load16((const char*)w + (long)i * esz, m, bf16));
                store16(xr + (long)i * esz, m, v, bf16);
            }
        }
}

void sb_head_rms_norm(int rows, int heads, int d, void* x, long ldx, const void* w, float eps,
                      int bf16) {
    if (bf16)
        head_norm_impl(rows, heads, d, x, ldx, w, eps, 1);
    else
        head_norm_impl(rows, heads, d, x, ldx, w, eps, 0);
}
