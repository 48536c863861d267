/* An EAGLE-3 head's whole drafting call for chains, as eagle_proposer.py runs it in three:
 * the head's pass over the t rows it has not seen (row i reads token ids[i]'s row of the
 * embedding table and the target's features of its position, fused by fc), then each drafting
 * request's root (its last such row, rows[r]: q's logits there and the feature the next pass
 * reads), then its chain past the root (sb_eagle3_chain). Every step computes what the separate
 * calls do, in the same order, so the drafts and q are the same bits. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "kernels.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int sb_eagle3_round(const int64_t* desc, int h, int t, const int64_t* ids,
                    const void* target_features, long ldtf, int fc_in, const void* fc, const void* fc_bias,
                    const int64_t* positions, const int64_t* slots, int num_seqs,
                    const int64_t* qsl, const int64_t* seq_lens, const int64_t* catch_tables,
                    long catch_stride, int a, const int64_t* rows, const int64_t* depths,
                    const void* embed, const void* embed_norm, const void* feature_norm,
                    const void* final_norm, const void* lm_head, int vocab,
                    const float* temperature, const float* u, long ldu, int64_t* tokens,
                    long ldt, float* probs, long ldp, const int64_t* base,
                    const int64_t* block_tables, long bt_stride, void* k_cache, void* v_cache,
                    int kv_heads_stride, int block_size, float eps, float scale, int bf16,
                    double* catch_up_seconds) {
    const double start = now();
    const size_t row = (size_t)h * (bf16 ? 2 : 4);
    char* block = (char*)malloc((size_t)(4 * t + 2 * a) * row + (size_t)a * vocab * sizeof(float));
    if (!block) return -1;
    char *embedded = block, *features = embedded + t * row, *pre = features + t * row;
    char *normed = pre + t * row, *root_normed = normed + t * row, *state = root_normed + a * row;
    float* logits = (float*)(state + a * row);
    for (int i = 0; i < t; i++)
        memcpy(embedded + i * row, (const char*)embed + ids[i] * row, row);
    if (bf16)
        sb_linear_bf16(t, h, fc_in, (const uint16_t*)target_features, ldtf, (const uint16_t*)fc,
                       (const uint16_t*)fc_bias, features, h, 0);
    else
        sb_linear_f32(t, h, fc_in, (const float*)target_features, ldtf, (const float*)fc,
                      (const float*)fc_bias, (float*)features, h);
    int rc = sb_eagle3_pass(desc, t, embedded, features, h, embed_norm, feature_norm, final_norm,
                            NULL, vocab, pre, normed, NULL, positions, slots, k_cache, v_cache,
                            kv_heads_stride, block_size, num_seqs, qsl, seq_lens, catch_tables,
                            catch_stride, NULL, NULL, eps, scale, bf16);
    if (rc == 0) {
        for (int r = 0; r < a; r++) {
            memcpy(root_normed + r * row, normed + rows[r] * row, row);
            memcpy(state + r * row, pre + rows[r] * row, row);
        }
        if (bf16)
            sb_linear_bf16(a, vocab, h, (const uint16_t*)root_normed, h,
                           (const uint16_t*)lm_head, NULL, logits, vocab, 1);
        else
            sb_linear_f32(a, vocab, h, (const float*)root_normed, h, (const float*)lm_head, NULL,
                          logits, vocab);
    }
    *catch_up_seconds = now() - start;
    if (rc == 0)
        rc = sb_eagle3_chain(desc, h, a, depths, logits, state, embed, embed_norm, feature_norm,
                             final_norm, lm_head, vocab, temperature, u, ldu, tokens, ldt, probs,
                             ldp, base, block_tables, bt_stride, k_cache, v_cache,
                             kv_heads_stride, block_size, eps, scale, bf16);
    free(block);
    return rc;
}
