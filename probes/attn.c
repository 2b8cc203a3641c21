/* CPU attention over a KV cache with its log-sum-exp (HGCA sections 2.3 and 3.3).
 *
 * One call computes, for every (batch, KV head) row, the attention of that KV head's
 * G = Hq / Hkv query heads times Lq queries over either all Lk positions (dense) or the
 * row's own list of selected positions (sparse: idx [rows, nmax] int32, lens [rows]).
 * Each K and V row is read once for all G * Lq queries of its row (GQA reads a KV head once
 * for its whole query group), in blocks of BLK keys through an online softmax (the
 * FlashAttention recurrence): decode is bandwidth-bound.
 *
 * Work split: with many rows, tasks are `group` adjacent rows (HGCA's merged heads); with
 * fewer than SPLIT_ROWS rows per thread (decode at batch 1: a few KV heads on all cores),
 * every row's keys are split into S chunks (split-K, as FlashDecoding) whose partial
 * (max, sum, accumulator) are merged exactly afterwards, so all threads stay busy. Threads
 * take tasks from a shared counter and write disjoint parts of one output buffer; the call
 * returns when the tasks are done, not when every helper thread has run (see kvb_attn).
 *
 * Inner loops (scores of 8 keys at a time, exp, P.V with the accumulator in registers,
 * bfloat16 -> float32 conversion) have an AVX2/FMA version chosen at run time on x86 CPUs
 * that have it and a portable one (kvb_attn_isa reports or forces the choice).
 * dtype 0 is float32, 1 is bfloat16 (converted by shifting to/from the float32 high half).
 * q/out are contiguous [B, Hq, Lq, D], lse [B, Hq, Lq] float32; k/v have element strides
 * (batch, head, token) and a contiguous last dimension.
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVB_X86 1
#endif

#define BLK 64        /* keys per block */
#define SPLIT_ROWS 8  /* below this many rows per thread, rows are split along the keys */
#define MIN_CHUNK 256 /* fewest keys per split chunk */

typedef struct {
    int dtype;
    const void *q, *k, *v;
    void *out;
    float *lse;
    int64_t B, Hq, Hkv, Lq, Lk, D;
    const int64_t *ks, *vs;
    const int32_t *idx, *lens;
    int64_t nmax;
    float scale;
    int causal;
    int64_t q_start, group, ntasks;
    int64_t split, chunk; /* chunks per row (1: none) and keys per chunk */
    float *part;          /* split > 1: per (row, chunk, query) [m, l, acc[D]] */
    const void *isa;      /* the inner loops (isa_t) */
    int64_t next;         /* shared task counter */
    int failed;
    int64_t done;         /* tasks finished */
    int refs;             /* threads still holding the job (the last one frees it) */
} job_t;

/* The vectorisable inner loops, one set per instruction set and dtype. s/p rows hold BLK
 * floats; kp/vp point at K/V rows in the call's dtype; q and acc rows are float32, in the
 * order `perm` says (1: each 16 floats in the bfloat16 unpack order, see swap23). */
typedef struct {
    void (*scores)(float *s, const float *q, int64_t nr, int64_t D, const void *const *kp,
                   int64_t nb);                                 /* s[t*BLK+j] = q_t . k_j */
    float (*rowmax)(const float *s, int64_t n);
    float (*expsum)(float *s, int64_t n, float m);              /* s = exp(s - m); sum */
    void (*pv)(float *acc, const float *corr, const float *p, const void *const *vp,
               int64_t nr, int64_t nb, int64_t D);  /* acc_t = acc_t*corr_t + p_t.V (t < nr;
                                                       skipped where corr_t is NaN) */
    int perm;
} isa_t;

/* Position of element i in the bfloat16 unpack order: unpacking 16 bfloat16 values (two
 * 128-bit lanes) against zero gives float32 elements 0-3, 8-11 then 4-7, 12-15, i.e. bits 2
 * and 3 of the index swapped (an involution). */
static inline int64_t swap23(int64_t i) { return (i & ~(int64_t)12) | ((i & 4) << 1) | ((i & 8) >> 1); }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                      /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float elem(const void *row, int64_t d, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

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
            s[t * BLK + j] = r + (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
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
                           const void *const *kp, int64_t nb) { scores_gen(s, q, nr, D, kp, nb, 0); }
static void scores_gen_bf16(float *s, const float *q, int64_t nr, int64_t D,
                            const void *const *kp, int64_t nb) { scores_gen(s, q, nr, D, kp, nb, 1); }
static void pv_gen_f32(float *acc, const float *corr, const float *p, const void *const *vp,
                       int64_t nr, int64_t nb, int64_t D) { pv_gen(acc, corr, p, vp, nr, nb, D, 0); }
static void pv_gen_bf16(float *acc, const float *corr, const float *p, const void *const *vp,
                        int64_t nr, int64_t nb, int64_t D) { pv_gen(acc, corr, p, vp, nr, nb, D, 1); }

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
                                    const void *const *kp, int64_t nb, const int bf16) {
    const void *r[8];
    for (int64_t j0 = 0; j0 < nb; j0 += 8) {
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
                                int64_t nb, int64_t d0, const int NV, const int bf16) {
    __m256 a[8];
    __m256i w;
    const __m256 c = _mm256_set1_ps(corr);
    for (int i = 0; i < NV; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), c);
    for (int64_t j = 0; j < nb; j++) {
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
                                 const int NV, const int bf16) {
    __m256 a[4], b[4], v[2];
    __m256i w;
    for (int i = 0; i < NV; i++) {
        a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc0 + d0 + 8 * i), _mm256_set1_ps(c0));
        b[i] = _mm256_mul_ps(_mm256_loadu_ps(acc1 + d0 + 8 * i), _mm256_set1_ps(c1));
    }
    for (int64_t j = 0; j < nb; j++) {
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
                                const int bf16) {
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
                     nb, d0, 4, bf16);
        if (d0 + 16 <= D)
            pv_tile2(acc + u * D, acc + t * D, corr[u], corr[t], p + u * BLK, p + t * BLK, vp,
                     nb, d0, 2, bf16), d0 += 16;
        if (!bf16 && d0 + 8 <= D)
            pv_tile2(acc + u * D, acc + t * D, corr[u], corr[t], p + u * BLK, p + t * BLK, vp,
                     nb, d0, 1, 0);
        u = -1;
    }
    if (u < 0) return;
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 8, bf16);
    if (d0 + 32 <= D) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 4, bf16), d0 += 32;
    if (d0 + 16 <= D) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 2, bf16), d0 += 16;
    if (!bf16 && d0 + 8 <= D) pv_tile(acc + u * D, corr[u], p + u * BLK, vp, nb, d0, 1, 0);
}

static AVX2 void scores_avx2_f32(float *s, const float *q, int64_t nr, int64_t D,
                                 const void *const *kp, int64_t nb) { scores_avx2(s, q, nr, D, kp, nb, 0); }
static AVX2 void scores_avx2_bf16(float *s, const float *q, int64_t nr, int64_t D,
                                  const void *const *kp, int64_t nb) { scores_avx2(s, q, nr, D, kp, nb, 1); }
static AVX2 void pv_avx2_f32(float *acc, const float *corr, const float *p,
                             const void *const *vp, int64_t nr, int64_t nb, int64_t D) {
    pv_avx2(acc, corr, p, vp, nr, nb, D, 0);
}
static AVX2 void pv_avx2_bf16(float *acc, const float *corr, const float *p,
                              const void *const *vp, int64_t nr, int64_t nb, int64_t D) {
    pv_avx2(acc, corr, p, vp, nr, nb, D, 1);
}

static AVX2 float rowmax_avx2(const float *s, int64_t n) {
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

static AVX2 float expsum_avx2(float *s, int64_t n, float m) {
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

static const isa_t AVX2_F32 = {scores_avx2_f32, rowmax_avx2, expsum_avx2, pv_avx2_f32, 0};
static const isa_t AVX2_BF16 = {scores_avx2_bf16, rowmax_avx2, expsum_avx2, pv_avx2_bf16, 1};

static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static int have_avx2(void) { return 0; }
#endif

static int g_isa = -1; /* -1: not chosen yet, 0: portable, 1: AVX2/FMA */

/* want -1: report the inner loops in use (choosing the best on first use), 0: force the
 * portable ones, 1: AVX2/FMA where the CPU has it. Returns the choice now in effect. */
int kvb_attn_isa(int want) {
    if (want >= 0 || g_isa < 0) g_isa = want != 0 && have_avx2() ? 1 : 0;
    return g_isa;
}

typedef struct {
    float *qf, *acc, *m, *l, *s, *corr;
    const void *kp[BLK], *vp[BLK];
} work_t;

/* Prefetch one whole row (64 B lines) of `base` at element offset `off`. */
static inline void prefetch_row(const job_t *j, const void *base, int64_t off) {
    const int64_t esz = j->dtype == 0 ? 4 : 2;
    const char *p = (const char *)base + off * esz;
    for (int64_t c = 0; c < j->D * esz; c += 64) __builtin_prefetch(p + c);
}

/* Pointers to rows pos[0..nb) of k or v (element offset off, row stride `stride`). */
static inline void row_ptrs(const job_t *j, const void *base, int64_t off, int64_t stride,
                            const int32_t *pos, int64_t nb, const void **ptr) {
    const int64_t esz = j->dtype == 0 ? 4 : 2;
    for (int64_t i = 0; i < nb; i++) ptr[i] = (const char *)base + (off + pos[i] * stride) * esz;
}

/* Attention of row r's G*Lq queries over its keys [k0, k1): leaves the running max m, sum l
 * and unnormalised accumulator acc (nr x D, in the isa's order) in w. */
static void do_range(job_t *j, const isa_t *isa, work_t *w, int64_t r, int64_t k0, int64_t k1) {
    const int64_t D = j->D, G = j->Hq / j->Hkv, Lq = j->Lq, nr = G * Lq;
    const int64_t b = r / j->Hkv, hk = r % j->Hkv;
    const int32_t *idx = j->idx ? j->idx + r * j->nmax : NULL;
    const int64_t kb = b * j->ks[0] + hk * j->ks[1], vb = b * j->vs[0] + hk * j->vs[1];
    for (int64_t t = 0; t < nr; t++) { /* t = g * Lq + i: query head hk*G+g, query i */
        const int64_t qoff = ((b * j->Hq + hk * G) * Lq + t) * D;
        for (int64_t d = 0; d < D; d++)
            w->qf[t * D + d] = elem((const char *)j->q + qoff * (j->dtype ? 2 : 4),
                                    isa->perm ? swap23(d) : d, j->dtype) * j->scale;
        w->m[t] = -INFINITY;
        w->l[t] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * nr * D);
    int32_t pos[BLK];
    /* Sparse rows are scattered (a page each): while a block is used, the rows of the next
     * block are prefetched one by one so their misses overlap. */
    if (idx)
        for (int64_t jj = k0; jj < k1 && jj < k0 + BLK; jj++) {
            prefetch_row(j, j->k, kb + idx[jj] * j->ks[2]);
            prefetch_row(j, j->v, vb + idx[jj] * j->vs[2]);
        }
    for (int64_t j0 = k0; j0 < k1; j0 += BLK) {
        const int64_t nb = k1 - j0 < BLK ? k1 - j0 : BLK;
        const int64_t nx = k1 - j0 - BLK < BLK ? k1 - j0 - BLK : BLK; /* next block's size */
        for (int64_t jj = 0; jj < nb; jj++) pos[jj] = idx ? idx[j0 + jj] : (int32_t)(j0 + jj);
        for (int64_t jj = 0; idx && jj < nx; jj++)
            prefetch_row(j, j->k, kb + idx[j0 + BLK + jj] * j->ks[2]);
        row_ptrs(j, j->k, kb, j->ks[2], pos, nb, w->kp);
        isa->scores(w->s, w->qf, nr, D, w->kp, nb);
        /* causal masking only where a key may lie after a query (never in decode) */
        const int mask = j->causal && (idx || j0 + nb - 1 > j->q_start);
        for (int64_t t = 0; t < nr; t++) {
            float *s = w->s + t * BLK;
            const int64_t limit = j->q_start + t % Lq;
            for (int64_t jj = 0; mask && jj < nb; jj++)
                if (pos[jj] > limit) s[jj] = -INFINITY;
            const float bm = isa->rowmax(s, nb);
            if (bm == -INFINITY) { /* nothing visible in this block for this query */
                w->corr[t] = NAN;
                continue;
            }
            const float mn = w->m[t] > bm ? w->m[t] : bm;
            w->corr[t] = expf(w->m[t] - mn); /* 0 when m was -inf */
            w->l[t] = w->l[t] * w->corr[t] + isa->expsum(s, nb, mn);
            w->m[t] = mn;
        }
        for (int64_t jj = 0; idx && jj < nx; jj++)
            prefetch_row(j, j->v, vb + idx[j0 + BLK + jj] * j->vs[2]);
        row_ptrs(j, j->v, vb, j->vs[2], pos, nb, w->vp);
        isa->pv(w->acc, w->corr, w->s, w->vp, nr, nb, D);
    }
}

/* Normalised output and lse of row r from (m, l, acc) of nr queries; query t's m and l at
 * t * stride, its accumulator at t * astride. */
static void finish_row(job_t *j, int64_t r, const float *m, const float *l, const float *acc,
                       int64_t stride, int64_t astride) {
    const int64_t D = j->D, G = j->Hq / j->Hkv, Lq = j->Lq, nr = G * Lq;
    const int64_t b = r / j->Hkv, hk = r % j->Hkv;
    const int perm = ((const isa_t *)j->isa)->perm;
    for (int64_t t = 0; t < nr; t++) {
        const int64_t orow = (b * j->Hq + hk * G + t / Lq) * Lq + t % Lq;
        const float lt = l[t * stride], inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        j->lse[orow] = lt > 0.0f ? m[t * stride] + logf(lt) : -INFINITY;
        const float *a = acc + t * astride;
        for (int64_t d = 0; d < D; d++) {
            const float o = a[perm ? swap23(d) : d] * inv;
            if (j->dtype == 0)
                ((float *)j->out)[orow * D + d] = o;
            else
                ((uint16_t *)j->out)[orow * D + d] = f32_to_bf16(o);
        }
    }
}

/* Take tasks from the shared counter until none is left, counting each one done (a thread
 * that could not get its work buffers still counts the tasks it takes, as failed). */
static void run_tasks(job_t *j) {
    const int64_t nr = (j->Hq / j->Hkv) * j->Lq, D = j->D;
    const isa_t *isa = (const isa_t *)j->isa;
    work_t w;
    float *mem = malloc(sizeof(float) * (2 * nr * D + 3 * nr + nr * BLK));
    if (mem) {
        w.qf = mem;
        w.acc = w.qf + nr * D;
        w.m = w.acc + nr * D;
        w.l = w.m + nr;
        w.corr = w.l + nr;
        w.s = w.corr + nr;
    }
    const int64_t rows = j->B * j->Hkv;
    for (;;) {
        const int64_t task = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (task >= j->ntasks) break;
        if (!mem) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        } else if (j->split == 1) {
            const int64_t r1 = (task + 1) * j->group < rows ? (task + 1) * j->group : rows;
            for (int64_t r = task * j->group; r < r1; r++) {
                do_range(j, isa, &w, r, 0, j->idx ? j->lens[r] : j->Lk);
                finish_row(j, r, w.m, w.l, w.acc, 1, D);
            }
        } else {
            const int64_t r = task / j->split, n = j->idx ? j->lens[r] : j->Lk;
            const int64_t k0 = (task % j->split) * j->chunk;
            do_range(j, isa, &w, r, k0 < n ? k0 : n, k0 + j->chunk < n ? k0 + j->chunk : n);
            float *part = j->part + task * nr * (D + 2);
            for (int64_t t = 0; t < nr; t++) {
                part[t * (D + 2)] = w.m[t];
                part[t * (D + 2) + 1] = w.l[t];
                memcpy(part + t * (D + 2) + 2, w.acc + t * D, sizeof(float) * D);
            }
        }
        __atomic_add_fetch(&j->done, 1, __ATOMIC_RELEASE);
    }
    free(mem);
}

/* Drop one reference to the job; the last one frees it. */
static void release(job_t *j) {
    if (__atomic_sub_fetch(&j->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        free(j->part);
        free(j);
    }
}

static void *worker(void *arg) {
    run_tasks((job_t *)arg);
    release((job_t *)arg);
    return NULL;
}

/* Exact merge of row r's split partials (HGCA section 3.3's log-sum-exp merge) into chunk 0's
 * slot, then its output. */
static void merge_row(job_t *j, int64_t r) {
    const int64_t D = j->D, nr = (j->Hq / j->Hkv) * j->Lq, S = j->split;
    float *p0 = j->part + r * S * nr * (D + 2);
    for (int64_t t = 0; t < nr; t++) {
        float *a = p0 + t * (D + 2);
        float m = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            const float ms = a[s * nr * (D + 2)];
            m = ms > m ? ms : m;
        }
        if (m == -INFINITY) continue; /* no visible key: l stays 0 */
        float l = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            const float *ps = a + s * nr * (D + 2);
            const float c = expf(ps[0] - m);
            if (s == 0) {
                for (int64_t d = 0; d < D; d++) a[2 + d] *= c;
            } else if (ps[1] > 0.0f) {
                for (int64_t d = 0; d < D; d++) a[2 + d] += c * ps[2 + d];
            }
            l += c * ps[1];
        }
        a[0] = m;
        a[1] = l;
    }
    finish_row(j, r, p0, p0 + 1, p0 + 2, D + 2, D + 2);
}

/* Returns 0, or -1 when a buffer could not be had (outputs then undefined).
 *
 * The calling thread works too and returns once every task is done, without joining the
 * helper threads: they are detached and hold a reference to the job (on the heap), so a
 * helper that the scheduler starts late (another process on its CPU) finds no task left and
 * exits on its own instead of holding the call up until it gets a CPU. */
int kvb_attn(int dtype, const void *q, const void *k, const void *v, void *out, float *lse,
             int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D,
             const int64_t *kstrides, const int64_t *vstrides, const int32_t *idx,
             const int32_t *lens, int64_t nmax, float scale, int causal, int64_t q_start,
             int64_t group, int threads) {
    job_t *j = malloc(sizeof *j);
    if (!j) return -1;
    *j = (job_t){dtype, q, k, v, out, lse, B, Hq, Hkv, Lq, Lk, D, kstrides, vstrides, idx, lens,
                 nmax, scale, causal, q_start, group < 1 ? 1 : group, 0, 1, 0, NULL,
                 dtype ? &GEN_BF16 : &GEN_F32, 0, 0, 0, 1};
#ifdef KVB_X86
    if (kvb_attn_isa(-1) == 1 && D % (dtype ? 16 : 8) == 0) j->isa = dtype ? &AVX2_BF16 : &AVX2_F32;
#endif
    const int64_t rows = B * Hkv, n = idx ? nmax : Lk;
    int nt = threads < 1 ? 1 : threads > 256 ? 256 : threads;
    if (nt > 1 && rows < SPLIT_ROWS * nt && n >= 2 * MIN_CHUNK) {
        int64_t s = (SPLIT_ROWS * nt + rows - 1) / rows;
        while ((rows * s) % nt) s++; /* equal chunks per thread */
        const int64_t most = n / MIN_CHUNK;
        j->split = s < most ? s : most;
        j->chunk = (n + j->split - 1) / j->split;
        j->chunk = (j->chunk + BLK - 1) / BLK * BLK;
        j->split = (n + j->chunk - 1) / j->chunk;
    }
    if (j->split > 1) {
        j->ntasks = rows * j->split;
        j->part = malloc(sizeof(float) * j->ntasks * (Hq / Hkv) * Lq * (D + 2));
        if (!j->part) {
            free(j);
            return -1;
        }
    } else {
        j->ntasks = (rows + j->group - 1) / j->group;
    }
    if (nt > j->ntasks) nt = (int)j->ntasks;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int t = 1; t < nt; t++) {
        pthread_t tid;
        __atomic_add_fetch(&j->refs, 1, __ATOMIC_RELAXED);
        if (pthread_create(&tid, &attr, worker, j) != 0) {
            __atomic_sub_fetch(&j->refs, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    pthread_attr_destroy(&attr);
    run_tasks(j);
    while (__atomic_load_n(&j->done, __ATOMIC_ACQUIRE) < j->ntasks) sched_yield();
    if (j->split > 1 && !j->failed)
        for (int64_t r = 0; r < rows; r++) merge_row(j, r);
    const int rc = j->failed ? -1 : 0;
    release(j);
    return rc;
}
