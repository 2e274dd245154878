/* bf16 linear layers for decode batches on AVX512-BF16 cores: y[m][n] = bf16(bias[n] +
 * sum_k x[m][k] w[n][k]), the sum in fp32.
 *
 * A decode step multiplies a few rows (its batch) by every weight of the model, so its linears
 * should read the weights at memory speed. The weight is laid out in panels of 16 outputs,
 * `[n / 16][k / 2][16][2]` (`cpu_packing.bf16_decode_panels`): for each pair of inputs, the 16
 * outputs' two weights side by side, one 64-byte line, which is what `vdpbf16ps` multiplies against
 * a broadcast pair of inputs. A tile of up to 8 rows x 16 outputs lives in registers while the
 * whole panel streams through it; the batch's next rows find the panel in cache, so the weight leaves
 * memory once per step.
 *
 * Every output element is one chain of `vdpbf16ps` in k order, whatever the batch and the tile it
 * falls in: a row's result does not depend on the rows beside it (batch-invariant).
 *
 * Panels are split over `num_threads` OpenMP threads (torch's runtime, as in paged_attention.c).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE_N 16
#define TILE_M 8

static inline __m512 bf16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* One tile: `rows` (1..8, a constant where it is inlined) x 16 outputs, over all of k. */
static inline __attribute__((always_inline)) void tile(const int rows, const uint16_t *x,
                                                       int64_t ldx, const uint16_t *panel,
                                                       int64_t pairs, const uint16_t *bias,
                                                       uint16_t *y, int64_t ldy) {
    __m512 acc[TILE_M];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + p * 2 * TILE_N);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    const __m512 b = bias ? bf16_to_f32(_mm256_loadu_si256((const __m256i *)bias))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r], b));
        _mm256_storeu_si256((__m256i *)(y + r * ldy), (__m256i)out);
    }
}

#define TILE(rows) tile(rows, x + row * ldx, ldx, panel, pairs, bias_t, y + row * ldy + col, ldy)

/* x [m, k] bf16 (row stride ldx); panels [n / 16, k / 2, 16, 2]; bias [n] or NULL; y [m, n]
 * (row stride ldy). Returns 0, or -1 where n is not a multiple of 16 or k is odd. */
int decode_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias,
                       uint16_t *y, int64_t m, int64_t k, int64_t n, int64_t ldx, int64_t ldy,
                       int64_t num_threads) {
    if (n % TILE_N != 0 || k % 2 != 0 || m < 0 || k < 0) return -1;
    const int64_t pairs = k / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < n / TILE_N; t++) {
        const int64_t col = t * TILE_N;
        const uint16_t *panel = panels + t * k * TILE_N;
        const uint16_t *bias_t = bias ? bias + col : 0;
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
    return 0;
}
