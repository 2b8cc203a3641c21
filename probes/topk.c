/* Each row's k largest values and their indices, best first: what torch.topk(x, k, dim=-1)
 * returns (on a tie the lower index first, where torch leaves the order open; -0 counts
 * below +0), for
 * InfiniGen's speculation (kvbench.strategies.infinigen, section 4.3: the tokens whose
 * partial scores lead, n'_max of them per head).
 *
 * Radix selection, no comparisons to mispredict: a float's bits mapped to an unsigned key
 * that orders as the float does, the candidates' histogram of the key's next 11 bits tells
 * which bucket holds the k-th largest (those above it are in, those in it stay candidates),
 * three digits at most; then the k sorted by (key descending, index ascending) in 11-bit
 * LSD passes. For 4 x 9 rows of 8000 scores and k 1024 (2 threads, 2-core AMD EPYC VM,
 * 2026-11-27) torch's CPU topk took 1.6-1.7 ms and a quickselect with a comparison sort of
 * the k 1.9 ms.
 */
#pragma GCC optimize("O3")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define BITS 11
#define BUCKETS (1 << BITS)

typedef struct { uint64_t key; int64_t id; } keyed;

/* The float's order as an unsigned order: -0 below +0, a NaN above every number (as
 * torch's sort and topk order them). */
static inline uint32_t fkey(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return UINT32_MAX;
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* One row: the k largest of x[0..n) into sel[0..k) (key = fkey, unordered; ties at the
 * k-th value: the lower indices), using cand [n] as scratch. */
static void select_row(const float *x, int64_t n, int64_t k, keyed *cand, keyed *sel,
                       uint32_t *cnt) {
    int64_t m = n, got = 0, need = k;
    for (int64_t i = 0; i < n; i++) cand[i] = (keyed){fkey(x[i]), i};
    for (int shift = 32 - BITS; need > 0; shift = shift > BITS ? shift - BITS : 0) {
        memset(cnt, 0, sizeof(uint32_t) * BUCKETS);
        for (int64_t i = 0; i < m; i++) cnt[(cand[i].key >> shift) & (BUCKETS - 1)]++;
        int64_t above = 0, b = BUCKETS - 1;
        for (; above + cnt[b] < need; b--) above += cnt[b];
        int64_t kept = 0;
        for (int64_t i = 0; i < m; i++) {  /* in index order: the candidates stay so */
            const int64_t d = (cand[i].key >> shift) & (BUCKETS - 1);
            if (d > b) sel[got++] = cand[i];
            else if (d == b) cand[kept++] = cand[i];
        }
        need -= above;
        m = kept;
        if (m == need || shift == 0) {  /* the bucket whole, or keys all equal: first need */
            for (int64_t i = 0; i < need; i++) sel[got++] = cand[i];
            need = 0;
        }
    }
}

/* a[0..k) by (key descending, id ascending): stable LSD passes over the composite
 * (~key << idbits | id), tmp [k] scratch. */
static void sort_row(keyed *a, keyed *tmp, int64_t k, int idbits, uint32_t *cnt) {
    for (int64_t i = 0; i < k; i++)
        a[i].key = ((uint64_t)(uint32_t)~(uint32_t)a[i].key << idbits) | (uint64_t)a[i].id;
    for (int shift = 0; shift < 32 + idbits; shift += BITS) {
        memset(cnt, 0, sizeof(uint32_t) * BUCKETS);
        for (int64_t i = 0; i < k; i++) cnt[(a[i].key >> shift) & (BUCKETS - 1)]++;
        uint32_t at = 0;
        for (int b = 0; b < BUCKETS; b++) {
            const uint32_t c = cnt[b];
            cnt[b] = at;
            at += c;
        }
        for (int64_t i = 0; i < k; i++) tmp[cnt[(a[i].key >> shift) & (BUCKETS - 1)]++] = a[i];
        memcpy(a, tmp, sizeof(keyed) * k);
    }
}

/* x [R, n] float32, rows ld elements apart; vals [R, k] float32 and idx [R, k] int64
 * contiguous, 1 <= k <= n. Returns 0, -1 when out of memory, -2 on arguments it cannot
 * take. Rows run on `threads` OpenMP threads. */
int kvb_topk_rows(const float *x, int64_t R, int64_t n, int64_t ld, int64_t k, float *vals,
                  int64_t *idx, int threads) {
    if (R < 0 || k < 1 || k > n || n >= ((int64_t)1 << 31) || ld < n) return -2;
    int idbits = 1, failed = 0;
    while (((int64_t)1 << idbits) < n) idbits++;
    int nt = kvb_team(threads);
    if (nt > R) nt = R > 0 ? (int)R : 1;
#pragma omp parallel num_threads(nt)
    {
        keyed *cand = malloc(sizeof(keyed) * (n + 2 * k));
        uint32_t *cnt = malloc(sizeof(uint32_t) * BUCKETS);
        const int ok = cand && cnt;
        if (!ok) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (!ok) continue;
            keyed *sel = cand + n, *tmp = sel + k;
            select_row(x + r * ld, n, k, cand, sel, cnt);
            sort_row(sel, tmp, k, idbits, cnt);
            for (int64_t j = 0; j < k; j++) {
                vals[r * k + j] = x[r * ld + sel[j].id];
                idx[r * k + j] = sel[j].id;
            }
        }
        free(cand);
        free(cnt);
    }
    return failed ? -1 : 0;
}
