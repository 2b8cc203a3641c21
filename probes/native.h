/* What native.c gives the other files: its clock and the CPU's instruction set. */
#ifndef KVB_NATIVE_H
#define KVB_NATIVE_H
#include <stdint.h>

/* CLOCK_MONOTONIC nanoseconds. */
uint64_t kvb_now_ns(void);
/* The best set of the loops' instruction sets this CPU has: 2 AVX-512F (with AVX2/FMA),
 * 1 AVX2/FMA, 0 neither (or not x86). */
__attribute__((visibility("hidden"))) int kvb_cpu_isa(void);

/* The OpenMP team of a call asked for `threads`: 1 to 256. */
static inline int kvb_team(int threads) {
    return threads < 1 ? 1 : threads > 256 ? 256 : threads;
}

/* The set a caller asking for `want` (-1: the best) gets: the best this CPU has at or below
 * it (attn.c's and gemv.c's choices). */
static inline int kvb_isa_choice(int want) {
    const int best = kvb_cpu_isa();
    return want < 0 || want > best ? best : want;
}
#endif
