/* AVX-512 inner loops of the CPU attention kernel (attn.c) for float32 rows of D % 16 == 0:
 * scores and P.V of up to three queries at once (a GQA group of three, as SmolLM2's 9/3
 * heads, reads each K and V row once for all three), sixteen floats an instruction. The row
 * max and exp-sum are attn_loops.c's AVX2 ones (a few percent of the work).
 *
 * Why: decode attention under GQA does G query heads' dot products and P.V per key it reads
 * (3 x 64 x 2 FMAs per 512-byte K and V row here); with AVX2 the 2-core Zen 5 VM computed
 * about 30-35 GB/s of cached K/V per core, below the 38-78 GB/s its two cores read from
 * memory, so a cold decode layer ran at neither bound. Scores reduce each key's 16-lane
 * accumulators to 8 (the halves added) and then eight keys at a time through AVX2's
 * transpose-add; P.V keeps a query's accumulator tile (64 floats) in four registers.
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include "attn.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define A512 __attribute__((target("avx512f,avx2,fma")))
#define A512_INLINE __attribute__((target("avx512f,avx2,fma"), always_inline)) inline

/* The sixteen lanes of a summed pairwise into eight. */
static A512_INLINE __m256 halves(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* Lane i of the result: the sum of v[i]'s eight lanes. */
static A512_INLINE __m256 sum8(const __m256 *v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* s[t * BLK + u] = q_t . r_u for NQ queries (rows D floats apart) and eight rows r. */
static A512_INLINE void dot8(float *s, const float *q, int64_t D, const void *const *r,
                             const int NQ) {
    __m512 a[3][8];
    for (int t = 0; t < NQ; t++)
        for (int u = 0; u < 8; u++) a[t][u] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x[3];
        for (int t = 0; t < NQ; t++) x[t] = _mm512_loadu_ps(q + t * D + d);
        for (int u = 0; u < 8; u++) {
            const __m512 k = _mm512_loadu_ps((const float *)r[u] + d);
            for (int t = 0; t < NQ; t++) a[t][u] = _mm512_fmadd_ps(x[t], k, a[t][u]);
        }
    }
    for (int t = 0; t < NQ; t++) {
        __m256 h[8];
        for (int u = 0; u < 8; u++) h[u] = halves(a[t][u]);
        _mm256_storeu_ps(s + t * BLK, sum8(h));
    }
}

static A512 void scores(float *s, const float *q, int64_t nr, int64_t D,
                        const void *const *kp, int64_t nb, const pf_t *pf) {
    const void *r[8];
    for (int64_t j0 = 0; j0 < nb; j0 += 8) {
        for (int u = 0; u < 8; u++) kvb_fetch_row(pf, j0 + u);
        for (int u = 0; u < 8; u++) r[u] = kp[j0 + u < nb ? j0 + u : nb - 1];
        int64_t t = 0;
        for (; t + 3 <= nr; t += 3) dot8(s + t * BLK + j0, q + t * D, D, r, 3);
        if (nr - t == 2) dot8(s + t * BLK + j0, q + t * D, D, r, 2);
        if (nr - t == 1) dot8(s + t * BLK + j0, q + t * D, D, r, 1);
    }
}

/* acc_t[d0 .. d0 + 16 NV) = acc_t * c_t + sum_j p_t[j] v_j for NQ queries, each V element
 * loaded once for all of them. */
static A512_INLINE void pv_tile(float *const *acc, const float *c, const float *const *p,
                                const void *const *vp, int64_t nb, int64_t d0, const int NQ,
                                const int NV, const pf_t *pf) {
    __m512 a[3][4];
    for (int t = 0; t < NQ; t++)
        for (int i = 0; i < NV; i++)
            a[t][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[t] + d0 + 16 * i),
                                    _mm512_set1_ps(c[t]));
    for (int64_t j = 0; j < nb; j++) {
        kvb_fetch_row(pf, j);
        __m512 pj[3];
        for (int t = 0; t < NQ; t++) pj[t] = _mm512_set1_ps(p[t][j]);
        for (int i = 0; i < NV; i++) {
            const __m512 v = _mm512_loadu_ps((const float *)vp[j] + d0 + 16 * i);
            for (int t = 0; t < NQ; t++) a[t][i] = _mm512_fmadd_ps(pj[t], v, a[t][i]);
        }
    }
    for (int t = 0; t < NQ; t++)
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc[t] + d0 + 16 * i, a[t][i]);
}

/* pv_tile over D in tiles of 64 floats (a constant NV each), the block's prefetch issued
 * with the first tile. */
static A512_INLINE void pv_rows(float *const *acc, const float *c, const float *const *p,
                                const void *const *vp, int64_t nb, int64_t D, const int NQ,
                                const pf_t *pf) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64, pf = NULL) pv_tile(acc, c, p, vp, nb, d0, NQ, 4, pf);
    switch ((D - d0) / 16) {
    case 3: pv_tile(acc, c, p, vp, nb, d0, NQ, 3, pf); break;
    case 2: pv_tile(acc, c, p, vp, nb, d0, NQ, 2, pf); break;
    case 1: pv_tile(acc, c, p, vp, nb, d0, NQ, 1, pf); break;
    default: break;
    }
}

/* acc rows of nr queries (corr[t] NaN: query t saw no key of this block, skipped), three
 * at a time. */
static A512 void pv(float *acc, const float *corr, const float *p, const void *const *vp,
                    int64_t nr, int64_t nb, int64_t D, const pf_t *pf) {
    for (int64_t t = 0; t < nr;) {
        float *ac[3], cc[3];
        const float *pp[3];
        int m = 0;
        for (; t < nr && m < 3; t++)
            if (corr[t] == corr[t]) {
                ac[m] = acc + t * D;
                pp[m] = p + t * BLK;
                cc[m++] = corr[t];
            }
        if (m == 3) pv_rows(ac, cc, pp, vp, nb, D, 3, pf);
        if (m == 2) pv_rows(ac, cc, pp, vp, nb, D, 2, pf);
        if (m == 1) pv_rows(ac, cc, pp, vp, nb, D, 1, pf);
        if (m) pf = NULL;
    }
}

static const isa_t AVX512_F32 = {scores, kvb_rowmax_avx2, kvb_expsum_avx2, pv, 0};

const isa_t *kvb_attn_loops_avx512(void) { return &AVX512_F32; }
#else
const isa_t *kvb_attn_loops_avx512(void) { return 0; }
#endif
