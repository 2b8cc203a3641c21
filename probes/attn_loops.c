/* Inner loops of the CPU attention kernel (attn.c): scores, row max, exp and sum, P.V.
 *
 * Portable versions (GCC vectorises them with the baseline SIMD) and AVX2/FMA ones, chosen
 * at run time: scores of 8 keys at a time for one query or 4 keys for a pair of queries
 * (each K row loaded once per pair: GQA groups, appended queries), P.V with the accumulators
 * in registers (pairs of queries share each V load), a vector exp, and bfloat16 rows
 * widened to float32 in registers by unpacking against zero (q and acc then held in the
 * unpack order, see swap23 in attn.h). The AVX2 scores and P.V loops also fetch the rows a
 * call names (pf_t), a few lines per key. The file is compiled at O3 (the pragma).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include "attn.h"
#include "sum8.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVB_X86 1
#endif

/* Portable versions (GCC vectorises them with the baseline SIMD). */
static inline __attribute__((always_inline)) void scores_gen(
    float *s, const float *q, int64_t nr, int64_t D, const void *const *kp, int64_t nb,
    int bf16) {
    for (int64_t t = 0; t < nr; t++)
        for (int64_t j = 0; j < nb; j++) {
            float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, r = 0.0f;
            int64_t d = 0;
            for (; d + 8 <= D; d += 8)
                for (int u = 0; u < 8; u++) a[u] += q[t * D + d + u] * elem(kp[j], d + u, bf16);
            for (; d < D; d++) r += q[t * D + d] * elem(kp[j], d, bf16);
            s[t * BLK + j] = r + kvb_sum8(a);
        }
}

static inline __attribute__((always_inline)) void pv_gen(
    float *acc, const float *corr, const float *p, const void *const *vp, int64_t nr,
    int64_t nb, int64_t D, int bf16) {
    for (int64_t t = 0; t < nr; t++) {
        if (corr[t] != corr[t]) continue;
        float *a = acc + t * D;
        const float *pt = p + t * BLK;
        if (corr[t] != 1.0f)
            for (int64_t d = 0; d < D; d++) a[d] *= corr[t];
        for (int64_t j = 0; j < nb; j++)
            if (pt[j] != 0.0f)
                for (int64_t d = 0; d < D; d++) a[d] += pt[j] * elem(vp[j], d, bf16);
    }
}

static void scores_gen_f32(float *s, const float *q, int64_t nr, int64_t D,
                           const void *const *kp, int64_t nb, const pf_t *pf) { (void)pf; scores_gen(s, q, nr, D, kp, nb, 0); }
static void scores_gen_bf16(float *s, const float *q, int64_t nr, int64_t D,
                            const void *const *kp, int64_t nb, const pf_t *pf) { (void)pf; scores_gen(s, q, nr, D, kp, nb, 1); }
static void pv_gen_f32(float *acc, const float *corr, const float *p, const void *const *vp,
                       int64_t nr, int64_t nb, int64_t D, const pf_t *pf) { (void)pf; pv_gen(acc, corr, p, vp, nr, nb, D, 0); }
static void pv_gen_bf16(float *acc, const float *corr, const float *p, const void *const *vp,
                        int64_t nr, int64_t nb, int64_t D, const pf_t *pf) { (void)pf; pv_gen(acc, corr, p, vp, nr, nb, D, 1); }

static float rowmax_gen(const float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

static float expsum_gen(float *s, int64_t n, float m) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] - m));
    return sum;
}

static const isa_t GEN_F32 = {scores_gen_f32, rowmax_gen, expsum_gen, pv_gen_f32, 0};
static const isa_t GEN_BF16 = {scores_gen_bf16, rowmax_gen, expsum_gen, pv_gen_bf16, 0};

#ifdef KVB_X86
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

/* 8 (float32) or 16 (bfloat16, two halves in unpack order) K/V elements as float32. */
static AVX2_INLINE __m256 lo8(const void *row, int64_t d, int bf16, __m256i *w) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + d);
    *w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), *w));
}

static AVX2_INLINE __m256 hi8(__m256i w) {
    return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
}

/* Eight dot products of q (D floats) with rows r[0..7]: lane i is q . r_i. D is a multiple
 * of 8 (float32) or 16 (bfloat16, q in unpack order). */
static AVX2_INLINE __m256 dot8(const float *q, const void *const *r, int64_t D, const int bf16) {
    __m256 a[8];
    __m256i w[8];
    for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += bf16 ? 16 : 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(x, lo8(r[u], d, bf16, &w[u]), a[u]);
        if (bf16) {
            const __m256 y = _mm256_loadu_ps(q + d + 8);
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(y, hi8(w[u]), a[u]);
        }
    }
    /* transpose-reduce: lane i of the result is the sum of a_i */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Four dot products each of two queries q0, q1 with rows r[0..3] (the rows loaded once for
 * both): returns q0 . r_u in lanes 0-3 and q1 . r_u in lanes 4-7. */
static AVX2_INLINE __m256 dot4x2(const float *q0, const float *q1, const void *const *r,
                                 int64_t D, const int bf16) {
    __m256 a[4], b[4], k[4];
    __m256i w[4];
    for (int u = 0; u < 4; u++) a[u] = b[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += bf16 ? 16 : 8) {
        for (int u = 0; u < 4; u++) k[u] = lo8(r[u], d, bf16, &w[u]);
        const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
        for (int u = 0; u < 4; u++) {
            a[u] = _mm256_fmadd_ps(x, k[u], a[u]);
            b[u] = _mm256_fmadd_ps(y, k[u], b[u]);
        }
        if (bf16) {
            const __m256 x2 = _mm256_loadu_ps(q0 + d + 8), y2 = _mm256_loadu_ps(q1 + d + 8);
            for (int u = 0; u < 4; u++) {
                k[u] = hi8(w[u]);
                a[u] = _mm256_fmadd_ps(x2, k[u], a[u]);
                b[u] = _mm256_fmadd_ps(y2, k[u], b[u]);
            }
        }
    }
    /* hadd tree: lanes [a0 a1 a2 a3 | a0 a1 a2 a3] (low and high halves), likewise b */
    const __m256 ha = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 hb = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ha, hb, 0x20),
                         _mm256_permute2f128_ps(ha, hb, 0x31));
}

/* Scores of nr queries against nb keys: one query over 8 keys at a time, or pairs of queries
 * over 4 keys (each K row loaded once per pair: GQA groups and appended queries). */
static AVX2_INLINE void scores_avx2(float *s, const float *q, int64_t nr, int64_t D,
                                    const void *const *kp, int64_t nb, const int bf16,
                                    const pf_t *pf) {
    const void *r[8];
    for (int64_t j0 = 0; j0 < nb; j0 += 8) {
        for (int u = 0; u < 8; u++) kvb_fetch_row(pf, j0 + u);
        for (int u = 0; u < 8; u++) r[u] = kp[j0 + u < nb ? j0 + u : nb - 1];
        int64_t t = 0;
        for (; t + 2 <= nr; t += 2)
            for (int h = 0; h < 8; h += 4) {
                const __m256 x = dot4x2(q + t * D, q + (t + 1) * D, r + h, D, bf16);
                _mm_storeu_ps(s + t * BLK + j0 + h, _mm256_castps256_ps128(x));
                _mm_storeu_ps(s + (t + 1) * BLK + j0 + h, _mm256_extractf128_ps(x, 1));
            }
        if (t < nr) _mm256_storeu_ps(s + t * BLK + j0, dot8(q + t * D, r, D, bf16));
    }
}

/* acc[d0 .. d0 + 8*NV) = acc * corr + sum_j p_j v_j, accumulators in registers. */
static AVX2_INLINE void pv_tile(float *acc, float corr, const float *p, const void *const *vp,
                                int64_t nb, int64_t d0, const int NV, const int bf16,
                                const pf_t *pf) {
    __m256 a[8];
    __m256i w;
    const __m256 c = _mm256_set1_ps(corr);
    for (int i = 0; i < NV; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), c);
    for (int64_t j = 0; j < nb; j++) {
        kvb_fetch_row(pf, j);
        const __m256 pj = _mm256_broadcast_ss(p + j);
        for (int i = 0; i < NV; i += bf16 ? 2 : 1) {
            a[i] = _mm256_fmadd_ps(pj, lo8(vp[j], d0 + 8 * i, bf16, &w), a[i]);
            if (bf16) a[i + 1] = _mm256_fmadd_ps(pj, hi8(w), a[i + 1]);
        }
    }
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
}

/* The same for two queries at once (acc0/acc1, p0/p1), each V element loaded once. */
static AVX2_INLINE void pv_tile2(float *acc0, float *acc1, float c0, float c1, const float *p0,
                                 const float *p1, const void *const *vp, int64_t nb, int64_t d0,
                                 const int NV, const int bf16, const pf_t *pf) {
    __m256 a[4], b[4], v[2];
    __m256i w;
    for (int i = 0; i < NV; i++) {
        a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc0 + d0 + 8 * i), _mm256_set1_ps(c0));
        b[i] = _mm256_mul_ps(_mm256_loadu_ps(acc1 + d0 + 8 * i), _mm256_set1_ps(c1));
    }
    for (int64_t j = 0; j < nb; j++) {
        kvb_fetch_row(pf, j);
        const __m256 x = _mm256_broadcast_ss(p0 + j), y = _mm256_broadcast_ss(p1 + j);
        for (int i = 0; i < NV; i += bf16 ? 2 : 1) {
            v[0] = lo8(vp[j], d0 + 8 * i, bf16, &w);
            a[i] = _mm256_fmadd_ps(x, v[0], a[i]);
            b[i] = _mm256_fmadd_ps(y, v[0], b[i]);
            if (bf16) {
                v[1] = hi8(w);
                a[i + 1] = _mm256_fmadd_ps(x, v[1], a[i + 1]);
                b[i + 1] = _mm256_fmadd_ps(y, v[1], b[i + 1]);
            }
        }
    }
    for (int i = 0; i < NV; i++) {
        _mm256_storeu_ps(acc0 + d0 + 8 * i, a[i]);
        _mm256_storeu_ps(acc1 + d0 + 8 * i, b[i]);
    }
}

/* acc rows of nr queries (corr[t] NaN: query t saw no key of this block, skipped); pairs of
 * queries share each V load. */
static AVX2_INLINE void pv_avx2(float *acc, const float *corr, const float *p,
                                const void *const *vp, int64_t nr, int64_t nb, int64_t D,
                                const int bf16, const pf_t *pf) {
    int64_t t = 0, u = -1; /* u: a query waiting for a partner */
    for (; t < nr; t++) {
        if (corr[t] != corr[t]) continue;
        if (u < 0) {
            u = t;
            continue;
        }
        int64_t d0 = 0;
        for (; d0 + 32 <= D; d0 += 32)
            pv_tile2(acc + u * D, acc + t * D, corr[u], corr[t], p + u * BLK, p + t * BLK, vp,
                     nb, d0, 4, bf16, pf), pf = NULL;
        if (d0 + 16 <= D)
            pv_tile2(acc + u * D, acc + t * D, corr[u], corr[t], p + u * BLK, p + t * BLK, vp,
                     nb, d0, 2, bf16, pf), pf = NULL, d0 += 16;
        if (!bf16 && d0 + 8 <= D)
            pv_tile2(acc + u * D, acc + t * D, corr[u], corr[t], p + u * BLK, p + t * BLK, vp,
                     nb, d0, 1, 0, pf), pf = NULL;
        u = -1;
    }
    if (u < 0) return;
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 8, bf16, pf), pf = NULL;
    if (d0 + 32 <= D) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 4, bf16, pf), pf = NULL, d0 += 32;
    if (d0 + 16 <= D) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 2, bf16, pf), pf = NULL, d0 += 16;
    if (!bf16 && d0 + 8 <= D) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 1, 0, pf), pf = NULL;
}

/* The AVX2 entry points: a call without rows to prefetch takes a copy of the loops with
 * the prefetch compiled out (pf a literal NULL), so it pays nothing for it. */
static AVX2 void scores_avx2_f32(float *s, const float *q, int64_t nr, int64_t D,
                                 const void *const *kp, int64_t nb, const pf_t *pf) {
    if (pf && pf->n) scores_avx2(s, q, nr, D, kp, nb, 0, pf);
    else scores_avx2(s, q, nr, D, kp, nb, 0, NULL);
}
static AVX2 void scores_avx2_bf16(float *s, const float *q, int64_t nr, int64_t D,
                                  const void *const *kp, int64_t nb, const pf_t *pf) {
    if (pf && pf->n) scores_avx2(s, q, nr, D, kp, nb, 1, pf);
    else scores_avx2(s, q, nr, D, kp, nb, 1, NULL);
}
static AVX2 void pv_avx2_f32(float *acc, const float *corr, const float *p,
                             const void *const *vp, int64_t nr, int64_t nb, int64_t D,
                             const pf_t *pf) {
    if (pf && pf->n) pv_avx2(acc, corr, p, vp, nr, nb, D, 0, pf);
    else pv_avx2(acc, corr, p, vp, nr, nb, D, 0, NULL);
}
static AVX2 void pv_avx2_bf16(float *acc, const float *corr, const float *p,
                              const void *const *vp, int64_t nr, int64_t nb, int64_t D,
                              const pf_t *pf) {
    if (pf && pf->n) pv_avx2(acc, corr, p, vp, nr, nb, D, 1, pf);
    else pv_avx2(acc, corr, p, vp, nr, nb, D, 1, NULL);
}

AVX2 float kvb_rowmax_avx2(const float *s, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    float lane[8], r = -INFINITY;
    _mm256_storeu_ps(lane, m);
    for (int u = 0; u < 8; u++) r = lane[u] > r ? lane[u] : r;
    for (; j < n; j++) r = s[j] > r ? s[j] : r;
    return r;
}

/* exp(x) for 8 floats (Cephes expf: range reduction by ln 2, degree-5 polynomial; relative
 * error ~2e-7); x below -87 (and -inf) gives 0. */
static AVX2_INLINE __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

AVX2 float kvb_expsum_avx2(float *s, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lane[8], sum = 0.0f;
    _mm256_storeu_ps(lane, acc);
    for (int u = 0; u < 8; u++) sum += lane[u];
    if (j < n) { /* tail through a padded vector */
        float buf[8];
        for (int u = 0; u < 8; u++) buf[u] = j + u < n ? s[j + u] - m : -INFINITY;
        _mm256_storeu_ps(buf, exp8(_mm256_loadu_ps(buf)));
        for (int64_t u = 0; j + u < n; u++) sum += (s[j + u] = buf[u]);
    }
    return sum;
}

static const isa_t AVX2_F32 = {scores_avx2_f32, kvb_rowmax_avx2, kvb_expsum_avx2, pv_avx2_f32,
                               0};
static const isa_t AVX2_BF16 = {scores_avx2_bf16, kvb_rowmax_avx2, kvb_expsum_avx2,
                                pv_avx2_bf16, 1};
#endif

const isa_t *kvb_attn_loops(int dtype, int64_t D, int isa) {
#ifdef KVB_X86
    if (isa == 2 && !dtype && D % 16 == 0) return kvb_attn_loops_avx512();
    if (isa >= 1 && D % (dtype ? 16 : 8) == 0) return dtype ? &AVX2_BF16 : &AVX2_F32;
#else
    (void)D;
    (void)isa;
#endif
    return dtype ? &GEN_BF16 : &GEN_F32;
}
