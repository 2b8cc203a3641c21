/* Shared by the CPU attention kernel (attn.c) and its inner loops (attn_loops.c). */
#ifndef KVB_ATTN_H
#define KVB_ATTN_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLK 32 /* keys per block: a block's K or V rows (8 KiB at 256 bytes a row) fit L1 */

/* Rows to prefetch while a loop walks its own: row j (< n) of `row`, `bytes` long, is
 * fetched as the loop reaches its j-th key, spreading the fetches over the loop. */
typedef struct {
    const void *const *row;
    int64_t n, bytes;
} pf_t;

/* Row j of pf, every 64-byte line of it, into L1 (attn.c says when a call prefetches and
 * why L1). */
static inline void kvb_fetch_row(const pf_t *pf, int64_t j) {
    if (pf && j < pf->n)
        for (int64_t c = 0; c < pf->bytes; c += 64)
            __builtin_prefetch((const char *)pf->row[j] + c, 0, 3); /* prefetcht0 on x86 */
}

/* The vectorisable inner loops, one set per instruction set and dtype. s/p rows hold BLK
 * floats; kp/vp point at K/V rows in the call's dtype; q and acc rows are float32, in the
 * order `perm` says (1: each 16 floats in the bfloat16 unpack order, see swap23). */
typedef struct {
    void (*scores)(float *s, const float *q, int64_t nr, int64_t D, const void *const *kp,
                   int64_t nb, const pf_t *pf);                 /* s[t*BLK+j] = q_t . k_j */
    float (*rowmax)(const float *s, int64_t n);
    float (*expsum)(float *s, int64_t n, float m);              /* s = exp(s - m); sum */
    /* acc_t = acc_t*corr_t + p_t.V (t < nr; skipped where corr_t is NaN) */
    void (*pv)(float *acc, const float *corr, const float *p, const void *const *vp,
               int64_t nr, int64_t nb, int64_t D, const pf_t *pf);
    int perm;
} isa_t;

/* One attention call (kvb_attn's arguments, its work split and shared task counter): set up
 * by kvb_attn_plan on one thread, worked on by every thread of a parallel region
 * (kvb_attn_work), released by kvb_attn_end. */
typedef struct {
    int dtype;
    const void *q, *k, *v;
    void *out;
    float *lse;
    int64_t B, Hq, Hkv, Lq, Lk, D;
    const int64_t *ks, *vs;
    const int32_t *idx, *lens;
    const uint8_t *keep; /* sparse, optional: [B * Hq, nmax], 0: a query head skips a key */
    int64_t nmax, Hs; /* Hs: selection rows per sequence (Hkv, or up to Hq when sparse) */
    float scale;
    int causal;
    int64_t q_start, group, ntasks;
    int64_t split, chunk; /* chunks per row (1: none) and keys per chunk */
    int prefetch;         /* dense rows fetched to L2 ahead of use (see the top) */
    float *part;          /* split > 1: per (row, chunk, query) [m, l, acc[D]] */
    const isa_t *isa;     /* the inner loops (attn_loops.c) */
    int64_t next;         /* shared task counter */
    int failed;
    int64_t ldi, ldk;     /* row strides of idx and keep (a view of wider buffers: no copy) */
} kvb_attn_job_t;

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

/* The inner loops for dtype (0 float32, 1 bfloat16) and head dim D under instruction set
 * `isa` (0 portable, 1 AVX2/FMA, 2 AVX-512): AVX-512 for float32 with D a multiple of 16,
 * AVX2/FMA (isa >= 1) when D suits them (a multiple of 8, of 16 for bfloat16), else the
 * portable ones. */
__attribute__((visibility("hidden"))) const isa_t *kvb_attn_loops(int dtype, int64_t D, int isa);
/* The inner loops in use (attn.c): want -1 reports them, 0 forces portable, 1 AVX2/FMA, 2
 * AVX-512 (each where the CPU has it, else the best below it). */
int kvb_attn_isa(int want);
/* attn_loops.c's AVX2 row max and exp-sum, which the AVX-512 loops share. */
__attribute__((visibility("hidden"))) float kvb_rowmax_avx2(const float *s, int64_t n);
__attribute__((visibility("hidden"))) float kvb_expsum_avx2(float *s, int64_t n, float m);
/* attn_avx512.c's float32 loops. */
__attribute__((visibility("hidden"))) const isa_t *kvb_attn_loops_avx512(void);
/* One call in three parts (attn.c; kvb_attn is plan, a region of work, end): a caller that
 * is already inside a parallel region plans on one thread and works on all of them. */
__attribute__((visibility("hidden"))) int kvb_attn_plan(
    kvb_attn_job_t *j, int dtype, const void *q, const void *k, const void *v, void *out,
    float *lse, int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D,
    const int64_t *kstrides, const int64_t *vstrides, const int32_t *idx, const int32_t *lens,
    const uint8_t *keep, int64_t nmax, int64_t ldi, int64_t ldk, int64_t Hs, float scale,
    int causal, int64_t q_start, int64_t group, int threads);
__attribute__((visibility("hidden"))) void kvb_attn_work(kvb_attn_job_t *j);
__attribute__((visibility("hidden"))) int kvb_attn_end(kvb_attn_job_t *j);
#endif
