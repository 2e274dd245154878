/* fp32 linear layers for decode batches on AVX2 cores: y[m][n] = bias[n] + sum_k x[m][k] w[k][n].
 *
 * A decode step multiplies a few rows (its batch) by every weight of the model, so its linears read
 * the weights once and do little arithmetic on each: they should run at memory speed. On an AVX2
 * EPYC core MKL's fp32 kernels for 2-16 rows ran at a third to half of it, oneDNN's at two thirds
 * (docs/benchmarks.md). Here the weight is laid out in panels of 16 outputs, `[n / 16][k][16]`
 * (`cpu_packing.decode_panels`), so that a panel is one sequential stream. A tile of up to 6 rows x
 * 16 outputs lives in twelve registers while the whole panel streams through it, each k one 64-byte
 * line of the weight and six broadcast inputs; the batch's next rows find the panel in cache, so the
 * weight leaves memory once per step.
 *
 * Every output element is one chain of fused multiply-adds in k order, whatever the batch and the
 * tile it falls in: a row's result does not depend on the rows beside it (batch-invariant), and one
 * row alone gives exactly what it gives among 40.
 *
 * Panels are split over `num_threads` OpenMP threads (torch's runtime, as in paged_attention.c).
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE_N 16
#define TILE_M 6

/* One tile: `rows` (1..6, a constant where it is inlined) x 16 outputs, over all of k. */
static inline __attribute__((always_inline)) void tile(const int rows, const float *x, int64_t ldx,
                                                       const float *panel, int64_t k_size,
                                                       const float *bias, float *y, int64_t ldy) {
    __m256 acc[TILE_M][2];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
        acc[r][0] = b0;
        acc[r][1] = b1;
    }
    for (int64_t k = 0; k < k_size; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * TILE_N);
        const __m256 w1 = _mm256_loadu_ps(panel + k * TILE_N + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 v = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(v, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(v, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * ldy, acc[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    }
}

#define TILE(rows) tile(rows, x + row * ldx, ldx, panel, k, bias_t, y + row * ldy + col, ldy)

/* x [m, k] (row stride ldx); panels [n / 16, k, 16]; bias [n] or NULL; y [m, n] (row stride ldy).
 * Returns 0, or -1 where n is not a multiple of 16. */
int decode_linear_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m,
                      int64_t k, int64_t n, int64_t ldx, int64_t ldy, int64_t num_threads) {
    if (n % TILE_N != 0 || m < 0 || k < 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < n / TILE_N; t++) {
        const int64_t col = t * TILE_N;
        const float *panel = panels + t * k * TILE_N;
        const float *bias_t = bias ? bias + col : 0;
        int64_t row = 0;
        for (; row + TILE_M <= m; row += TILE_M) TILE(6);
        switch (m - row) {
        case 5: TILE(5); break;
        case 4: TILE(4); break;
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        }
    }
    return 0;
}
