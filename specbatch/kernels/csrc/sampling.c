/* Inverse-CDF sampling of one token per row, the same arithmetic as sampler.py's `sample`:
 * each row's mass summed in float64 from the first token to the last (as torch's cumsum does),
 * the token the first whose running sum exceeds u * total, never past the first whose running
 * sum reaches the total (so a token of zero mass is never returned), clamped to the vocabulary.
 * A row holding NaN returns a token inside the vocabulary. */
#include <stdint.h>

#include "kernels.h"

void sb_sample_rows(int rows, int v, const float* probs, long ld, const float* u, int64_t* out) {
    for (int r = 0; r < rows; r++) {
        const float* p = probs + (long)r * ld;
        double total = 0.0;
        for (int i = 0; i < v; i++) total += (double)p[i];
        const double target = (double)u[r] * total;
        double acc = 0.0;
        long token = v;
        for (int i = 0; i < v; i++) {
            acc += (double)p[i];
            if (token == v && acc > target) token = i;
            if (acc >= total) {
                if (i < token) token = i;
                break;
            }
        }
        out[r] = token < v ? token : v - 1;
    }
}
