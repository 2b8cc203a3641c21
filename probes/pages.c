/* Quest's page selection in one call (Quest section 3.2-3.3): score every page from its
 * min/max digest, keep the sinks, the window and the top of the rest, list their tokens.
 *
 * For each row (a sequence's KV head, its query heads' q summed first, or each query head):
 * score[p] = sum_d q+[d] hi[p, d] + q-[d] lo[p, d] (the upper bound of q . k over the page,
 * as kvbench.strategies._pages.page_scores computes it), the first `sinks` and last `window`
 * pages forced in, the k best by score kept (quickselect), their ids sorted ascending, and
 * their token positions (< n) written with the row's count. A (sequence, KV head)'s
 * digests are read once for all its rows; groups run on torch's OpenMP threads. What a
 * torch path does in about thirty dispatched ops a layer, and no output whose size depends
 * on the data: every row writes k * page slots, its count says how many hold positions
 * (the rest 0).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "decode.h"
#include "native.h"
#include "sum8.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVB_X86 1
#endif

typedef struct { float s; int32_t p; } ranked;

/* Partition so that a[0..k) are the k largest scores (Hoare quickselect, ties arbitrary). */
static void top_k(ranked *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = a[lo + (hi - lo) / 2].s;
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i].s > pivot) i++;
            while (a[j].s < pivot) j--;
            if (i <= j) {
                const ranked t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* A page's score: sum_d qp[d] hi[d] + qn[d] lo[d], in eight partial sums that GCC keeps in
 * one vector register. One running sum made the loop a chain of dependent adds: with it
 * and each query head re-reading its group's digests, a layer's selection at 4 x 3 KV
 * heads x 500 pages of 64 took 200-210 us per KV group and 580-620 us per query head,
 * against 85-115 and 265-305 us now (interleaved, 2-core AMD EPYC VM, 2026-11-27). */
static inline float bound(const float *qp, const float *qn, const float *u, const float *l,
                          int64_t D) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, s = 0.0f;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int i = 0; i < 8; i++) a[i] += qp[d + i] * u[d + i] + qn[d + i] * l[d + i];
    for (; d < D; d++) s += qp[d] * u[d] + qn[d] * l[d];
    return s + kvb_sum8(a);
}

#define AHEAD 32 /* pages whose digests are fetched ahead of their scores */

#ifdef KVB_X86
/* `bounds` with sixteen (AVX-512) or eight (AVX2/FMA) channels an instruction, the next
 * pages' digests fetched ahead (AHEAD pages; 8 gained less): a layer's selection at 4 x 3
 * KV heads x 500 pages of 64 (2 threads, 2-core AMD EPYC Zen 5 VM, 2026-11-27) took 39-47
 * us per KV group and 76-96 per query head with its digests in cache, 93-116 and 111-139
 * from memory, against 56, 136, 99 and 159 us with the portable loop (SSE2 by default). */
#define A512 __attribute__((target("avx512f,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))
/* One set's loops: W channels a vector (V its type, P its intrinsics' prefix), SUM its
 * horizontal sum. */
#define BOUNDS(NAME, ATTR, V, P, W, SUM)                                                   \
    static ATTR void NAME(const float *qp, const float *qn, int64_t R, const float *u,     \
                          const float *l, int64_t stride, int64_t n, int64_t D,           \
                          float *out) {                                                   \
        for (int64_t p = 0; p < n; p++) {                                                 \
            const float *up = u + p * stride, *lp = l + p * stride;                       \
            if (p + AHEAD < n)                                                            \
                for (int64_t d = 0; d < D; d += 16) {                                     \
                    _mm_prefetch((const char *)(up + AHEAD * stride + d), _MM_HINT_T0);   \
                    _mm_prefetch((const char *)(lp + AHEAD * stride + d), _MM_HINT_T0);   \
                }                                                                         \
            for (int64_t i = 0; i < R; i++) {                                             \
                V a = P##_setzero_ps(), b = P##_setzero_ps();                             \
                for (int64_t d = 0; d < D; d += W) {                                      \
                    a = P##_fmadd_ps(P##_loadu_ps(qp + i * D + d), P##_loadu_ps(up + d), a); \
                    b = P##_fmadd_ps(P##_loadu_ps(qn + i * D + d), P##_loadu_ps(lp + d), b); \
                }                                                                         \
                out[i * n + p] += SUM(P##_add_ps(a, b));                                  \
            }                                                                             \
        }                                                                                 \
    }
BOUNDS(bounds512, A512, __m512, _mm512, 16, _mm512_reduce_add_ps)
BOUNDS(bounds256, AVX2, __m256, _mm256, 8, kvb_hsum256)
#endif

/* out[i * n + p] += the bound of row i's q+/q- (qp/qn [R, D]) over page p's digests (hi u,
 * lo l, pages `stride` floats apart), for n pages: in the attention loops' instruction set
 * (kvb_attn_isa: the best the CPU has, or the one a test forces). */
static void bounds(const float *qp, const float *qn, int64_t R, const float *u,
                   const float *l, int64_t stride, int64_t n, int64_t D, float *out) {
#ifdef KVB_X86
    const int isa = kvb_attn_isa(-1);
    if (isa == 2 && D % 16 == 0) {
        bounds512(qp, qn, R, u, l, stride, n, D, out);
        return;
    }
    if (isa >= 1 && D % 8 == 0) {
        bounds256(qp, qn, R, u, l, stride, n, D, out);
        return;
    }
#endif
    for (int64_t p = 0; p < n; p++)
        for (int64_t i = 0; i < R; i++)
            out[i * n + p] += bound(qp + i * D, qn + i * D, u + p * stride, l + p * stride, D);
}

/* The positive and negative parts of the G query heads of KV head `hk` of sequence b (q [B,
 * Hq, D]) into qp/qn: summed into one row (`sum`: the group's selection), or a row per head;
 * a score is then `bounds` of each row. */
static void signed_parts(const float *q, int64_t Hq, int64_t G, int64_t D, int64_t b,
                         int64_t hk, int sum, float *qp, float *qn) {
    for (int64_t i = 0; i < (sum ? 1 : G) * D; i++) qp[i] = qn[i] = 0.0f;
    for (int64_t g = 0; g < G; g++) /* query head hk * G + g into row g (or 0) */
        for (int64_t d = 0; d < D; d++) {
            const float x = q[(b * Hq + hk * G + g) * D + d];
            const int64_t at = (sum ? 0 : g) * D + d;
            if (x > 0) qp[at] += x; else qn[at] += x;
        }
}

static int by_id(const void *x, const void *y) {
    return ((const ranked *)x)->p - ((const ranked *)y)->p;
}

/* Every thread of a parallel region (or the caller alone): kvb_page_select's work with the
 * rows of idx `ld` apart (>= k * page); *failed set when a thread could not get its
 * scratch. Done when the threads leave. */
void kvb_page_select_in(const float *q, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                        const float *lo, const float *hi, const int64_t *ds, int64_t n_pages,
                        int64_t k, int64_t sinks, int64_t window, int per_kv, int64_t page,
                        int64_t n, int32_t *idx, int64_t ld, int32_t *lens, int *failed) {
    /* a group is one (sequence, KV head): its digests are read once for its R rows (the
     * group's summed q, or each of its G query heads) */
    const int64_t G = Hq / Hkv, R = per_kv ? 1 : G, H = per_kv ? Hkv : Hq, groups = B * Hkv;
    const int64_t kk = k < n_pages ? k : n_pages;
    ranked *r = malloc(sizeof(ranked) * n_pages * R);
    float *qp = malloc(sizeof(float) * D * R), *qn = malloc(sizeof(float) * D * R);
    float *sc = malloc(sizeof(float) * n_pages * R);
    const int ok = r && qp && qn && sc;
    if (!ok) __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
    for (int64_t grp = 0; grp < groups; grp++) {
        if (!ok) continue;
        const int64_t b = grp / Hkv, hk = grp % Hkv;
        signed_parts(q, Hq, G, D, b, hk, per_kv, qp, qn);
        const float *l = lo + b * ds[0] + hk * ds[1], *u = hi + b * ds[0] + hk * ds[1];
        for (int64_t i = 0; i < R * n_pages; i++) sc[i] = 0.0f;
        bounds(qp, qn, R, u, l, ds[2], n_pages, D, sc);
        for (int64_t p = 0; p < n_pages; p++) {
            const int forced = p < sinks || p >= n_pages - window;
            for (int64_t i = 0; i < R; i++)
                r[i * n_pages + p] = (ranked){forced ? INFINITY : sc[i * n_pages + p],
                                              (int32_t)p};
        }
        for (int64_t i = 0; i < R; i++) {
            ranked *ri = r + i * n_pages;
            const int64_t row = b * H + (per_kv ? hk : hk * G + i);
            if (kk < n_pages) top_k(ri, n_pages, kk);
            qsort(ri, kk, sizeof(ranked), by_id);
            int32_t *out = idx + row * ld, m = 0;
            for (int64_t j = 0; j < kk; j++)
                for (int64_t t = 0; t < page; t++) {
                    const int64_t pos = (int64_t)ri[j].p * page + t;
                    if (pos < n) out[m++] = (int32_t)pos;
                }
            lens[row] = m;
            for (int64_t j = m; j < k * page; j++) out[j] = 0;
        }
    }
    free(r);
    free(qp);
    free(qn);
    free(sc);
}

/* q [B, Hq, D] float32 contiguous; lo/hi float32 with element strides ds[0..2] for
 * (batch, KV head, page) and a contiguous last dimension; rows B x H, H = Hkv (per_kv) or
 * Hq. Writes idx [rows, k * page] int32 and lens [rows]. Returns 0, -1 when out of memory,
 * -2 on arguments it cannot take. */
int kvb_page_select(const float *q, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                    const float *lo, const float *hi, const int64_t *ds, int64_t n_pages,
                    int64_t k, int64_t sinks, int64_t window, int per_kv, int64_t page,
                    int64_t n, int32_t *idx, int32_t *lens, int threads) {
    if (Hkv < 1 || Hq % Hkv || n_pages < 1 || k < 1 || page < 1 || D < 1) return -2;
    int failed = 0;
    int nt = kvb_team(threads);
    if (nt > B * Hkv) nt = (int)(B * Hkv);
#pragma omp parallel num_threads(nt)
    kvb_page_select_in(q, B, Hq, Hkv, D, lo, hi, ds, n_pages, k, sinks, window, per_kv, page,
                       n, idx, k * page, lens, &failed);
    return failed ? -1 : 0;
}

/* Quest's min/max digests after one decoded token (Quest Alg. 1), in place: row (b, h)'s
 * key k [D] (element strides ks (b, h)) joins page p: the page's first token (`fresh`) sets
 * lo = hi = k, a later one takes the channel-wise min and max, which equal amin/amax over
 * the page's tokens exactly. lo/hi have element strides ds (b, h, page) and a contiguous
 * last dimension. What kvbench.strategies._pages.Digests.update does in seven torch ops. */
void kvb_digest_token(const float *k, const int64_t *ks, float *lo, float *hi,
                      const int64_t *ds, int64_t B, int64_t H, int64_t D, int64_t p, int fresh) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *x = k + b * ks[0] + h * ks[1];
            float *l = lo + b * ds[0] + h * ds[1] + p * ds[2];
            float *u = hi + b * ds[0] + h * ds[1] + p * ds[2];
            for (int64_t d = 0; d < D; d++) {
                l[d] = fresh || x[d] < l[d] ? x[d] : l[d];
                u[d] = fresh || x[d] > u[d] ? x[d] : u[d];
            }
        }
}

/* Slots in ascending score, ties by slot (the torch path's stable argsort): insertion. */
static void by_score(ranked *a, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        const ranked x = a[i];
        int64_t j = i;
        for (; j > 0 && a[j - 1].s > x.s; j--) a[j] = a[j - 1];
        a[j] = x;
    }
}

/* ArkVale's decode step selection and recall (kvbench.strategies.arkvale: ArkVale._select,
 * _place, _recall) on the threads of a parallel region, a row a sequence (per_layer) or a
 * (sequence, KV head). A row's score of each full page is its heads' summed bound (q after
 * RoPE; ArkVale's estimate.cu); the sinks and the last `window` full pages are forced in,
 * the k best kept (every page when k >= nf; select.cu, Alg. 1 line 2). Then per KV head,
 * each kept page not resident, in ascending page order, takes the next slot of an order
 * that puts empty slots first, then the resident pages outside the kept set by ascending
 * score (Alg. 1 lines 5-6, 11), and is copied there from the host backup. What the torch
 * path does in about forty dispatched ops and a host read of the page ids per layer. */
void kvb_recall_in(const float *q, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                   const float *lo, const float *hi, const int64_t *ds, const kvb_recall_t *r,
                   int64_t *slot_page, float *pk, const int64_t *ks, float *pv,
                   const int64_t *vs, const float *bk, const float *bv, int64_t *moved,
                   int *failed) {
    const int64_t G = Hq / Hkv, nf = r->nf, C = r->slots, S = r->page;
    const int64_t heads = r->per_layer ? Hkv : 1, rows = r->per_layer ? B : B * Hkv;
    ranked *rk = malloc(sizeof(ranked) * (nf + C));
    float *score = malloc(sizeof(float) * (nf + 2 * D));
    uint8_t *keep = malloc(2 * nf);
    const int ok = rk && score && keep;
    if (!ok) __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        if (!ok) continue;
        const int64_t b = r->per_layer ? row : row / Hkv, h0 = r->per_layer ? 0 : row % Hkv;
        float *qp = score + nf, *qn = qp + D;
        uint8_t *res = keep + nf;
        ranked *ord = rk + nf;
        for (int64_t p = 0; p < nf; p++) score[p] = 0.0f;
        for (int64_t h = h0; h < h0 + heads; h++) {
            signed_parts(q, Hq, G, D, b, h, 1, qp, qn);
            bounds(qp, qn, 1, hi + b * ds[0] + h * ds[1], lo + b * ds[0] + h * ds[1], ds[2],
                   nf, D, score);
        }
        for (int64_t p = 0; p < nf; p++) {
            keep[p] = r->k >= nf;
            rk[p] = (ranked){p < r->sinks || p >= nf - r->window ? INFINITY : score[p],
                             (int32_t)p};
        }
        if (r->k < nf) {
            top_k(rk, nf, r->k);
            for (int64_t j = 0; j < r->k; j++) keep[rk[j].p] = 1;
        }
        for (int64_t h = h0; h < h0 + heads; h++) {
            int64_t *sp = slot_page + (b * Hkv + h) * C, next = 0, rec = 0, ev = 0;
            int bad = 0;
            for (int64_t s = 0; s < C; s++) bad |= sp[s] >= nf;
            if (bad) { /* a slot holds a page not completed: the caller's bookkeeping broke */
                __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
                continue;
            }
            for (int64_t p = 0; p < nf; p++) res[p] = 0;
            for (int64_t s = 0; s < C; s++) { /* empty first, kept last, else by score */
                const int64_t p = sp[s];
                if (p >= 0) res[p] = 1;
                ord[s] = (ranked){p < 0 ? -INFINITY : keep[p] ? INFINITY : score[p], (int32_t)s};
            }
            by_score(ord, C);
            for (int64_t p = 0; p < nf; p++) {
                if (!keep[p] || res[p]) continue;
                if (next == C) { __atomic_store_n(failed, 1, __ATOMIC_RELAXED); break; }
                const int64_t s = ord[next++].p, src = ((p * B + b) * Hkv + h) * S * D;
                ev += sp[s] >= 0;
                rec += p < r->fresh;
                sp[s] = p;
                memcpy(pk + b * ks[0] + h * ks[1] + s * S * D, bk + src, sizeof(float) * S * D);
                memcpy(pv + b * vs[0] + h * vs[1] + s * S * D, bv + src, sizeof(float) * S * D);
            }
            __atomic_fetch_add(moved, rec, __ATOMIC_RELAXED);
            __atomic_fetch_add(moved + 1, ev, __ATOMIC_RELAXED);
        }
    }
    free(rk);
    free(score);
    free(keep);
}
