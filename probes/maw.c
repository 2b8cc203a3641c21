/* HGCA's moving average of attention weights, one decode step (HGCA Algorithm 1, line 8):
 * MAW[b, h, n] <- (1 - alpha) MAW[b, h, n] + alpha exp(scale q_bh . k_bgn - lse_bh) over the
 * accelerator window's N keys, g = h / (Hq / Hkv); the slot just written (slot >= 0) takes
 * its first weight instead (the `authors` rule, beyond-ae's add_cache).
 *
 * In torch this is a batched matmul, sub_, exp_, mul_, add_ and an indexed copy: 150 us a
 * call alone and 250-400 us inside a decode step (4 x 9 heads x 512 keys x 64, float32,
 * 2-core AMD EPYC VM). Here one call on the attention kernel's inner loops (attn_loops.c:
 * a KV head's G queries scored against a block of keys read once, then the vectorised
 * exp), the (b, KV head) rows split over `threads` OpenMP threads; q/lse contiguous
 * [B, Hq, 1, D] / [B, Hq], maw contiguous [B, Hq, N], k float32 with element strides
 * (batch, head, token) and a contiguous last dimension.
 */
#pragma GCC optimize("O3")
#include "attn.h"
#include "native.h"

void kvb_maw(const float *q, const float *k, const float *lse, float *maw, int64_t B,
             int64_t Hq, int64_t Hkv, int64_t N, int64_t D, const int64_t *ks, float scale,
             float alpha, int64_t slot, int threads) {
    const int64_t G = Hq / Hkv;
    const isa_t *isa = kvb_attn_loops(0, D, kvb_attn_isa(-1)); /* float32: no permutation */
#pragma omp parallel for num_threads(kvb_team(threads)) schedule(static)
    for (int64_t r = 0; r < B * Hkv; r++) { /* row (b, g): query heads g*G .. g*G + G - 1 */
        float qf[G * D], s[G * BLK];
        const void *kp[BLK];
        const int64_t h0 = r * G; /* = b * Hq + g * G */
        for (int64_t i = 0; i < G * D; i++) qf[i] = q[h0 * D + i] * scale;
        const float *kr = k + (r / Hkv) * ks[0] + (r % Hkv) * ks[1];
        for (int64_t j0 = 0; j0 < N; j0 += BLK) {
            const int64_t nb = N - j0 < BLK ? N - j0 : BLK;
            for (int64_t j = 0; j < nb; j++) kp[j] = kr + (j0 + j) * ks[2];
            isa->scores(s, qf, G, D, kp, nb, NULL); /* no prefetch: the window is cached */
            for (int64_t t = 0; t < G; t++) {
                float *a = s + t * BLK, *m = maw + (h0 + t) * N + j0;
                isa->expsum(a, nb, lse[h0 + t]);
                for (int64_t j = 0; j < nb; j++)
                    m[j] = j0 + j == slot ? a[j] : (1.0f - alpha) * m[j] + alpha * a[j];
            }
        }
    }
}
