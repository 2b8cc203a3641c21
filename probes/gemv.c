/* Decode's matmuls on the CPU: y[b, n] = sum_k x[b, k] w[n, k] for a few rows x.
 *
 * A decode step multiplies B (1-8) activation rows by every weight matrix W [N, K] of the
 * model, row-major as nn.Linear stores it: the step is a stream of W through the cores,
 * and its speed is how close that stream runs to the memory's read bandwidth. Each W row
 * is read once, in order, and dotted with all B rows of x (in L1: B x K floats; past L1D
 * they are interleaved first, XI_BYTES below), with W prefetched into L2 far ahead (ROW
 * below). Threads split N into contiguous ranges, so each reads one sequential stream.
 * AVX2/FMA where the CPU has it (AVX-512 for one row, where the CPU has that), chosen at
 * run time as attn.c does, else a portable loop GCC vectorises.
 *
 * Measured against MKL/oneDNN on the 2-core AMD EPYC VM (kvbench.models.linear's doc).
 */
#define _GNU_SOURCE
#pragma GCC optimize("O3")
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "native.h"
#include "sum8.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVB_X86 1
#endif

#define SPLIT 12 /* threads split N in multiples of this */

static void rows_gen(const gemv_t *g, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = g->w + n * g->K;
        for (int64_t b = 0; b < g->B; b++) {
            const float r = kvb_dot(wr, g->x + b * g->ldx, g->K);
            g->y[b * g->N + n] = g->acc ? g->y[b * g->N + n] + r : r;
        }
    }
}

#ifdef KVB_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* One W row against NB rows of x (a compile-time constant: accumulators in registers), K
 * unrolled U vectors deep so that U x NB independent accumulators hide the FMA latency and
 * each W load feeds NB FMAs (x in L1, read as memory operands). W streams in order;
 * every 64-byte line is prefetched into L2 PREFETCH bytes ahead. Without that prefetch the
 * cores, busy with B FMAs per weight, kept too few lines in flight: B = 4 ran at 15-16 GB/s
 * against 29 with it and the read loop's 37 (2-core AMD EPYC VM, 16 KiB ahead; 2-8 KiB and
 * 32 KiB within noise of it, an L1 prefetch or none 21-23 GB/s). One row at a time beat
 * R rows at a time (R interleaved streams) by the same margin. */
#define PREFETCH 16384
/* ROW's x operand: row b's floats k..k+7 at x + b * XS + k * XK: the rows as they are
 * (ldx apart, XK 1), or interleaved (XS 8, XK NB: each 8 floats of every row side by side,
 * `interleave`). */
#define ROW(NAME, NB, U, XS, XK)                                                          \
    static AVX2 void NAME(const gemv_t *g, const float *x, int64_t n) {                   \
        __m256 a[U][NB];                                                                  \
        for (int u = 0; u < U; u++)                                                       \
            for (int b = 0; b < NB; b++) a[u][b] = _mm256_setzero_ps();                   \
        const float *w = g->w + n * g->K;                                                 \
        int64_t k = 0;                                                                    \
        for (; k + 8 * U <= g->K; k += 8 * U) {                                           \
            for (int u = 0; u < U; u += 2)                                                \
                _mm_prefetch((const char *)(w + k + 8 * u) + PREFETCH, _MM_HINT_T1);       \
            for (int u = 0; u < U; u++) {                                                 \
                const __m256 wv = _mm256_loadu_ps(w + k + 8 * u);                         \
                for (int b = 0; b < NB; b++)                                              \
                    a[u][b] = _mm256_fmadd_ps(                                            \
                        wv, _mm256_loadu_ps(x + b * (XS) + (k + 8 * u) * (XK)), a[u][b]); \
            }                                                                             \
        }                                                                                 \
        for (; k < g->K; k += 8) { /* K a multiple of 8 here */                           \
            const __m256 wv = _mm256_loadu_ps(w + k);                                     \
            for (int b = 0; b < NB; b++)                                                  \
                a[0][b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * (XS) + k * (XK)),    \
                                          a[0][b]);                                       \
        }                                                                                 \
        for (int b = 0; b < NB; b++) {                                                    \
            __m256 s = a[0][b];                                                           \
            for (int u = 1; u < U; u++) s = _mm256_add_ps(s, a[u][b]);                    \
            const float r = kvb_hsum256(s);                                               \
            g->y[b * g->N + n] = g->acc ? g->y[b * g->N + n] + r : r;                     \
        }                                                                                 \
    }
#define ROWS2(NB, U) ROW(row##NB, NB, U, g->ldx, 1) ROW(rowi##NB, NB, U, 8, NB)
ROW(row1, 1, 4, g->ldx, 1) /* one row is its own interleaving */
ROWS2(2, 4)
ROWS2(3, 4)
ROWS2(4, 2)
ROWS2(5, 2)
ROWS2(6, 2)
ROWS2(7, 1)
ROWS2(8, 1)

typedef void (*row_fn)(const gemv_t *, const float *, int64_t);
static const row_fn ROWS[MAX_B + 1] = {0, row1, row2, row3, row4, row5, row6, row7, row8};
static const row_fn ROWSI[MAX_B + 1] = {0, 0, rowi2, rowi3, rowi4, rowi5, rowi6, rowi7, rowi8};

/* Rows of x larger than L1D (B x K floats, bytes; 48 KiB on the Zen 5 VM) are interleaved
 * first, each thread its copy: read as they are from L2, B rows apart, they held the W stream
 * back. Old against new in one process, five alternated rounds (2-core AMD EPYC Zen 5 VM,
 * 2026-11-28): Llama-2-7B's matrices (K 4096 and 11008) at B = 8 1.37-1.83x (17-24 -> 31-33
 * GB/s), at B = 4 1.04-1.07x, B = 2 unchanged; SmolLM2's down projection at B = 8 (K 1536,
 * 48 KiB: not interleaved now) 0.81x interleaved, its other matrices' rows stay in L1. */
#define XI_BYTES 49152

/* x's B rows (ldx apart) into xi, interleaved: xi[(k / 8) * B * 8 + b * 8 + k % 8] = x[b, k]. */
static void interleave(const float *x, int64_t B, int64_t K, int64_t ldx, float *xi) {
    for (int64_t k = 0; k < K; k += 8)
        for (int64_t b = 0; b < B; b++)
            memcpy(xi + k * B + b * 8, x + b * ldx + k, sizeof(float) * 8);
}

static AVX2 void rows_avx2(const gemv_t *g, int64_t n0, int64_t n1) {
    const int64_t bytes = (int64_t)sizeof(float) * g->B * g->K;
    float *xi = bytes > XI_BYTES && g->B > 1 ? aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64)
                                              : NULL;
    const row_fn f = xi ? ROWSI[g->B] : ROWS[g->B];
    if (xi) interleave(g->x, g->B, g->K, g->ldx, xi);
    const float *x = xi ? xi : g->x;
    for (int64_t n = n0; n < n1; n++) f(g, x, n);
    free(xi);
}

/* One W row against one x row sixteen floats an instruction (K a multiple of 16): batch 1's
 * matmuls, the weights of the bundled model and its head streamed 46-47 -> 51-52 GB/s
 * against the read loop's 53-55 (2-core Zen 5 VM, same process). At batch 4 AVX-512 was no
 * faster and at batch 8 slower (28-34 against 35-46 GB/s: B rows' sixteen-lane
 * reductions), so more rows keep AVX2's. */
#define A512 __attribute__((target("avx512f,avx2,fma")))
#define U512 4
static A512 void rows_avx512(const gemv_t *g, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        __m512 a[U512];
        for (int u = 0; u < U512; u++) a[u] = _mm512_setzero_ps();
        const float *w = g->w + n * g->K, *x = g->x;
        int64_t k = 0;
        for (; k + 16 * U512 <= g->K; k += 16 * U512) {
            for (int u = 0; u < U512; u++)
                _mm_prefetch((const char *)(w + k + 16 * u) + PREFETCH, _MM_HINT_T1);
            for (int u = 0; u < U512; u++)
                a[u] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16 * u),
                                       _mm512_loadu_ps(x + k + 16 * u), a[u]);
        }
        for (; k < g->K; k += 16) {
            _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T1);
            a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a[0]);
        }
        const float r = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
        g->y[n] = g->acc ? g->y[n] + r : r;
    }
}

#endif

static int g_isa = -1; /* 2: AVX-512, 1: AVX2/FMA, 0: portable; -1: not chosen yet */

/* The instruction set kvb_gemv uses: want 0 forces the portable loop, 1 AVX2, 2 AVX-512,
 * each where the CPU has it (else the best it has below); -1 reports the current choice
 * (the best the CPU has by default). */
int kvb_gemv_isa(int want) {
    if (want >= 0 || g_isa < 0) g_isa = kvb_isa_choice(want);
    return g_isa;
}

void kvb_gemv_share(int64_t N, int64_t t, int64_t T, int64_t *n0, int64_t *n1) {
    const int64_t blocks = (N + SPLIT - 1) / SPLIT; /* whole multiples of SPLIT rows */
    const int64_t e = blocks * (t + 1) / T * SPLIT;
    *n0 = blocks * t / T * SPLIT;
    *n1 = e < N ? e : N;
}

void kvb_gemv_range(const gemv_t *g, int64_t n0, int64_t n1) {
#ifdef KVB_X86
    if (kvb_gemv_isa(-1) == 2 && g->B == 1 && g->K % 16 == 0) {
        rows_avx512(g, n0, n1);
        return;
    }
    if (kvb_gemv_isa(-1) && g->K % 8 == 0) {
        rows_avx2(g, n0, n1);
        return;
    }
#endif
    rows_gen(g, n0, n1);
}

/* y [B, N] (contiguous) = x [B, K] (rows ldx floats apart) . w [N, K]^T (row-major), on
 * `threads` OpenMP threads (torch's own pool, as attn.c explains). Returns 0, or -2 when B
 * is outside 1..MAX_B. With AVX2 a K that is not a multiple of 8 takes the portable loop. */
int kvb_gemv(const float *w, const float *x, float *y, int64_t N, int64_t K, int64_t B,
             int64_t ldx, int threads) {
    if (B < 1 || B > MAX_B) return -2;
    const gemv_t g = {w, x, y, N, K, B, ldx, 0};
    int nt = kvb_team(threads);
    if ((int64_t)nt * SPLIT * 4 > N) nt = 1; /* too few rows to split */
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int64_t t = 0, T = 1;
#endif
        int64_t n0, n1;
        kvb_gemv_share(N, t, T, &n0, &n1);
        kvb_gemv_range(&g, n0, n1);
    }
    return 0;
}
