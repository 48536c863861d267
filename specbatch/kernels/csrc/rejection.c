/* The rejection rule of rejection_sampler.py for chains, request by request, the same arithmetic
 * as its torch ops: draft x at position i is accepted while u_i * q_i(x) < p_i(x) (float32; q is
 * the point mass on x when no q is given); at the first rejection, at position n, the extra token
 * is sampled from the float32 residual max(0, p_n - q_n) (p_n without x for a point mass) unless
 * that holds no mass or a NaN, then from p_n; with every draft accepted, from p at the bonus
 * position. Sampling is sampling.c's. Rows past a request's drafts are never read. */
#include <stdint.h>

#include "kernels.h"

void sb_rejection_sample(int batch, int gamma, int v, const int64_t* draft_ids,
                         const int64_t* num_draft, const float* p, long p_sb, long p_sr,
                         const float* q, long q_sb, long q_sr, const float* accept_u,
                         const float* final_u, float* residual, int64_t* tokens,
                         int64_t* accepted) {
    for (int b = 0; b < batch; b++) {
        const int64_t* ids = draft_ids + (long)b * gamma;
        const float* pb = p + b * p_sb;
        const float* qb = q ? q + b * q_sb : 0;
        int64_t* out = tokens + (long)b * (gamma + 1);
        int n = (int)num_draft[b], a = 0;
        for (; a < n; a++) {
            int64_t x = ids[a];
            float qx = qb ? qb[a * q_sr + x] : 1.0f;
            if (!(accept_u[(long)b * gamma + a] * qx < pb[a * p_sr + x])) break;
            out[a] = x;
        }
        for (int i = a + 1; i <= gamma; i++) out[i] = 0;
        const float* pn = pb + a * p_sr;
        const float* row = pn;
        if (a < n) {
            int positive = 0, nan = 0;
            for (int j = 0; j < v; j++) {
                float d = qb ? pn[j] - qb[a * q_sr + j] : (j == ids[a] ? 0.0f : pn[j]);
                float r = d < 0.0f ? 0.0f : d; /* NaN stays NaN, as torch.clamp keeps it */
                residual[j] = r;
                positive |= r > 0.0f;
                nan |= r != r;
            }
            if (positive && !nan) row = residual;
        }
        sb_sample_rows(1, v, row, v, final_u + b, out + a);
        accepted[b] = a;
    }
}
