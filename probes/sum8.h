/* The portable float reductions of the native kernels (gemv.c, norm.c, pages.c, maw.c,
 * attn_loops.c): eight partial sums, which GCC keeps in one vector register where a single
 * running sum would be a chain of dependent adds, combined pairwise in a fixed order. */
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
#endif
