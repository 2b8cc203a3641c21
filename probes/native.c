/* kvbench native probes: the timed loops that a Python loop would distort.
 *
 * Built by setup.py into kvbench/_native and loaded with ctypes (kvbench/native.py).
 * Every timed function returns elapsed nanoseconds measured with CLOCK_MONOTONIC
 * around the whole loop, so the caller divides by the iteration count itself.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "native.h"

int kvb_abi_version(void) { return 19; }

/* The calling thread's OpenMP team size for regions without a num_threads clause (torch's
 * CPU ops): n >= 1 sets it, and libgomp keeps it per thread, so a helper thread can take 1
 * without touching the caller's; returns the size now in effect (1 without OpenMP). */
int kvb_omp_threads(int n) {
#ifdef _OPENMP
    extern void omp_set_num_threads(int);
    extern int omp_get_max_threads(void);
    if (n >= 1) omp_set_num_threads(n);
    return omp_get_max_threads();
#else
    (void)n;
    return 1;
#endif
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t kvb_now_ns(void) { return now_ns(); }

int kvb_cpu_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
#else
    return 0;
#endif
}

/* Plain single-threaded memcpy loop: the reference every host copy is judged against. */
uint64_t kvb_memcpy_loop(void *dst, const void *src, size_t n, size_t iters) {
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < iters; i++) {
        memcpy(dst, src, n);
        __asm__ volatile("" : : "r"(dst) : "memory");
    }
    return now_ns() - t0;
}
