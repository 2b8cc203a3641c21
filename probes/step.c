/* A Llama decode step on the CPU in one call and one OpenMP region: for every layer,
 * layer.c's first half with the new token's k and v written straight into the cache, the
 * strategy's attention over the cache, layer.c's second half; then the
 * final RMSNorm and the logits head.
 *
 * Attention is dense over the cache (attn.c's tasks and merge), or, for a layer with Quest's
 * digests (`lo`), Quest's decode (Quest Alg. 1, kvbench.strategies.quest):
 * the token's key joins its page's min/max digest, and where the layer selects this step,
 * the top pages by the digests' bound (pages.c) are attended (attn.c's sparse rows).
 *
 * Issue 26 asks for every strategy's decode step in a bounded number of calls and the
 * reference near its bytes bound: layer by layer a decode step makes three native calls a
 * layer with Python, small torch ops and a fresh parallel region between them, and the
 * memory stream of the weights stops at each; here the threads go from one matrix to the
 * next at a barrier. The same arithmetic, in float32, as the layer-by-layer path
 * (kvbench.kernels.step checks it).
 *
 * For a layer with ArkVale's pool (`slot_page`), ArkVale's decode (ArkVale sections 4-5,
 * kvbench.strategies.arkvale): where the context has more full pages than the pool, the
 * top pages by the digests' estimate are made resident, recalled from the host backup
 * (pages.c), then attention runs over the pool and the current page.
 *
 * The new token (position `pos`, its RoPE row) goes to a layer's cache slot `at` and its
 * attention reads slots 0..n-1 (full attention and Quest: at = pos, n = pos + 1;
 * StreamingLLM: its ring's slot and the slots filled; ArkVale: the current page's next
 * slot after the pool's; softmax does not depend on the slots' order).
 *
 * The step starts from the tokens' rows of the embedding table emb [rows, H] (tok: B ids,
 * `tstride` apart; Llama's embedding is a plain lookup), copied into x before the region:
 * as a torch op, with its Python, the lookup took 60 us of the KV-bound step.
 *
 * x [B, H] (the residual stream, a buffer of the caller's), logits [B, V]; the caches [B, Hkv,
 * slots, D] with element strides ks/vs (batch, head, slot), the last dimension
 * contiguous; digests [B, Hkv, P, D] likewise (ds); ArkVale's pool is a cache of pages of
 * contiguous rows, its host backup bk/bv [P, B, Hkv, page, D] contiguous and slot_page
 * [B, Hkv, slots]; cos/sin the RoPE tables' row of `pos` [D], perm [D]; scale the
 * attention's (D^-0.5). Per layer, attn_s: the seconds of its attention (digest,
 * selection and attention: what the layer-by-layer path times as its strategy's call;
 * thread 0's clock) and sel_s those of its selection or recall (-1: none); moved: pages
 * recalled and evicted (ArkVale).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "decode.h"
#include "native.h"

typedef struct {
    const float *nw1, *wqkv, *wo, *nw2, *wgu, *wd; /* one layer's weights (layer.c) */
    float *kc, *vc;                                /* its cache */
    int64_t ks[3], vs[3];                          /* their element strides */
    float *lo, *hi;       /* Quest's min/max or ArkVale's digests (NULL: none) */
    int64_t ds[3];        /* their element strides */
    int32_t *idx, *lens;  /* the layer's selection [B * rows, ld], [B * rows] (NULL: dense) */
    int64_t at, n;        /* the new token's slot, the slots attended */
    int64_t *slot_page;   /* ArkVale's pool: the page in each slot (NULL: none) */
    const float *bk, *bv; /* and its host backup */
    int64_t *moved;       /* [2]: pages recalled, evicted this step */
} kvb_layer_t;

/* Quest's selection this step (Quest section 3.2-3.3; pages.c): pages of `page` tokens,
 * k of them kept per row (k >= the pages cached: every layer attends densely), the first
 * `sinks` and last `window` forced in; rows per KV head (per_kv, the group's q summed) or
 * per query head; a selection row is `ld` int32 long. */
typedef struct {
    int64_t page, k, sinks, window, ld;
    int per_kv;
} kvb_pages_t;

/* Returns 0, -1 when a buffer could not be had (or a pool's slots were inconsistent), -2
 * when B is outside 1..MAX_B, a token outside the embedding's rows or a selection would not
 * fit its rows. `pages` NULL: no digests are updated, no layer selects; `recall` NULL: no
 * pool recalls. */
int kvb_llama_step(const kvb_layer_t *layers, int64_t L, const kvb_pages_t *pages,
                   const kvb_recall_t *recall, const int64_t *tok, int64_t tstride,
                   const float *emb, int64_t rows_emb, float *x, float eps, const float *norm,
                   const float *head, int64_t V, float *logits, const float *cos,
                   const float *sin, const int64_t *perm, float scale, int64_t pos, int64_t B,
                   int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t F, double *attn_s,
                   double *sel_s, int threads) {
    const int64_t N = (Hq + 2 * Hkv) * D, A = Hq * D;
    if (B < 1 || B > MAX_B) return -2;
    for (int64_t b = 0; b < B; b++)
        if (tok[b * tstride] < 0 || tok[b * tstride] >= rows_emb) return -2;
    for (int64_t b = 0; b < B; b++)
        memcpy(x + b * H, emb + tok[b * tstride] * H, sizeof(float) * H);
    for (int64_t l = 0; pages && l < L; l++) /* a layer that selects: its rows hold k pages */
        if (layers[l].idx && pages->k < (layers[l].n + pages->page - 1) / pages->page &&
            pages->k * pages->page > pages->ld)
            return -2;
    float *buf = malloc(sizeof(float) * B * (H + N + 2 * A + Hq + H + 3 * F));
    if (!buf) return -1;
    float *h = buf, *qkv = h + B * H, *q = qkv + B * N, *a = q + B * A, *lse = a + B * A,
          *scratch = lse + B * Hq;
    const gemv_t logit = {head, h, logits, V, H, B, H, 0};
    const int64_t rows = pages && !pages->per_kv ? Hq : Hkv; /* selection rows a sequence */
    const int nt = kvb_team(threads);
    kvb_attn_job_t job;
    int failed = 0;
    uint64_t t0 = 0, t1 = 0; /* thread 0's clock (ns) at the layer's attention and selection */
#pragma omp parallel num_threads(nt)
    {
        for (int64_t l = 0; l < L; l++) {
            const kvb_layer_t *y = layers + l;
            const int64_t n = y->n, n_pages = pages ? (n + pages->page - 1) / pages->page : 0;
            const int sparse = y->idx && pages && pages->k < n_pages;
            const int recalls = y->slot_page && recall && recall->nf > recall->slots;
            kvb_llama_pre_in(x, y->nw1, eps, y->wqkv, cos, sin, perm, h, qkv, q,
                             y->kc + y->at * y->ks[2], y->ks, y->vc + y->at * y->vs[2], y->vs,
                             B, H, Hq, Hkv, D);
#pragma omp single
            {
                t0 = kvb_now_ns();
                if (y->lo && pages)
                    kvb_digest_token(y->kc + y->at * y->ks[2], y->ks, y->lo, y->hi, y->ds, B,
                                     Hkv, D, pos / pages->page, pos % pages->page == 0);
                if (y->moved) y->moved[0] = y->moved[1] = 0;
                t1 = kvb_now_ns();
            }
            if (recalls)
                kvb_recall_in(q, B, Hq, Hkv, D, y->lo, y->hi, y->ds, recall, y->slot_page,
                              y->kc, y->ks, y->vc, y->vs, y->bk, y->bv, y->moved, &failed);
            if (sparse)
                kvb_page_select_in(q, B, Hq, Hkv, D, y->lo, y->hi, y->ds, n_pages, pages->k,
                                   pages->sinks, pages->window, pages->per_kv, pages->page, n,
                                   y->idx, pages->ld, y->lens, &failed);
#pragma omp single
            {
                sel_s[l] = sparse || (y->slot_page && recall)
                               ? 1e-9 * (double)(kvb_now_ns() - t1) : -1.0;
                const int rc = sparse ? kvb_attn_plan(
                    &job, 0, q, y->kc, y->vc, a, lse, B, Hq, Hkv, 1, n, D, y->ks, y->vs,
                    y->idx, y->lens, NULL, pages->k * pages->page, pages->ld, 0, rows, scale,
                    0, 0, 1, nt) : kvb_attn_plan(
                    &job, 0, q, y->kc, y->vc, a, lse, B, Hq, Hkv, 1, n, D, y->ks, y->vs, NULL,
                    NULL, NULL, 0, 0, 0, Hkv, scale, 0, n - 1, 1, nt);
                if (rc) failed = 1;
            }
            kvb_attn_work(&job);
#pragma omp barrier
#pragma omp single
            {
                failed |= kvb_attn_end(&job) != 0;
                attn_s[l] = 1e-9 * (double)(kvb_now_ns() - t0);
            }
            kvb_llama_post_in(x, a, y->wo, y->nw2, eps, y->wgu, y->wd, scratch, B, H, A, F);
        }
        kvb_norm_then(x, norm, eps, h, B, H, &logit);
    }
    free(buf);
    return failed ? -1 : 0;
}
