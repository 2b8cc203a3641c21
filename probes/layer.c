/* A Llama decoder layer's dense work at decode on the CPU, in two calls around its attention
 * (kvbench.models.decoder.LlamaLayer; the attention stays the run's strategy):
 *
 *   pre   h = RMSNorm(x); [q | k | v] = h W_qkv^T; RoPE on q and k
 *   post  x += a W_o^T; [g | u] = RMSNorm(x) W_gate_up^T; x += (silu(g) * u) W_down^T
 *
 * x [B, H] (B decode rows, 1 to MAX_B), a [B, Hq * D] the attention output, q [B, Hq, D],
 * k/v [B, Hkv, D], weights row-major as nn.Linear stores them (the fused projections of
 * kvbench.models.decoder.FUSED). Each half is one OpenMP region on torch's threads: the
 * matmuls are split across the threads as kvb_gemv splits them (one sequential stream of W
 * each), and the threads meet at a barrier between dependent steps; the residual adds are
 * the matmuls' own (gemv_t.acc). The module path dispatches about twenty torch ops a layer
 * (norms, views, RoPE's three ops, SiLU, the product, the adds) and opens four regions.
 * Same arithmetic, in float32, as the module path: RoPE as apply_rope (x cos + x[perm] sin,
 * the tables' signed sin), SiLU as g / (1 + exp(-g)).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "native.h"

#ifdef _OPENMP
extern int omp_get_thread_num(void), omp_get_num_threads(void);
#define THREAD omp_get_thread_num()
#define THREADS omp_get_num_threads()
#else
#define THREAD 0
#define THREADS 1
#endif

/* This thread's share of g's rows. */
static void share(const gemv_t *g) {
    int64_t n0, n1;
    kvb_gemv_share(g->N, THREAD, THREADS, &n0, &n1);
    kvb_gemv_range(g, n0, n1);
}

/* decode.h says what it does. */
void kvb_norm_then(const float *x, const float *nw, float eps, float *h, int64_t B, int64_t H,
                   const gemv_t *g) {
#pragma omp single
    kvb_rmsnorm(x, nw, h, B, H, eps);
    share(g);
#pragma omp barrier
}

/* Inside a parallel region, pre's work (kvb_llama_pre) with qkv [B, N] scratch; the k and v
 * rows of (sequence b, KV head j) go to k + b * ks[0] + j * ks[1] (likewise v): a buffer of
 * their own or a cache's slot for this position (step.c). Done when the threads leave. */
void kvb_llama_pre_in(const float *x, const float *nw, float eps, const float *wqkv,
                      const float *cos, const float *sin, const int64_t *perm, float *h,
                      float *qkv, float *q, float *k, const int64_t *ks, float *v,
                      const int64_t *vs, int64_t B, int64_t H, int64_t Hq, int64_t Hkv,
                      int64_t D) {
    const int64_t heads = Hq + 2 * Hkv, N = heads * D;
    const gemv_t g = {wqkv, h, qkv, N, H, B, H, 0};
    kvb_norm_then(x, nw, eps, h, B, H, &g);
#pragma omp for
    for (int64_t r = 0; r < B * heads; r++) {
        const int64_t b = r / heads, j = r % heads;
        const float *s = qkv + b * N + j * D;
        if (j >= Hq + Hkv) {
            memcpy(v + b * vs[0] + (j - Hq - Hkv) * vs[1], s, sizeof(float) * D);
            continue;
        }
        float *o = j < Hq ? q + (b * Hq + j) * D : k + b * ks[0] + (j - Hq) * ks[1];
        for (int64_t d = 0; d < D; d++) o[d] = s[d] * cos[d] + s[perm[d]] * sin[d];
    }
}

/* Inside a parallel region, post's work (kvb_llama_post) with scratch [B * (H + 3F)]
 * floats; x is final when the threads leave. */
void kvb_llama_post_in(float *x, const float *a, const float *wo, const float *nw, float eps,
                       const float *wgu, const float *wd, float *scratch, int64_t B, int64_t H,
                       int64_t A, int64_t F) {
    float *h = scratch, *gu = h + B * H, *m = gu + B * 2 * F;
    const gemv_t o = {wo, a, x, H, A, B, A, 1}, up = {wgu, h, gu, 2 * F, H, B, H, 0},
                 down = {wd, m, x, H, F, B, F, 1};
    share(&o);
#pragma omp barrier
    kvb_norm_then(x, nw, eps, h, B, H, &up);
#pragma omp for
    for (int64_t r = 0; r < B * F; r++) {
        const float gv = gu[r / F * 2 * F + r % F], uv = gu[r / F * 2 * F + F + r % F];
        m[r] = gv / (1.0f + expf(-gv)) * uv;
    }
    share(&down);
#pragma omp barrier
}

/* Returns 0, -1 when the scratch buffer could not be had, -2 when B is outside 1..MAX_B.
 * cos/sin: the RoPE tables' row of this position [D]; perm [D] (kvbench.models.decoder's
 * rope_tables). */
int kvb_llama_pre(const float *x, const float *nw, float eps, const float *wqkv,
                  const float *cos, const float *sin, const int64_t *perm, float *h, float *q,
                  float *k, float *v, int64_t B, int64_t H, int64_t Hq, int64_t Hkv, int64_t D,
                  int threads) {
    if (B < 1 || B > MAX_B) return -2;
    float *qkv = malloc(sizeof(float) * B * (Hq + 2 * Hkv) * D);
    if (!qkv) return -1;
    const int64_t st[2] = {Hkv * D, D};
#pragma omp parallel num_threads(kvb_team(threads))
    kvb_llama_pre_in(x, nw, eps, wqkv, cos, sin, perm, h, qkv, q, k, st, v, st, B, H, Hq, Hkv,
                     D);
    free(qkv);
    return 0;
}

/* x [B, H] updated in place; a [B, A]; W_o [H, A], W_gate_up [2F, H], W_down [H, F]. Returns
 * as kvb_llama_pre. */
int kvb_llama_post(float *x, const float *a, const float *wo, const float *nw, float eps,
                   const float *wgu, const float *wd, int64_t B, int64_t H, int64_t A,
                   int64_t F, int threads) {
    if (B < 1 || B > MAX_B) return -2;
    float *scratch = malloc(sizeof(float) * B * (H + 3 * F));
    if (!scratch) return -1;
#pragma omp parallel num_threads(kvb_team(threads))
    kvb_llama_post_in(x, a, wo, nw, eps, wgu, wd, scratch, B, H, A, F);
    free(scratch);
    return 0;
}
