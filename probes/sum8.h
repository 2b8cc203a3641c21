/* The portable float reductions of the native kernels (gemv.c, norm.c, pages.c, maw.c,
 * attn_loops.c): eight partial sums, which GCC keeps in one vector register where a single
 * running sum would be a chain of dependent adds, combined pairwise in a fixed order; and
 * on x86 the horizontal sum of an AVX2 register (gemv.c, pages.c). */
#ifndef KVB_SUM8_H
#define KVB_SUM8_H
#include <stdint.h>

/* a[0] + ... + a[7], pairwise. */
static inline float kvb_sum8(const float a[8]) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* x . y over n floats: eight partial sums over whole groups of 8, the tail apart. */
static inline float kvb_dot(const float *x, const float *y, int64_t n) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, r = 0.0f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++) a[u] += x[i + u] * y[i + u];
    for (; i < n; i++) r += x[i] * y[i];
    return r + kvb_sum8(a);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* v[0] + ... + v[7]. */
__attribute__((target("avx2,fma"))) static inline float kvb_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
