/* Decode's RMSNorm on the CPU: y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) for a few rows.
 *
 * torch 2.13's CPU `rms_norm` on float32 dispatches about eight ops per call (pow, mean,
 * sum, div_, fill_, two copies, mul): 50-60 us a call inside a decode step of the bundled
 * model at batch 1, two per layer and one for the head (about 3.5 ms of a 34 ms step,
 * torch.profiler, 2-core AMD EPYC VM). This loop does the same arithmetic in one call, in
 * float32 like the reference (sum8.h: eight partial sums of squares, pairwise), on the
 * calling thread: a decode row is a few KiB. Rows are contiguous, `dim` floats apart.
 */
#pragma GCC optimize("O3")
#include <math.h>
#include <stdint.h>

#include "decode.h"
#include "sum8.h"

void kvb_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim,
                 float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        const float inv = 1.0f / sqrtf(kvb_dot(xr, xr, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}
