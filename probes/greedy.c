/* Greedy decoding's token: the argmax of each row of the logits, as torch.argmax gives it
 * (the first maximal value; a NaN counts as larger than any number, so a row holding one
 * gives its first NaN).
 *
 * torch 2.13's CPU argmax over [4, 49152] float32 took 60 us on 2 threads and 112 on one
 * (2-core AMD EPYC Zen 5 VM, 2026-11-27), about 90 us inside the KV-bound decode step:
 * kvbench's own work, timed as the step's. Here two passes over each share of a row on the
 * caller's threads (the row was just written by the logits head, in their caches): the
 * maximum, with a NaN check, then the first index that holds it, sixteen lanes an
 * instruction where the CPU has AVX-512 (a portable loop elsewhere).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVB_X86 1
#endif

/* The first index of row x [n] holding a NaN, or -1. */
static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}

/* The row's largest value and whether it holds a NaN (*nan), portable. */
static float row_max(const float *x, int64_t n, int *nan) {
    float m = -INFINITY;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    *nan = bad;
    return m;
}

#ifdef KVB_X86
__attribute__((target("avx512f,avx2,fma"))) static float row_max512(const float *x,
                                                                     int64_t n, int *nan) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    int tail = 0;
    float r = _mm512_reduce_max_ps(m), t = row_max(x + i, n - i, &tail);
    *nan = bad != 0 || tail;
    return t > r ? t : r;
}

/* The first index of row x [n] holding m (which it holds). */
__attribute__((target("avx512f,avx2,fma"))) static int64_t first512(const float *x,
                                                                     int64_t n, float m) {
    const __m512 v = _mm512_set1_ps(m);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), v, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
    while (i < n - 1 && x[i] != m) i++;
    return i;
}
#endif

/* The first index of row x [n] holding m (which it holds), portable. */
static int64_t first(const float *x, int64_t n, float m) {
    int64_t i = 0;
    while (i < n - 1 && x[i] != m) i++;
    return i;
}

/* Row x [n]'s argmax over [i0, i1) (a NaN's index when it holds one: *nan), portable or
 * AVX-512 (`wide`). */
static int64_t span_argmax(const float *x, int64_t i0, int64_t i1, int wide, int *nan,
                           float *best) {
    const float *xs = x + i0;
    const int64_t n = i1 - i0;
    float m;
#ifdef KVB_X86
    m = wide ? row_max512(xs, n, nan) : row_max(xs, n, nan);
#else
    (void)wide;
    m = row_max(xs, n, nan);
#endif
    *best = m;
    if (*nan) return i0 + first_nan(xs, n);
#ifdef KVB_X86
    if (wide) return i0 + first512(xs, n, m);
#endif
    return i0 + first(xs, n, m);
}

/* out[r] = the argmax of row r of x [rows, n] (rows contiguous, n >= 1) on `threads`
 * threads, each over a contiguous share of the row (about the ranges the logits head's
 * threads wrote: gemv.c splits its rows into contiguous ranges, so most of a share is read
 * from its writer's cache), the shares' answers merged in order (a NaN first, else the
 * larger maximum, the earlier share on a tie); `isa` 2 takes the AVX-512 loops where the
 * CPU has them, 0 the portable ones (kvb_isa_choice). Returns 0, or -1 when out of
 * memory. */
int kvb_argmax(const float *x, int64_t rows, int64_t n, int64_t *out, int isa, int threads) {
#ifdef KVB_X86
    const int wide = kvb_isa_choice(isa) == 2;
#else
    const int wide = 0;
    (void)isa;
#endif
    int nt = kvb_team(threads);
    if (nt > n) nt = (int)n;
    const int64_t items = rows * nt; /* item t * rows + r: share t of row r */
    int64_t *at = malloc(sizeof(int64_t) * items);
    float *best = malloc(sizeof(float) * items);
    int *nan = malloc(sizeof(int) * items);
    const int ok = at && best && nan;
    if (ok) {
        /* a static schedule gives thread t the items of its share t of every row */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < items; i++) {
            const int64_t t = i / rows, r = i % rows;
            at[i] = span_argmax(x + r * n, n * t / nt, n * (t + 1) / nt, wide, nan + i,
                                best + i);
        }
        for (int64_t r = 0; r < rows; r++) {
            int64_t a = at[r];
            float m = best[r];
            int bad = nan[r];
            for (int64_t t = 1; t < nt && !bad; t++) {
                const int64_t i = t * rows + r;
                if (nan[i] || best[i] > m) {
                    a = at[i];
                    m = best[i];
                    bad = nan[i];
                }
            }
            out[r] = a;
        }
    }
    free(at);
    free(best);
    free(nan);
    return ok ? 0 : -1;
}
