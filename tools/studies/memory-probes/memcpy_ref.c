/* Independent reference for the host-to-host copy bar (issue 11 item 3): N pthreads each
 * memcpy their share of a SIZE-byte buffer into a second buffer, 10 copies per sample, 7
 * samples; prints the median GB/s (decimal; bytes copied / seconds). Shares no code with
 * kvbench. Build: cc -O2 -pthread memcpy_ref.c -o memcpy_ref; run: ./memcpy_ref THREADS [SIZE]
 * ./memcpy_ref THREADS SIZE serve: after the warm-up, one sample per line read on stdin,
 * its GB/s printed at once (lockstep.py interleaves it with the probe sample by sample). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { char *dst, *src; size_t n; } part_t;

static void *copy10(void *p) {
    part_t *a = p;
    for (int i = 0; i < 10; i++) memcpy(a->dst, a->src, a->n);
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int nt = argc > 1 ? atoi(argv[1]) : 1;
    size_t size = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
    if (nt < 1 || nt > 256) return 2;
    char *src = malloc(size), *dst = malloc(size);
    if (!src || !dst) return 1;
    memset(src, 1, size);
    memset(dst, 2, size);
    pthread_t tid[256];
    part_t part[256];
    double gbps[7];
    int serve = argc > 3 && strcmp(argv[3], "serve") == 0;
    char line[64];
    for (int s = -1; serve || s < 7; s++) { /* sample -1: warm-up */
        if (serve && s >= 0 && !fgets(line, sizeof line, stdin)) return 0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int k = 0; k < nt; k++) {
            size_t lo = size / nt * k, hi = k == nt - 1 ? size : size / nt * (k + 1);
            part[k] = (part_t){dst + lo, src + lo, hi - lo};
            pthread_create(&tid[k], NULL, copy10, &part[k]);
        }
        for (int k = 0; k < nt; k++) pthread_join(tid[k], NULL);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double sec = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
        double rate = 10.0 * size / sec / 1e9;
        if (serve && s >= 0) {
            printf("%.4f\n", rate);
            fflush(stdout);
        } else if (s >= 0) {
            gbps[s] = rate;
        }
    }
    qsort(gbps, 7, sizeof gbps[0], cmp);
    printf("%.3f\n", gbps[3]);
    return 0;
}
