/* fp32 linear layers for decode batches on AVX2 cores: y[m][n] = bias[n] + sum_k x[m][k] w[k][n].
 *
 * A decode step multiplies a few rows (its batch) by every weight of the model, so its linears read
 * the weights once and do little arithmetic on each: they should run at memory speed. On an AVX2
 * EPYC core MKL's fp32 kernels for 2-16 rows ran at a third to half of it, oneDNN's at two thirds
 * (docs/benchmarks-archive.md). Here the weight is laid out in panels of 16 outputs,
 * `[n / 16][k][16]` (`cpu_packing.decode_panels`), so that a panel is one sequential stream. A tile
 * of up to 6 rows x 16 outputs lives in twelve registers while a span of the panel streams through
 * it, each k one 64-byte line of the weight and six broadcast inputs; the batch's other tiles take
 * the same span while it is in L1, so the weight leaves memory once per step, and the first tile
 * prefetches the lines ahead so that memory keeps streaming while the others compute. On the AVX2
 * EPYC a model's linears at 8 / 12 rows took 44 / 47 ms this way against 63-68 / 67-74 walking each
 * tile over the whole panel (1 row: 36-38 ms either way; docs/benchmarks-archive.md).
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
/* A panel is walked in spans of this many k (4 KiB of weight; 128 and 256 were slower at 8-16 rows),
 * and a tile of several rows prefetches the line this many k ahead (one row alone streams as fast
 * on the hardware prefetcher, and was slower with it). */
#define K_SPAN 64
#define PREFETCH_K 64
#define MAX_ROWS 64 /* cpu_packing gives it at most DECODE_KERNEL_MAX_ROWS - 1 */

/* One tile: `rows` (1..6, a constant where it is inlined) x 16 outputs, over k0..k1 of the panel.
 * The sums start from the bias at k0 == 0, else from `part` (the tile's sums so far, [rows][16]),
 * and go to y once k1 == k, else back to `part`. */
static inline __attribute__((always_inline)) void tile(const int rows, const float *x, int64_t ldx,
                                                       const float *panel, int64_t k0, int64_t k1,
                                                       int64_t k, const float *bias, float *part,
                                                       float *y, int64_t ldy) {
    __m256 acc[TILE_M][2];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
        acc[r][0] = k0 == 0 ? b0 : _mm256_loadu_ps(part + r * TILE_N);
        acc[r][1] = k0 == 0 ? b1 : _mm256_loadu_ps(part + r * TILE_N + 8);
    }
    for (int64_t i = k0; i < k1; i++) {
        if (rows > 1) _mm_prefetch((const char *)(panel + (i + PREFETCH_K) * TILE_N), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(panel + i * TILE_N);
        const __m256 w1 = _mm256_loadu_ps(panel + i * TILE_N + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 v = _mm256_broadcast_ss(x + r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(v, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(v, w1, acc[r][1]);
        }
    }
    float *out = k1 == k ? y : part;
    const int64_t ld = k1 == k ? ldy : TILE_N;
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + r * ld, acc[r][0]);
        _mm256_storeu_ps(out + r * ld + 8, acc[r][1]);
    }
}

#define TILE(rows)                                                                               \
    tile(rows, x + row * ldx, ldx, panel, k0, k1, k, bias_t, part + row * TILE_N,             \
         y + row * ldy + col, ldy)

/* x [m, k] (row stride ldx); panels [n / 16, k, 16]; bias [n] or NULL; y [m, n] (row stride ldy).
 * Tiles of 6 rows and one of the rest (8 rows as 6 + 2 ran faster than 4 + 4). Returns 0, or -1
 * where n is not a multiple of 16 or m is over MAX_ROWS. */
int decode_linear_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m,
                      int64_t k, int64_t n, int64_t ldx, int64_t ldy, int64_t num_threads) {
    if (n % TILE_N != 0 || m < 0 || m > MAX_ROWS || k < 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < n / TILE_N; t++) {
        float part[MAX_ROWS * TILE_N]; /* each tile's sums between spans */
        const int64_t col = t * TILE_N;
        const float *panel = panels + t * k * TILE_N;
        const float *bias_t = bias ? bias + col : 0;
        int64_t k0 = 0;
        do {  /* once at least: k == 0 gives the bias */
            const int64_t k1 = k0 + K_SPAN < k ? k0 + K_SPAN : k;
            for (int64_t row = 0; row < m;) {
                const int rows = (int)(m - row < TILE_M ? m - row : TILE_M);
                switch (rows) {
                case 6: TILE(6); break;
                case 5: TILE(5); break;
                case 4: TILE(4); break;
                case 3: TILE(3); break;
                case 2: TILE(2); break;
                case 1: TILE(1); break;
                }
                row += rows;
            }
            k0 = k1;
        } while (k0 < k);
    }
    return 0;
}
