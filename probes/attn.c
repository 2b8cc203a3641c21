/* CPU attention over a KV cache with its log-sum-exp (HGCA sections 2.3 and 3.3).
 *
 * One call computes, for every (batch, KV head) row, the attention of that KV head's
 * G = Hq / Hkv query heads times Lq queries over either all Lk positions (dense) or the
 * row's own list of selected positions (sparse: idx [rows, nmax] int32, lens [rows]).
 * Rows are grouped into tasks of `group` adjacent rows (HGCA's merged heads); `threads`
 * pthreads take tasks from a shared counter and write disjoint parts of one output buffer.
 *
 * Keys are read once per row in blocks of BLK, scores go through an online softmax (the
 * FlashAttention recurrence), so each K and V byte is read once: decode is bandwidth-bound.
 * dtype 0 is float32, 1 is bfloat16 (converted by shifting to/from the float32 high half).
 * q/out are contiguous [B, Hq, Lq, D], lse [B, Hq, Lq] float32; k/v have element strides
 * (batch, head, token) and a contiguous last dimension. The file is compiled at O3 (the
 * pragma below, no -march) so GCC vectorises the dot/axpy/convert loops with baseline SIMD.
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLK 64

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
    int64_t next; /* shared task counter */
    int failed;
} job_t;

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

/* Row `pos` of a [.., D] tensor as float32: a pointer into f32 data, or converted into buf. */
static inline const float *row_f32(const job_t *j, const void *base, int64_t off, float *buf) {
    if (j->dtype == 0) return (const float *)base + off;
    const uint16_t *h = (const uint16_t *)base + off;
    for (int64_t d = 0; d < j->D; d++) buf[d] = bf16_to_f32(h[d]);
    return buf;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int u = 0; u < 8; u++) s[u] += a[d + u] * b[d + u];
    float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; d < n; d++) t += a[d] * b[d];
    return t;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

/* Prefetch one whole row (64 B lines) of `base` at element offset `off`. */
static inline void prefetch_row(const job_t *j, const void *base, int64_t off) {
    const int64_t esz = j->dtype == 0 ? 4 : 2;
    const char *p = (const char *)base + off * esz;
    for (int64_t c = 0; c < j->D * esz; c += 64) __builtin_prefetch(p + c);
}

typedef struct {
    float *qf, *acc, *m, *l, *s, *kbuf, *vbuf;
    const float *kp[BLK];
} work_t;

static void do_row(job_t *j, work_t *w, int64_t r) {
    const int64_t D = j->D, G = j->Hq / j->Hkv, Lq = j->Lq, nr = G * Lq;
    const int64_t b = r / j->Hkv, hk = r % j->Hkv;
    const int32_t *idx = j->idx ? j->idx + r * j->nmax : NULL;
    const int64_t n = idx ? j->lens[r] : j->Lk;
    const int64_t kb = b * j->ks[0] + hk * j->ks[1], vb = b * j->vs[0] + hk * j->vs[1];
    for (int64_t t = 0; t < nr; t++) { /* t = g * Lq + i: query head hk*G+g, query i */
        int64_t qoff = ((b * j->Hq + hk * G) * Lq + t) * D;
        const float *qr = row_f32(j, j->q, qoff, w->vbuf);
        for (int64_t d = 0; d < D; d++) w->qf[t * D + d] = qr[d] * j->scale;
        w->m[t] = -INFINITY;
        w->l[t] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * nr * D);
    int32_t pos[BLK];
    /* Sparse rows are scattered (a page each): while a block is used, the rows of the next
     * block are prefetched one by one (K with the K loads, V with the V loads) so their
     * misses overlap instead of serialising behind each dot product. */
    if (idx)
        for (int64_t jj = 0; jj < BLK && jj < n; jj++)
            prefetch_row(j, j->k, kb + idx[jj] * j->ks[2]);
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
        const int64_t nb = n - j0 < BLK ? n - j0 : BLK;
        const int64_t nx = n - j0 - BLK < BLK ? n - j0 - BLK : BLK; /* next block's size */
        for (int64_t jj = 0; jj < nb; jj++) {
            if (idx && jj < nx) prefetch_row(j, j->k, kb + idx[j0 + BLK + jj] * j->ks[2]);
            if (idx && j0 == 0) prefetch_row(j, j->v, vb + idx[jj] * j->vs[2]);
            pos[jj] = idx ? idx[j0 + jj] : (int32_t)(j0 + jj);
            w->kp[jj] = row_f32(j, j->k, kb + pos[jj] * j->ks[2], w->kbuf + jj * D);
        }
        for (int64_t t = 0; t < nr; t++) {
            float *s = w->s + t * BLK;
            const int64_t limit = j->causal ? j->q_start + t % Lq : INT64_MAX;
            float bm = -INFINITY;
            for (int64_t jj = 0; jj < nb; jj++) {
                s[jj] = pos[jj] > limit ? -INFINITY : dot(w->qf + t * D, w->kp[jj], D);
                bm = s[jj] > bm ? s[jj] : bm;
            }
            if (bm == -INFINITY) { /* nothing visible in this block for this query */
                for (int64_t jj = 0; jj < nb; jj++) s[jj] = 0.0f;
                continue;
            }
            const float mn = w->m[t] > bm ? w->m[t] : bm;
            const float corr = expf(w->m[t] - mn); /* 0 when m was -inf */
            float sum = 0.0f;
            for (int64_t jj = 0; jj < nb; jj++) {
                s[jj] = expf(s[jj] - mn);
                sum += s[jj];
            }
            if (corr != 1.0f)
                for (int64_t d = 0; d < D; d++) w->acc[t * D + d] *= corr;
            w->l[t] = w->l[t] * corr + sum;
            w->m[t] = mn;
        }
        for (int64_t jj = 0; jj < nb; jj++) {
            if (idx && jj < nx) prefetch_row(j, j->v, vb + idx[j0 + BLK + jj] * j->vs[2]);
            const float *vr = row_f32(j, j->v, vb + pos[jj] * j->vs[2], w->vbuf);
            for (int64_t t = 0; t < nr; t++) {
                const float p = w->s[t * BLK + jj];
                if (p != 0.0f) axpy(w->acc + t * D, p, vr, D);
            }
        }
    }
    for (int64_t t = 0; t < nr; t++) {
        const int64_t g = t / Lq, i = t % Lq;
        const int64_t orow = (b * j->Hq + hk * G + g) * Lq + i;
        const float inv = w->l[t] > 0.0f ? 1.0f / w->l[t] : 0.0f;
        j->lse[orow] = w->l[t] > 0.0f ? w->m[t] + logf(w->l[t]) : -INFINITY;
        for (int64_t d = 0; d < D; d++) {
            const float o = w->acc[t * D + d] * inv;
            if (j->dtype == 0)
                ((float *)j->out)[orow * D + d] = o;
            else
                ((uint16_t *)j->out)[orow * D + d] = f32_to_bf16(o);
        }
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t nr = (j->Hq / j->Hkv) * j->Lq, D = j->D;
    work_t w;
    float *mem = malloc(sizeof(float) * (2 * nr * D + 2 * nr + nr * BLK + BLK * D + D));
    if (!mem) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    w.qf = mem;
    w.acc = w.qf + nr * D;
    w.m = w.acc + nr * D;
    w.l = w.m + nr;
    w.s = w.l + nr;
    w.kbuf = w.s + nr * BLK;
    w.vbuf = w.kbuf + BLK * D;
    const int64_t rows = j->B * j->Hkv;
    for (;;) {
        const int64_t task = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (task >= j->ntasks) break;
        const int64_t r1 = (task + 1) * j->group < rows ? (task + 1) * j->group : rows;
        for (int64_t r = task * j->group; r < r1; r++) do_row(j, &w, r);
    }
    free(mem);
    return NULL;
}

/* Returns 0, or -1 when a buffer or a thread could not be had (outputs then undefined). */
int kvb_attn(int dtype, const void *q, const void *k, const void *v, void *out, float *lse,
             int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D,
             const int64_t *kstrides, const int64_t *vstrides, const int32_t *idx,
             const int32_t *lens, int64_t nmax, float scale, int causal, int64_t q_start,
             int64_t group, int threads) {
    job_t j = {dtype, q, k, v, out, lse, B, Hq, Hkv, Lq, Lk, D, kstrides, vstrides, idx, lens,
               nmax, scale, causal, q_start, group < 1 ? 1 : group, 0, 0, 0};
    const int64_t rows = B * Hkv;
    j.ntasks = (rows + j.group - 1) / j.group;
    int nt = threads < 1 ? 1 : threads;
    if (nt > j.ntasks) nt = (int)j.ntasks;
    pthread_t tid[256];
    if (nt > 256) nt = 256;
    int started = 0;
    for (int t = 1; t < nt; t++) {
        if (pthread_create(&tid[started], NULL, worker, &j) != 0) break;
        started++;
    }
    worker(&j);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
    return j.failed ? -1 : 0;
}
