/* y = x W^T (+ bias) for bfloat16 on AMX tiles, over the same weight panels as gemm.c
 * ([ceil(N/16)][K/2][16][2]: sixteen consecutive pairs of a panel are one 1 KiB B tile).
 *
 * A block of up to 16 rows of x is multiplied against 4 panels (64 outputs) at a time: four
 * accumulator tiles, one A tile and rotating B tiles. Every output is summed over k in chunks
 * of 32 in one order, and a tile row depends only on its own row of x, so a row's result does
 * not depend on M or on where the row sits in the batch. Used for every M when K is a multiple
 * of 32 and the kernel has the OS's permission to use the tile registers; gemm.c otherwise. */
#include <omp.h>

#include "common.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Tile registers (the intrinsics take literal numbers): accumulators, A, B. */
#define C0 0
#define C1 1
#define C2 2
#define C3 3
#define TA 4
#define TB0 5
#define TB1 6
#define TB2 7

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_permitted = -1; /* -1: not asked yet */

int sb_amx_available(void) {
    if (amx_permitted < 0)
        amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted;
}

/* Accumulators and A hold `rows` rows; B tiles are 16 pairs x 16 outputs. */
static void configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t >= TB0 ? 16 : rows;
    }
    _tile_loadconfig(&c);
}

static void store_panel(const float acc[16][16], int mr, int n_left, const uint16_t* bias,
                        char* y, long ldy, const int y_bf16) {
    __mmask16 km = lanes(n_left);
    __m512 b = bias ? load16(bias, km, 1) : _mm512_setzero_ps();
    for (int m = 0; m < mr; m++)
        store16(y + (long)m * ldy * (y_bf16 ? 2 : 4), km, _mm512_add_ps(_mm512_loadu_ps(acc[m]), b),
                y_bf16);
}

/* mr rows of x against np (1-4) panels starting at w; K a multiple of 32. */
static void block(int mr, int np, int K, const uint16_t* x, long ldx, const uint16_t* w,
                  long pstride, int n_left, const uint16_t* bias, char* y, long ldy,
                  const int y_bf16) {
    _tile_zero(C0);
    _tile_zero(C1);
    _tile_zero(C2);
    _tile_zero(C3);
    for (int c = 0; c < K / 32; c++) {
        const uint16_t* wc = w + (long)c * 512; /* 16 pairs x 16 outputs x 2 */
        _tile_loadd(TA, x + c * 32, ldx * 2);
        _tile_loadd(TB0, wc, 64);
        _tile_dpbf16ps(C0, TA, TB0);
        if (np > 1) {
            _tile_loadd(TB1, wc + pstride, 64);
            _tile_dpbf16ps(C1, TA, TB1);
        }
        if (np > 2) {
            _tile_loadd(TB2, wc + 2 * pstride, 64);
            _tile_dpbf16ps(C2, TA, TB2);
        }
        if (np > 3) {
            _tile_loadd(TB0, wc + 3 * pstride, 64);
            _tile_dpbf16ps(C3, TA, TB0);
        }
    }
    float acc[16][16];
    const int esz = y_bf16 ? 2 : 4;
    for (int j = 0; j < np; j++) {
        switch (j) {
            case 0: _tile_stored(C0, acc, 64); break;
            case 1: _tile_stored(C1, acc, 64); break;
            case 2: _tile_stored(C2, acc, 64); break;
            default: _tile_stored(C3, acc, 64); break;
        }
        int nl = n_left - j * 16;
        store_panel(acc, mr, nl, bias ? bias + j * 16 : 0, y + (long)j * 16 * esz, ldy, y_bf16);
    }
}

void sb_linear_bf16_amx(int M, int N, int K, const uint16_t* x, long ldx, const uint16_t* wp,
                        const uint16_t* bias, void* y, long ldy, int y_f32) {
    int npanel = (N + 15) / 16;
    int ngroup = (npanel + 3) / 4;
    long pstride = (long)K * 16;
    int par = omp_get_max_threads() > 1 && (double)M * N * K > 2e6;
    int esz = y_f32 ? 4 : 2;
#pragma omp parallel if (par)
    {
        int rows = 0;
#pragma omp for schedule(static)
        for (int g = 0; g < ngroup; g++) {
            int p = g * 4;
            int np = npanel - p < 4 ? npanel - p : 4;
            for (int m = 0; m < M; m += 16) {
                int mr = M - m < 16 ? M - m : 16;
                if (mr != rows) {
                    configure(mr);
                    rows = mr;
                }
                block(mr, np, K, x + (long)m * ldx, ldx, wp + p * pstride, pstride, N - p * 16,
                      bias ? bias + p * 16 : 0, (char*)y + ((long)m * ldy + (long)p * 16) * esz,
                      ldy, !y_f32);
            }
        }
        if (rows) _tile_release();
    }
}
#else
int sb_amx_available(void) { return 0; }

void sb_linear_bf16_amx(int M, int N, int K, const uint16_t* x, long ldx, const uint16_t* wp,
                        const uint16_t* bias, void* y, long ldy, int y_f32) {
    (void)M; (void)N; (void)K; (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)ldy;
    (void)y_f32;
}
#endif
