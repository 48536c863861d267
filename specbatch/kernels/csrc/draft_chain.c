/* An EAGLE-3 head's draft chains past their roots in one call: draft_loop.py's chains for rows
 * that sample at a temperature alone (no top-k, top-p, min-p, penalty or grammar) or greedily.
 *
 * Row r is one request, drafting depths[r] drafts. At depth d it draws its draft d from
 * q = softmax(logits / temperature) with its uniform u[r, d - 1] (sb_sample_rows's rule), or
 * takes the logits' first argmax where its temperature is 0 (q is then the point mass there),
 * and stores the token and, unless probs is NULL, q. The rows drafting deeper then go through
 * the head together (sb_eagle3_pass), each reading its draft (its row of the embedding table)
 * with its feature at key index base[r] + d - 1 and writing its K/V there: the others write
 * nothing past their own drafts. logits [a, vocab] is the roots' on entry and is overwritten. */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* q = softmax(x / temperature) over v entries (q may not alias x) */
static void softmax_scaled(int v, const float* x, float temperature, float* q) {
    const vf t = vf_set1(temperature);
    vf mx = vf_set1(-INFINITY);
    for (int i = 0; i < v; i += 16) {
        const vmask m = lanes(v - i);
        const vf s = vf_div(load16(x + i, m, 0), t);
        store16(q + i, m, s, 0);
        mx = vf_max(mx, vf_select(m, s, vf_set1(-INFINITY)));
    }
    const vf top = vf_set1(vf_maxval(mx));
    vf sum = vf_zero();
    for (int i = 0; i < v; i += 16) {
        const vmask m = lanes(v - i);
        const vf e = vf_select(m, exp16(vf_sub(load16(q + i, m, 0), top)), vf_zero());
        store16(q + i, m, e, 0);
        sum = vf_add(sum, e);
    }
    const vf total = vf_set1(vf_sum(sum));
    for (int i = 0; i < v; i += 16) {
        const vmask m = lanes(v - i);
        store16(q + i, m, vf_div(load16(q + i, m, 0), total), 0);
    }
}

static int64_t first_argmax(int v, const float* x) {
    int64_t best = 0;
    for (int i = 1; i < v; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* One row's draft: its token, and q into q (scratch where the caller keeps none); u is read
 * only at a temperature above 0 */
static int64_t draw(int v, const float* logits, float temperature, const float* u, float* q) {
    if (temperature == 0.0f) {
        const int64_t token = first_argmax(v, logits);
        memset(q, 0, (size_t)v * sizeof(float));
        q[token] = 1.0f;
        return token;
    }
    softmax_scaled(v, logits, temperature, q);
    int64_t token;
    sb_sample_rows(1, v, q, v, u, &token);
    return token;
}

int sb_eagle3_chain(const int64_t* desc, int hidden, int a, const int64_t* depths,
                    float* logits, const void* state, const void* embed, const void* embed_norm,
                    const void* feature_norm, const void* final_norm, const void* lm_head,
                    int vocab, const float* temperature, const float* u, long ldu,
                    int64_t* tokens, long ldt, float* probs, long ldp, const int64_t* base,
                    const int64_t* block_tables, long bt_stride, void* k_cache, void* v_cache,
                    int kv_heads_stride, int block_size, float eps, float scale, int bf16) {
    const size_t row = (size_t)hidden * (bf16 ? 2 : 4);
    const size_t tables = (size_t)a * (size_t)bt_stride;
    char* block = (char*)malloc(3 * (size_t)a * row + (size_t)vocab * sizeof(float) +
                                ((size_t)6 * a + 1 + tables) * sizeof(int64_t));
    if (!block) return -1;
    char *embedded = block, *features[2] = {block + a * row, block + 2 * a * row};
    float* scratch = (float*)(block + 3 * a * row);
    int64_t* positions = (int64_t*)(scratch + vocab);
    int64_t *slots = positions + a, *seq_lens = slots + a, *qsl = seq_lens + a;
    int64_t *live = qsl + a + 1, *next_live = live + a, *table = next_live + a;
    /* the rows still drafting, in order: logits and features hold theirs, a row each */
    int n = 0, depth = 0, rc = 0;
    for (int r = 0; r < a; r++) {
        if (depths[r] > 0) live[n++] = r;
        if (depths[r] > depth) depth = (int)depths[r];
    }
    const char* current = (const char*)state;
    for (int d = 1; d <= depth && n > 0; d++) {
        int m = 0;
        for (int j = 0; j < n; j++) {
            const int r = (int)live[j];
            const long at = d == 1 ? r : j; /* its row of logits and features: the roots' by row */
            float* q = probs ? probs + r * ldp + (long)(d - 1) * vocab : scratch;
            const int64_t token = draw(vocab, logits + at * vocab, temperature[r],
                                       u + r * ldu + d - 1, q);
            tokens[r * ldt + d - 1] = token;
            if (depths[r] <= d) continue;
            /* drafting deeper: its draft d is read at key index base + d - 1 */
            const int64_t key = base[r] + d - 1;
            memcpy(embedded + m * row, (const char*)embed + token * row, row);
            memmove(features[d % 2] + m * row, current + at * row, row);
            memcpy(table + m * bt_stride, block_tables + r * bt_stride,
                   (size_t)bt_stride * sizeof(int64_t));
            positions[m] = key;
            slots[m] = block_tables[r * bt_stride + key / block_size] * block_size +
                       key % block_size;
            seq_lens[m] = key + 1;
            qsl[m] = m;
            next_live[m++] = r;
        }
        if (m == 0) break;
        qsl[m] = m;
        char* next = features[(d + 1) % 2];
        rc = sb_eagle3_pass(desc, m, embedded, features[d % 2], hidden, embed_norm,
                            feature_norm, final_norm, lm_head, vocab, next, NULL, logits,
                            positions, slots, k_cache, v_cache, kv_heads_stride, block_size, m,
                            qsl, seq_lens, table, bt_stride, NULL, NULL, eps, scale, bf16);
        if (rc != 0) break;
        current = next;
        memcpy(live, next_live, (size_t)m * sizeof(int64_t));
        n = m;
    }
    free(block);
    return rc;
}
