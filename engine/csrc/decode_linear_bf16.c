/* bf16 linear layers for decode batches on AVX512-BF16 cores: y[m][n] = bf16(bias[n] +
 * sum_k x[m][k] w[n][k]), the sum in fp32.
 *
 * A decode step multiplies a few rows (its batch) by every weight of the model, so its linears
 * should read the weights at memory speed. The weight is laid out in panels of 16 outputs,
 * `[n / 16][k / 2][16][2]` (`cpu_packing.bf16_decode_panels`): for each pair of inputs, the 16
 * outputs' two weights side by side, one 64-byte line, which is what `vdpbf16ps` multiplies against
 * a broadcast pair of inputs. A tile of up to 8 rows x 1-3 panels lives in registers while its
 * panels stream through it; the batch's next rows find the panels in cache, so the weight leaves
 * memory once per step.
 *
 * How many panels a tile spans goes by the batch (measured on an AMD EPYC AVX512-BF16 core,
 * docs/benchmarks-archive.md): up to `NARROW_MAX_ROWS` rows the step is memory-bound and one panel
 * at a time streams fastest; from there on each broadcast input feeds three panels (24
 * accumulators), which keeps `vdpbf16ps` busy where one panel's tile waited on its broadcasts.
 *
 * Every output element is one chain of `vdpbf16ps` in k order, whatever the batch and the tile it
 * falls in: a row's result does not depend on the rows beside it (batch-invariant).
 *
 * Tiles are split over `num_threads` OpenMP threads (torch's runtime, as in paged_attention.c).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE_N 16 /* outputs per panel */
#define TILE_M 8  /* rows per tile */
#define WIDE 3    /* panels per tile from NARROW_MAX_ROWS + 1 rows on */
#define NARROW_MAX_ROWS 4

static inline __m512 bf16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* One tile: `rows` (1..8) x `width` panels (1..3), over all of k; both are constants where it is
 * inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const int rows, const int width,
                                                       const uint16_t *x, int64_t ldx,
                                                       const uint16_t *panel, int64_t k,
                                                       const uint16_t *bias, uint16_t *y,
                                                       int64_t ldy) {
    __m512 acc[TILE_M][WIDE];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < width; q++) acc[r][q] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        __m512bh w[WIDE];
        for (int q = 0; q < width; q++)
            w[q] = (__m512bh)_mm512_loadu_si512(panel + q * k * TILE_N + p * 2 * TILE_N);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
            const __m512bh inputs = (__m512bh)_mm512_set1_epi32(pair);
            for (int q = 0; q < width; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], inputs, w[q]);
        }
    }
    for (int q = 0; q < width; q++) {
        const __m512 b =
            bias ? bf16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + q * TILE_N)))
                 : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][q], b));
            _mm256_storeu_si256((__m256i *)(y + r * ldy + q * TILE_N), (__m256i)out);
        }
    }
}

#define TILE(rows) tile(rows, width, x + row * ldx, ldx, panel, k, bias, y + row * ldy, ldy)

/* Every row of the batch against `width` panels: tiles of 8 rows, then the rest. */
static inline __attribute__((always_inline)) void columns(const int width, const uint16_t *x,
                                                          int64_t ldx, const uint16_t *panel,
                                                          int64_t m, int64_t k,
                                                          const uint16_t *bias, uint16_t *y,
                                                          int64_t ldy) {
    int64_t row = 0;
    for (; row + TILE_M <= m; row += TILE_M) TILE(8);
    switch (m - row) {
    case 7: TILE(7); break;
    case 6: TILE(6); break;
    case 5: TILE(5); break;
    case 4: TILE(4); break;
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    case 1: TILE(1); break;
    }
}

/* x [m, k] bf16 (row stride ldx); panels [n / 16, k / 2, 16, 2]; bias [n] or NULL; y [m, n]
 * (row stride ldy). Returns 0, or -1 where n is not a multiple of 16 or k is odd. */
int decode_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias,
                       uint16_t *y, int64_t m, int64_t k, int64_t n, int64_t ldx, int64_t ldy,
                       int64_t num_threads) {
    if (n % TILE_N != 0 || k % 2 != 0 || m < 0 || k < 0) return -1;
    const int64_t count = n / TILE_N;
    const int64_t step = m > NARROW_MAX_ROWS ? WIDE : 1; /* panels per tile */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t first = 0; first < count; first += step) {
        const uint16_t *panel = panels + first * k * TILE_N;
        const uint16_t *bias_t = bias ? bias + first * TILE_N : 0;
        uint16_t *y_t = y + first * TILE_N;
        switch (count - first < step ? count - first : step) {
        case 3: columns(3, x, ldx, panel, m, k, bias_t, y_t, ldy); break;
        case 2: columns(2, x, ldx, panel, m, k, bias_t, y_t, ldy); break;
        case 1: columns(1, x, ldx, panel, m, k, bias_t, y_t, ldy); break;
        }
    }
    return 0;
}
