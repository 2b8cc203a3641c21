/* CPU attention over a KV cache with its log-sum-exp (HGCA sections 2.3 and 3.3).
 *
 * One call computes, for every (batch, KV head) row, the attention of that KV head's
 * G = Hq / Hkv query heads times Lq queries over either all Lk positions (dense) or the
 * row's own list of selected positions (sparse: idx [rows, nmax] int32, rows ldi apart,
 * lens [rows]).
 * A sparse call may also give each selection to fewer query heads: rows are then
 * (batch, Hs heads) with Hkv | Hs | Hq, row (b, s) holding query heads s*Hq/Hs.. of KV head
 * s*Hq/Hs / G (Hs = Hq: one list per query head, Quest's per-head top-k under GQA).
 * Each K and V row is read once for all G * Lq queries of its row (GQA reads a KV head once
 * for its whole query group), in blocks of BLK keys through an online softmax (the
 * FlashAttention recurrence): decode is bandwidth-bound.
 *
 * Work split: with many rows, tasks are `group` adjacent rows (HGCA's merged heads); with
 * fewer than SPLIT_ROWS rows per thread (decode at batch 1: a few KV heads on all cores),
 * every row's keys are split into S chunks (split-K, as FlashDecoding) whose partial
 * (max, sum, accumulator) are merged exactly afterwards, so all threads stay busy. Threads
 * of one OpenMP parallel region take tasks from a shared counter and write disjoint parts of
 * one output buffer (see kvb_attn).
 *
 * The inner loops (attn_loops.c) have an AVX2/FMA version and, for float32, an AVX-512 one
 * (attn_avx512.c), the best the CPU has chosen at run time, and a portable one (kvb_attn_isa
 * reports or forces the choice).
 *
 * Rows of at most 256 bytes over a KV of at least kvb_attn_prefetch_from bytes (half the
 * LLC, set by kvbench.native) are fetched ahead of use, a few lines per key inside the
 * loops: a block's V rows while its scores run, the next block's K rows while its P.V runs.
 * Decode otherwise alternates compute on one block with misses on the next. Measured for
 * dense rows on the 2-core Zen 3 CI VM, timed call by call against the kernel without it
 * (results/wave1-speed/prefetch-ab-2026-11-23.txt):
 *   - 16K-32K tokens: +16-26% for 9/3 x 128 bfloat16, +21-24% for 8/8 x 64 bfloat16,
 *     +6-13% for 32/32 x 128 bfloat16, +3-17% for 9/3 x 64 float32;
 *   - at exactly 16 MiB (8/8 x 64 float32, 4K tokens): +16%;
 *   - where it cost (so it is off there): 1-4% on 512-byte rows, 19-25% on a KV of
 *     6-8 MiB, which stays in cache.
 * Selected rows (idx: a sparse strategy's pages) take the same path; before, they were
 * prefetched to L1 a block at a time in one burst, and 1024 selected keys of 4 x 3 heads x
 * 64 float32 over 8000 (8 layers' KV, cold) took 690-860 us as 64 random pages of 16 and
 * 490-530 us as one run, against 470-540 and 315-380 us with the L2 path (interleaved,
 * 2-core AMD EPYC VM, 2026-11-27).
 * The fetches go to L1 (prefetcht0) in blocks of 32 keys (a block's K or V rows: 8 KiB at
 * 256-byte rows, so the block in use and the rows fetched for the next phase fit L1 beside
 * each other). On the 2-core Zen 5 VM against the L2 path in blocks of 64: a cold dense
 * layer of 4 x 3 x 8000 float32 rows 16% faster (calls alternated, three sittings:
 * 15.7-16.4%), a full-attention decode step 5.7-6.1% faster (the variants in turn, step by
 * step in one run, paired), where L1 in blocks of 64 gave 3.2-3.9% and L2 in blocks of 32
 * 1.5-2.0%; ArkVale's step 4.7%, StreamingLLM's 3.0%, Quest's -0.3 to +3.7%
 * (results/kv-bound-speed/kernel-l1-ab-2026-11-27.txt).
 *
 * dtype 0 is float32, 1 is bfloat16 (converted by shifting to/from the float32 high half).
 * q/out are contiguous [B, Hq, Lq, D], lse [B, Hq, Lq] float32; k/v have element strides
 * (batch, head, token) and a contiguous last dimension.
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <stdlib.h>

#include "attn.h"
#include "native.h"

#define SPLIT_ROWS 8  /* below this many rows per thread, rows are split along the keys */
#define MIN_CHUNK 256 /* fewest keys per split chunk */

static int g_isa = -1; /* -1: not chosen yet, 0: portable, 1: AVX2/FMA, 2: AVX-512 */
static int64_t g_prefetch_from = (int64_t)16 << 20; /* KV bytes: half a 32 MiB LLC */

/* bytes >= 0: dense calls over a KV of `bytes` bytes or more prefetch (rows of at most
 * 256 bytes); returns the threshold now in effect. */
int64_t kvb_attn_prefetch_from(int64_t bytes) {
    if (bytes >= 0) g_prefetch_from = bytes;
    return g_prefetch_from;
}

/* want -1: report the inner loops in use (choosing the best on first use), 0: force the
 * portable ones, 1: AVX2/FMA, 2: AVX-512, each where the CPU has it (else the best it has
 * below). Returns the choice now in effect. */
int kvb_attn_isa(int want) {
    if (want >= 0 || g_isa < 0) g_isa = kvb_isa_choice(want);
    return g_isa;
}

typedef struct {
    float *qf, *acc, *m, *l, *s, *corr;
    const void *kp[BLK], *vp[BLK], *kn[BLK]; /* kn: the next block's K rows (prefetch) */
} work_t;

/* Pointers to rows pos[0..nb) of k or v (element offset off, row stride `stride`). */
static inline void row_ptrs(const kvb_attn_job_t *j, const void *base, int64_t off,
                            int64_t stride, const int32_t *pos, int64_t nb, const void **ptr) {
    const int64_t esz = j->dtype == 0 ? 4 : 2;
    for (int64_t i = 0; i < nb; i++) ptr[i] = (const char *)base + (off + pos[i] * stride) * esz;
}

/* Attention of row r's G*Lq queries over its keys [k0, k1): leaves the running max m, sum l
 * and unnormalised accumulator acc (nr x D, in the isa's order) in w. */
static void do_range(kvb_attn_job_t *j, const isa_t *isa, work_t *w, int64_t r, int64_t k0,
                     int64_t k1) {
    const int64_t D = j->D, G = j->Hq / j->Hs, Lq = j->Lq, nr = G * Lq; /* G: heads of a row */
    const int64_t b = r / j->Hs, h0 = r % j->Hs * G, hk = h0 / (j->Hq / j->Hkv);
    const int32_t *idx = j->idx ? j->idx + r * j->ldi : NULL;
    const int64_t kb = b * j->ks[0] + hk * j->ks[1], vb = b * j->vs[0] + hk * j->vs[1];
    for (int64_t t = 0; t < nr; t++) { /* t = g * Lq + i: query head h0+g, query i */
        const int64_t qoff = ((b * j->Hq + h0) * Lq + t) * D;
        for (int64_t d = 0; d < D; d++)
            w->qf[t * D + d] = elem((const char *)j->q + qoff * (j->dtype ? 2 : 4),
                                    isa->perm ? swap23(d) : d, j->dtype) * j->scale;
        w->m[t] = -INFINITY;
        w->l[t] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * nr * D);
    int32_t pos[BLK];
    for (int64_t j0 = k0; j0 < k1; j0 += BLK) {
        const int64_t nb = k1 - j0 < BLK ? k1 - j0 : BLK;
        const int64_t nx = k1 - j0 - BLK < BLK ? k1 - j0 - BLK : BLK; /* next block's size */
        for (int64_t jj = 0; jj < nb; jj++) pos[jj] = idx ? idx[j0 + jj] : (int32_t)(j0 + jj);
        row_ptrs(j, j->k, kb, j->ks[2], pos, nb, w->kp);
        row_ptrs(j, j->v, vb, j->vs[2], pos, nb, w->vp);
        /* this block's V rows are fetched while its scores run, the next block's K rows
         * while its P.V runs (dense or selected rows alike) */
        const int64_t esz = j->dtype ? 2 : 4;
        pf_t pfv = {w->vp, 0, D * esz}, pfk = {w->kn, 0, D * esz};
        if (j->prefetch) {
            for (int64_t jj = 0; jj < nx; jj++)
                w->kn[jj] = (const char *)j->k +
                            (kb + (idx ? idx[j0 + BLK + jj] : j0 + BLK + jj) * j->ks[2]) * esz;
            pfv.n = nb;
            pfk.n = nx > 0 ? nx : 0;
        }
        isa->scores(w->s, w->qf, nr, D, w->kp, nb, &pfv);
        /* causal masking only where a key may lie after a query (never in decode) */
        const int mask = j->causal && (idx || j0 + nb - 1 > j->q_start);
        for (int64_t t = 0; t < nr; t++) {
            float *s = w->s + t * BLK;
            const int64_t limit = j->q_start + t % Lq;
            for (int64_t jj = 0; mask && jj < nb; jj++)
                if (pos[jj] > limit) s[jj] = -INFINITY;
            if (j->keep) { /* the query head's own subset of the row's selected keys */
                const uint8_t *kt = j->keep + (b * j->Hq + h0 + t / Lq) * j->ldk + j0;
                for (int64_t jj = 0; jj < nb; jj++)
                    if (!kt[jj]) s[jj] = -INFINITY;
            }
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
        isa->pv(w->acc, w->corr, w->s, w->vp, nr, nb, D, &pfk);
    }
}

/* Normalised output and lse of row r from (m, l, acc) of nr queries; query t's m and l at
 * t * stride, its accumulator at t * astride. */
static void finish_row(kvb_attn_job_t *j, int64_t r, const float *m, const float *l,
                       const float *acc, int64_t stride, int64_t astride) {
    const int64_t D = j->D, G = j->Hq / j->Hs, Lq = j->Lq, nr = G * Lq;
    const int64_t b = r / j->Hs, h0 = r % j->Hs * G;
    const int perm = j->isa->perm;
    for (int64_t t = 0; t < nr; t++) {
        const int64_t orow = (b * j->Hq + h0 + t / Lq) * Lq + t % Lq;
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

/* Take tasks from the shared counter until none is left (a thread that could not get its
 * work buffers still takes its tasks, marking the job failed). */
static void run_tasks(kvb_attn_job_t *j) {
    const int64_t nr = (j->Hq / j->Hs) * j->Lq, D = j->D;
    const isa_t *isa = j->isa;
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
    const int64_t rows = j->B * j->Hs;
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
    }
    free(mem);
}

/* Exact merge of row r's split partials (HGCA section 3.3's log-sum-exp merge) into chunk 0's
 * slot, then its output. */
static void merge_row(kvb_attn_job_t *j, int64_t r) {
    const int64_t D = j->D, nr = (j->Hq / j->Hs) * j->Lq, S = j->split;
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

/* Sets up *j for one call (kvb_attn's arguments) on `threads` threads and returns 0, -1
 * when a buffer could not be had or -2 when the arguments do not fit (see kvb_attn); on an
 * error the job has no tasks, so kvb_attn_work does nothing. */
int kvb_attn_plan(kvb_attn_job_t *j, int dtype, const void *q, const void *k, const void *v,
                  void *out, float *lse, int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq,
                  int64_t Lk, int64_t D, const int64_t *kstrides, const int64_t *vstrides,
                  const int32_t *idx, const int32_t *lens, const uint8_t *keep, int64_t nmax,
                  int64_t ldi, int64_t ldk, int64_t Hs, float scale, int causal,
                  int64_t q_start, int64_t group, int threads) {
    *j = (kvb_attn_job_t){dtype, q, k, v, out, lse, B, Hq, Hkv, Lq, Lk, D, kstrides, vstrides,
                          idx, lens, keep, nmax, Hs, scale, causal, q_start,
                          group < 1 ? 1 : group, 0, 1, 0, 0, NULL,
                          kvb_attn_loops(dtype, D, kvb_attn_isa(-1)), 0, 0, ldi, ldk};
    if (Hs < 1 || Hs % Hkv || Hq % Hs || (!idx && (Hs != Hkv || keep))) return -2;
    const int64_t rows = B * Hs, n = idx ? nmax : Lk, esz = dtype ? 2 : 4;
    j->prefetch = D * esz <= 256 && 2 * rows * Lk * D * esz >= g_prefetch_from;
    const int nt = kvb_team(threads);
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
        j->part = malloc(sizeof(float) * rows * j->split * (Hq / Hs) * Lq * (D + 2));
        if (!j->part) return -1;
        j->ntasks = rows * j->split;
    } else {
        j->ntasks = (rows + j->group - 1) / j->group;
    }
    return 0;
}

/* Every thread of a parallel region (or the caller alone, outside one): the job's tasks,
 * then, split rows merged (a row per thread); all of it done when the threads leave. */
void kvb_attn_work(kvb_attn_job_t *j) {
    run_tasks(j);
    if (j->split == 1) return;
#pragma omp barrier
#pragma omp for
    for (int64_t r = 0; r < j->B * j->Hs; r++)
        if (!j->failed) merge_row(j, r);
}

/* Releases the job's buffer; 0, or -1 when a thread could not get its work buffers. */
int kvb_attn_end(kvb_attn_job_t *j) {
    free(j->part);
    j->part = NULL;
    return j->failed ? -1 : 0;
}

/* Returns 0, -1 when a buffer could not be had (outputs then undefined), or -2 when Hs does
 * not fit (Hkv | Hs | Hq, Hs = Hkv when dense) or `keep` comes without a selection. keep
 * (optional, sparse only) [B * Hq, nmax] bytes, rows ldk apart: query head h of sequence b
 * attends the j-th selected key of its row only where keep[(b * Hq + h) * ldk + j] is
 * non-zero (HGCA's per-head selections over the union a KV head's copy holds: one pass for
 * the group). idx rows are ldi apart: both may be the first nmax columns of wider buffers.
 *
 * The tasks run in an OpenMP parallel region: the library links the OpenMP runtime that torch
 * has already loaded (kvbench.native loads torch first), so the kernel's threads are torch's
 * own intra-op threads. Threads of a second pool would compete for the cores with torch's
 * workers, which spin for a while after each torch op (OMP_WAIT_POLICY). */
int kvb_attn(int dtype, const void *q, const void *k, const void *v, void *out, float *lse,
             int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D,
             const int64_t *kstrides, const int64_t *vstrides, const int32_t *idx,
             const int32_t *lens, const uint8_t *keep, int64_t nmax, int64_t ldi, int64_t ldk,
             int64_t Hs, float scale, int causal, int64_t q_start, int64_t group, int threads) {
    kvb_attn_job_t job;
    const int rc = kvb_attn_plan(&job, dtype, q, k, v, out, lse, B, Hq, Hkv, Lq, Lk, D,
                                 kstrides, vstrides, idx, lens, keep, nmax, ldi, ldk, Hs,
                                 scale, causal, q_start, group, threads);
    if (rc) return rc;
    const int nt = job.ntasks < kvb_team(threads) ? (int)job.ntasks : kvb_team(threads);
#pragma omp parallel num_threads(nt)
    kvb_attn_work(&job);
    return kvb_attn_end(&job);
}
