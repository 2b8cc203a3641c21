/* kvbench memory probes: pinned multi-threaded copy loops, plain memcpy references and the
 * pointer chase (CXL KV-storage paper, section 3.1 / Fig. 1a; issue 3).
 *
 * Timed functions return elapsed CLOCK_MONOTONIC nanoseconds (kvb_now_ns of native.c);
 * callers divide by the iteration count. Worker threads are created before the clock
 * starts and released together by a flag, so thread creation is not timed.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* One thread's share of a copy: iteration i copies `chunk` bytes at offset w_i * stride of
 * both dst and src, where w_0 = start and w_{i+1} = (w_i + hop) % windows; `start` is
 * written back so the next call continues where this one stopped. hop 1 streams through the
 * windows; a large hop coprime with windows visits them in an order prefetchers cannot
 * follow. The ctypes mirror is kvbench.native.CopyJob. */
typedef struct {
    void *dst;
    const void *src;
    size_t chunk;   /* bytes copied per iteration */
    size_t stride;  /* offset step between iterations */
    size_t windows; /* number of offsets visited (>= 1) */
    size_t hop;     /* window step, 1 <= hop < windows unless windows == 1 */
    size_t start;   /* first window; updated to the next one on return */
    const int *cpus; /* CPUs the thread may run on (its source node's), NULL: any */
    int ncpus;
    int fence;      /* 1: fence after every copy and make the next address depend on its
                       data, so copies do not overlap (latency) */
    int allowed;    /* written back: how many CPUs the thread was allowed to run on */
} kvb_copy_job;

typedef struct {
    kvb_copy_job *job;
    size_t iters;
    int *go; /* 0: wait, 1: run, 2: abort (a sibling could not be created) */
    uint64_t t0, t1;
} worker_arg;

/* Restrict the calling thread to cpus[0..n) (n == 0: leave it as it is); returns how many
 * CPUs it may run on afterwards. A set rather than one CPU per thread: with as many copy
 * threads as CPUs, a thread pinned to one CPU cannot leave it when anything else runs there
 * (a display thread, another process) while a sibling's CPU idles, and the sample waits for
 * the slowest thread. */
static int pin_self(const int *cpus, int n) {
    cpu_set_t set;
    if (n > 0) {
        CPU_ZERO(&set);
        for (int i = 0; i < n; i++)
            if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) != 0) return 0;
    return CPU_COUNT(&set);
}

static void *copy_worker(void *p) {
    worker_arg *a = p;
    kvb_copy_job *j = a->job;
    j->allowed = pin_self(j->cpus, j->ncpus);
    int go;
    while ((go = __atomic_load_n(a->go, __ATOMIC_ACQUIRE)) == 0) sched_yield();
    if (go != 1) return NULL;
    a->t0 = kvb_now_ns();
    size_t w = j->start % j->windows, hop = j->hop % j->windows;
    size_t zero = (size_t)(j->fence >> 8); /* 0, unknown to the compiler */
    for (size_t i = 0; i < a->iters; i++) {
        size_t off = w * j->stride;
        memcpy((char *)j->dst + off, (const char *)j->src + off, j->chunk);
        __asm__ volatile("" : : "r"(j->dst) : "memory");
        if (j->fence) { /* next address depends on this copy's data: no overlap */
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            w += ((const volatile unsigned char *)j->dst)[off] & zero;
        }
        w += hop;
        if (w >= j->windows) w -= j->windows;
    }
    a->t1 = kvb_now_ns();
    j->start = w;
    return NULL;
}

/* Run njobs threads at once, each doing `iters` copies of its job; returns the ns from the
 * first thread's start to the last thread's end, or 0 when a thread could not be created. */
uint64_t kvb_copy_jobs(kvb_copy_job *jobs, int njobs, size_t iters) {
    if (njobs < 1 || njobs > 1024) return 0;
    pthread_t tid[1024];
    worker_arg args[1024];
    int go = 0, started = 0;
    for (int k = 0; k < njobs; k++) {
        args[k] = (worker_arg){&jobs[k], iters, &go, 0, 0};
        if (pthread_create(&tid[k], NULL, copy_worker, &args[k]) != 0) break;
        started++;
    }
    __atomic_store_n(&go, started == njobs ? 1 : 2, __ATOMIC_RELEASE);
    uint64_t first = UINT64_MAX, last = 0;
    for (int k = 0; k < started; k++) {
        pthread_join(tid[k], NULL);
        if (args[k].t0 < first) first = args[k].t0;
        if (args[k].t1 > last) last = args[k].t1;
    }
    return started < njobs ? 0 : last - first;
}

/* Plain N-thread memcpy reference: unpinned threads, each copying its slice `iters` times,
 * timed around create and join. What a programmer would write without kvbench. */
typedef struct { void *dst; const void *src; size_t n, iters; } plain_arg;

static void *plain_worker(void *p) {
    plain_arg *a = p;
    for (size_t i = 0; i < a->iters; i++) {
        memcpy(a->dst, a->src, a->n);
        __asm__ volatile("" : : "r"(a->dst) : "memory");
    }
    return NULL;
}

uint64_t kvb_memcpy_threads(void *dst, const void *src, size_t n, size_t iters, int nthreads) {
    if (nthreads < 1 || nthreads > 1024) return 0;
    pthread_t tid[1024];
    plain_arg args[1024];
    size_t slice = n / (size_t)nthreads;
    uint64_t t0 = kvb_now_ns();
    for (int k = 0; k < nthreads; k++) {
        size_t off = slice * (size_t)k;
        size_t len = k == nthreads - 1 ? n - off : slice;
        args[k] = (plain_arg){(char *)dst + off, (const char *)src + off, len, iters};
        if (pthread_create(&tid[k], NULL, plain_worker, &args[k]) != 0) {
            for (int m = 0; m < k; m++) pthread_join(tid[m], NULL);
            return 0;
        }
    }
    for (int k = 0; k < nthreads; k++) pthread_join(tid[k], NULL);
    return kvb_now_ns() - t0;
}

/* Read-only bandwidth (the roof of decode attention, which reads K and V once): nthreads
 * threads sum the 64-bit words of src, `iters` times over, taking READ_CHUNK-byte pieces
 * from a shared counter, with AVX2 loads where the CPU has them. Threaded like the attention
 * kernel (probes/attn.c: one OpenMP parallel region on torch's runtime) and timed the same
 * way, around the whole call, so the two compare like with like. Returns elapsed ns (0 for
 * bad arguments). */
#define READ_CHUNK ((size_t)1 << 20)

typedef struct {
    const char *p;
    size_t n, pieces;
    int64_t next;       /* pieces taken */
    uint64_t sum;
} read_job;

static uint64_t read_generic(const char *p, size_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    const uint64_t *w = (const uint64_t *)p;
    size_t i = 0, nw = n / 8;
    for (; i + 4 <= nw; i += 4) s0 += w[i], s1 += w[i + 1], s2 += w[i + 2], s3 += w[i + 3];
    for (; i < nw; i++) s0 += w[i];
    return s0 + s1 + s2 + s3;
}

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static uint64_t read_avx2(const char *p, size_t n) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t lane[4];
    _mm256_storeu_si256((__m256i *)lane,
                        _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    return lane[0] + lane[1] + lane[2] + lane[3] + read_generic(p + i, n - i);
}
#endif

static void read_pieces(read_job *j) {
    uint64_t (*fn)(const char *, size_t) = read_generic;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) fn = read_avx2;
#endif
    const size_t per = (j->n + READ_CHUNK - 1) / READ_CHUNK;
    uint64_t sum = 0;
    for (;;) {
        const size_t k = (size_t)__atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->pieces) break;
        const size_t off = (k % per) * READ_CHUNK;
        sum += fn(j->p + off, j->n - off < READ_CHUNK ? j->n - off : READ_CHUNK);
    }
    __atomic_add_fetch(&j->sum, sum, __ATOMIC_RELAXED);
}

uint64_t kvb_read_threads(const void *src, size_t n, size_t iters, int nthreads) {
    if (nthreads < 1 || nthreads > 1024 || n == 0) return 0;
    const uint64_t t0 = kvb_now_ns();
    read_job job = {src, n, iters * ((n + READ_CHUNK - 1) / READ_CHUNK), 0, 0};
#pragma omp parallel num_threads(nthreads)
    read_pieces(&job);
    const uint64_t ns = kvb_now_ns() - t0;
    __asm__ volatile("" : : "r"(__atomic_load_n(&job.sum, __ATOMIC_RELAXED)));
    return ns;
}

/* Pointer chase: make the `nlines` lines of `line` bytes at buf one random cycle (Sattolo's
 * algorithm), each line's first word pointing at the next line. Returns 0, or -1 if out of
 * memory. */
int kvb_chase_build(void *buf, size_t nlines, size_t line, uint64_t seed) {
    size_t *next = malloc(nlines * sizeof *next);
    if (!next) return -1;
    for (size_t i = 0; i < nlines; i++) next[i] = i;
    uint64_t x = seed | 1;
    for (size_t i = nlines - 1; i > 0; i--) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17; /* xorshift64 */
        size_t j = (size_t)(x % i);
        size_t t = next[i]; next[i] = next[j]; next[j] = t;
    }
    for (size_t i = 0; i < nlines; i++)
        *(void **)((char *)buf + i * line) = (char *)buf + next[i] * line;
    free(next);
    return 0;
}

typedef struct { const void *q; size_t loads; int cpu; uint64_t ns; } chase_arg;

static void *chase_worker(void *p) {
    chase_arg *a = p;
    pin_self(&a->cpu, a->cpu >= 0);
    const void *q = a->q;
    uint64_t t0 = kvb_now_ns();
    for (size_t i = 0; i < a->loads; i += 8) { /* each load depends on the one before */
        q = *(void *const *)q; q = *(void *const *)q; q = *(void *const *)q;
        q = *(void *const *)q; q = *(void *const *)q; q = *(void *const *)q;
        q = *(void *const *)q; q = *(void *const *)q;
    }
    a->ns = kvb_now_ns() - t0;
    a->q = q;
    return NULL;
}

/* Follow `loads` (rounded up to a multiple of 8) pointers from *cursor in a thread pinned
 * to cpu (-1: not pinned) and leave *cursor where the chase stopped, so the next call goes
 * on around the cycle; returns elapsed ns, or 0 when the thread could not be created. */
uint64_t kvb_chase(void **cursor, size_t loads, int cpu) {
    chase_arg a = {*cursor, loads, cpu, 0};
    pthread_t tid;
    if (pthread_create(&tid, NULL, chase_worker, &a) != 0) return 0;
    pthread_join(tid, NULL);
    *cursor = (void *)a.q;
    return a.ns;
}
