/* Decode's dense kernels shared by gemv.c and norm.c (one call per matmul or norm) and
 * layer.c (a decoder layer's matmuls and norms inside one OpenMP region). */
#ifndef KVB_DECODE_H
#define KVB_DECODE_H
#include <stdint.h>

#define MAX_B 8 /* activation rows per call */

/* y [B, N] (rows N floats apart) = x [B, K] (rows ldx floats apart) . w [N, K]^T, or
 * y += that when `acc` (a residual added in place). */
typedef struct {
    const float *w, *x;
    float *y;
    int64_t N, K, B, ldx;
    int acc;
} gemv_t;

/* Rows [n0, n1) of g's product on the calling thread (AVX2/FMA where chosen). */
__attribute__((visibility("hidden"))) void kvb_gemv_range(const gemv_t *g, int64_t n0,
                                                          int64_t n1);
/* Thread t of T's share [*n0, *n1) of N rows: contiguous, one sequential stream each. */
__attribute__((visibility("hidden"))) void kvb_gemv_share(int64_t N, int64_t t, int64_t T,
                                                          int64_t *n0, int64_t *n1);
/* A Llama layer's halves inside a parallel region (layer.c; step.c runs a whole step). */
__attribute__((visibility("hidden"))) void kvb_llama_pre_in(
    const float *x, const float *nw, float eps, const float *wqkv, const float *cos,
    const float *sin, const int64_t *perm, float *h, float *qkv, float *q, float *k,
    const int64_t *ks, float *v, const int64_t *vs, int64_t B, int64_t H, int64_t Hq,
    int64_t Hkv, int64_t D);
__attribute__((visibility("hidden"))) void kvb_llama_post_in(
    float *x, const float *a, const float *wo, const float *nw, float eps, const float *wgu,
    const float *wd, float *scratch, int64_t B, int64_t H, int64_t A, int64_t F);
/* Inside a parallel region: h = RMSNorm(x) on one thread, then every thread's share of g
 * (which reads h); done when the threads leave (layer.c). */
__attribute__((visibility("hidden"))) void kvb_norm_then(const float *x, const float *nw,
                                                         float eps, float *h, int64_t B,
                                                         int64_t H, const gemv_t *g);
/* Quest's page selection inside a parallel region and its digests after one token (pages.c,
 * for step.c). */
__attribute__((visibility("hidden"))) void kvb_page_select_in(
    const float *q, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const float *lo,
    const float *hi, const int64_t *ds, int64_t n_pages, int64_t k, int64_t sinks,
    int64_t window, int per_kv, int64_t page, int64_t n, int32_t *idx, int64_t ld,
    int32_t *lens, int *failed);
void kvb_digest_token(const float *k, const int64_t *ks, float *lo, float *hi,
                      const int64_t *ds, int64_t B, int64_t H, int64_t D, int64_t p, int fresh);
/* ArkVale's selection and recall in a step (ArkVale sections 4-5, Alg. 1 lines 2-6 and 11;
 * pages.c): pages of `page` tokens, a pool of `slots` full pages, `nf` pages completed
 * (the step selects when nf > slots), `k` of them kept, the first `sinks` and the last
 * `window` full ones forced in; pages >= `fresh` were completed this step (copied, not
 * counted as recalled); one set per sequence (`per_layer`, every head's score summed) or
 * per KV head. */
typedef struct {
    int64_t page, slots, nf, k, sinks, window, fresh;
    int per_layer;
} kvb_recall_t;
/* Inside a parallel region: make the top pages of each row resident in the pool k/v (page
 * slot s of row (b, h) at b * ks[0] + h * ks[1] + s * page * D, rows of D floats
 * contiguous), copied from the host backup bk/bv [P, B, Hkv, page, D]; slot_page [B, Hkv,
 * slots] says which page each slot holds; moved[0] += pages recalled, moved[1] += pages
 * evicted. */
__attribute__((visibility("hidden"))) void kvb_recall_in(
    const float *q, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const float *lo,
    const float *hi, const int64_t *ds, const kvb_recall_t *r, int64_t *slot_page, float *pk,
    const int64_t *ks, float *pv, const int64_t *vs, const float *bk, const float *bv,
    int64_t *moved, int *failed);
/* y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for `rows` rows of `dim` floats (norm.c). */
void kvb_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim,
                 float eps);
#endif
