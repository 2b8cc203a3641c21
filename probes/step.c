/* A Llama decode step with full attention on the CPU in one call and one OpenMP region:
 * for every layer, layer.c's first half with the new token's k and v written straight into
 * the cache at position `pos`, attention of the query over cache positions 0..pos (attn.c's
 * tasks and merge), layer.c's second half; then the final RMSNorm and the logits head.
 *
 * The reference of issue 26 ("full attention's runtime near its bytes bound"): a decode step
 * of the layer-by-layer path makes three native calls a layer with Python, a dozen small
 * torch ops and a fresh parallel region between them, and the memory stream of the weights
 * stops at each; here the threads go from one matrix to the next at a barrier. The same
 * arithmetic, in float32, as the layer-by-layer path (kvbench.kernels.step checks it).
 *
 * x [B, H] (updated in place, the residual stream), logits [B, V]; the caches [B, Hkv,
 * max_len, D] with element strides ks/vs (batch, head, token), the last dimension
 * contiguous; cos/sin the RoPE tables' row of `pos` [D], perm [D]; scale the attention's
 * (D^-0.5); attn_s [L]: the seconds
 * of each layer's attention (from its plan to its merge, thread 0's clock), what the
 * layer-by-layer path times as its attention call.
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <stdlib.h>
#include <time.h>

#include "attn.h"
#include "decode.h"

typedef struct {
    const float *nw1, *wqkv, *wo, *nw2, *wgu, *wd; /* one layer's weights (layer.c) */
    float *kc, *vc;                                /* its cache */
    int64_t ks[3], vs[3];                          /* their element strides */
} kvb_layer_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Returns 0, -1 when a buffer could not be had, -2 when B is outside 1..MAX_B. */
int kvb_llama_step(const kvb_layer_t *layers, int64_t L, float *x, float eps,
                   const float *norm, const float *head, int64_t V, float *logits,
                   const float *cos, const float *sin, const int64_t *perm, float scale,
                   int64_t pos, int64_t B, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t F,
                   double *attn_s, int threads) {
    if (B < 1 || B > MAX_B) return -2;
    const int64_t N = (Hq + 2 * Hkv) * D, A = Hq * D;
    float *buf = malloc(sizeof(float) * B * (H + N + 2 * A + Hq + H + 3 * F));
    if (!buf) return -1;
    float *h = buf, *qkv = h + B * H, *q = qkv + B * N, *a = q + B * A, *lse = a + B * A,
          *scratch = lse + B * Hq;
    const gemv_t logit = {head, h, logits, V, H, B, H, 0};
    kvb_attn_job_t job;
    int failed = 0;
    double t0 = 0.0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        const int nt = threads < 1 ? 1 : threads;
        for (int64_t l = 0; l < L; l++) {
            const kvb_layer_t *y = layers + l;
            kvb_llama_pre_in(x, y->nw1, eps, y->wqkv, cos, sin, perm, h, qkv, q,
                             y->kc + pos * y->ks[2], y->ks, y->vc + pos * y->vs[2], y->vs, B,
                             H, Hq, Hkv, D);
#pragma omp single
            {
                t0 = now_s();
                if (kvb_attn_plan(&job, 0, q, y->kc, y->vc, a, lse, B, Hq, Hkv, 1, pos + 1, D,
                                  y->ks, y->vs, NULL, NULL, NULL, 0, 0, 0, Hkv,
                                  scale, 0, pos, 1, nt))
                    failed = 1;
            }
            kvb_attn_work(&job);
#pragma omp barrier
#pragma omp single
            {
                failed |= kvb_attn_end(&job) != 0;
                attn_s[l] = now_s() - t0;
            }
            kvb_llama_post_in(x, a, y->wo, y->nw2, eps, y->wgu, y->wd, scratch, B, H, A, F);
        }
        kvb_norm_then(x, norm, eps, h, B, H, &logit);
    }
    free(buf);
    return failed ? -1 : 0;
}
