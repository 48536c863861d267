/* y = x W^T (+ bias) with W kept as GGUF blocks: a weight's segments (rows of one ggml type
 * each, quantized.py: QuantizedLinear) one after the other, each through gemm_qpanel.c into
 * its own columns of y. */
#include "common.h"
#include "kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

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

int sb_linear_quant(int M, int N, int K, const void* x, long ldx, int x_bf16,
                    const int64_t* qdesc, const void* bias, void* y, long ldy, int y_f32) {
    (void)N;
    int nseg = (int)qdesc[0];
    for (int s = 0; s < nseg; s++) {
        int bb, qk = sb_quant_block((int)qdesc[1 + 6 * s], &bb);
        if (qk == 0 || K % qk) return -1;
    }
    const int y_bf16 = x_bf16 && !y_f32, esz_y = y_bf16 ? 2 : 4, esz = x_bf16 ? 2 : 4;
    for (int s = 0; s < nseg; s++) {
        const int64_t* f = qdesc + 1 + 6 * s;
        long n0 = (long)f[2];
        sb_linear_qpanel(M, (int)f[1], K, (int)f[0], (const uint8_t*)(intptr_t)f[3], x, ldx,
                         x_bf16, bias ? (const char*)bias + n0 * esz : 0,
                         (char*)y + n0 * esz_y, ldy, y_bf16);
    }
    return 0;
}
