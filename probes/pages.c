/* Quest's page selection in one call (Quest section 3.2-3.3): score every page from its
 * min/max digest, keep the sinks, the window and the top of the rest, list their tokens.
 *
 * For each row (a sequence's KV head, its query heads' q summed first, or each query head):
 * score[p] = sum_d q+[d] hi[p, d] + q-[d] lo[p, d] (the upper bound of q . k over the page,
 * as kvbench.strategies._pages.page_scores computes it), the first `sinks` and last `window`
 * pages forced in, the k best by score kept (quickselect), their ids sorted ascending, and
 * their token positions (< n) written with the row's count. Rows run on torch's OpenMP
 * threads. What a torch path does in about thirty dispatched ops a layer, and no output
 * whose size depends on the data: every row writes k * page slots, its count says how many
 * hold positions (the rest 0).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

static int by_id(const void *x, const void *y) {
    return ((const ranked *)x)->p - ((const ranked *)y)->p;
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
    const int64_t H = per_kv ? Hkv : Hq, G = Hq / Hkv, rows = B * H;
    const int64_t kk = k < n_pages ? k : n_pages;
    int failed = 0;
    int nt = threads < 1 ? 1 : threads > 256 ? 256 : threads;
    if (nt > rows) nt = (int)rows;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        ranked *r = malloc(sizeof(ranked) * n_pages);
        float *qp = malloc(sizeof(float) * D), *qn = malloc(sizeof(float) * D);
        if (!r || !qp || !qn) failed = 1;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (failed) continue;
            const int64_t b = row / H, h = row % H, hk = per_kv ? h : h / G;
            const int64_t h0 = per_kv ? h * G : h, hn = per_kv ? G : 1;
            for (int64_t d = 0; d < D; d++) qp[d] = qn[d] = 0.0f;
            for (int64_t g = h0; g < h0 + hn; g++)
                for (int64_t d = 0; d < D; d++) {
                    const float x = q[(b * Hq + g) * D + d];
                    if (x > 0) qp[d] += x; else qn[d] += x;
                }
            const float *l = lo + b * ds[0] + hk * ds[1], *u = hi + b * ds[0] + hk * ds[1];
            for (int64_t p = 0; p < n_pages; p++) {
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    s += qp[d] * u[p * ds[2] + d] + qn[d] * l[p * ds[2] + d];
                const int forced = p < sinks || p >= n_pages - window;
                r[p] = (ranked){forced ? INFINITY : s, (int32_t)p};
            }
            if (kk < n_pages) top_k(r, n_pages, kk);
            qsort(r, kk, sizeof(ranked), by_id);
            int32_t *out = idx + row * k * page, m = 0;
            for (int64_t i = 0; i < kk; i++)
                for (int64_t t = 0; t < page; t++) {
                    const int64_t pos = (int64_t)r[i].p * page + t;
                    if (pos < n) out[m++] = (int32_t)pos;
                }
            lens[row] = m;
            for (int64_t i = m; i < k * page; i++) out[i] = 0;
        }
        free(r);
        free(qp);
        free(qn);
    }
    return failed ? -1 : 0;
}
