/* Causal bf16 prefill attention with AVX512-BF16 dot products (vdpbf16ps), for CPUs without AMX
 * tiles (AMD Zen 4 and later, Intel Cooper Lake), head_dim 64.
 *
 * The same flash attention as prefill_attention_amx.c, with its packing, online softmax and driver
 * (prefill_attention.h): each work item is one query head x 16 query rows, walking the visible keys
 * 32 at a time, so no score matrix is ever materialised. A packed tile's row is one 512-bit register
 * of 16 pairs of bf16, which vdpbf16ps multiplies by a broadcast pair of the other operand:
 *   scores  S[16 x 32] = Q . K^T   4 query rows at a time: a pair of q's dims broadcast against a K
 *                                   tile row (that pair of dims of 16 keys), 32 pairs, 2 key tiles
 *   values  O[16 x 64] += P . V    4 query rows at a time: a pair of P's keys broadcast against a V
 *                                   tile row (those 2 keys' values of 16 dims), 16 pairs, 4 dim tiles
 * O stays in memory (fp32), each row rescaled only when its maximum moves. Scores and O accumulate in
 * fp32, P is rounded to bf16, as in the AMX kernel and SDPA's CPU flash kernel.
 *
 * Compiled with -mavx512f -mavx512bf16; it runs only where the CPU has them.
 */
#include "prefill_attention.h"

#define ROWS_AT_ONCE 4

static inline __m512bh pair_of(const uint16_t *at) {
    int32_t pair;
    memcpy(&pair, at, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static void attend_block(const uint16_t *q, int64_t q_stride, int64_t head, int64_t q0, int64_t n,
                         int64_t num_cached, const uint16_t *k_packed, const uint16_t *v_packed,
                         float scale_log2, uint16_t *out, int64_t num_heads) {
    work_item w;
    start_item(&w, q, q_stride, head, q0, n);
    memset(w.o, 0, sizeof w.o);
    /* row r (query q0 + r) sees keys <= num_cached + q0 + r; padding rows as many as the last real one */
    const int64_t last_key = num_cached + q0 + w.rows - 1;
    const int64_t num_blocks = last_key / KEY_BLOCK + 1;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint16_t *kb = k_packed + b * 4 * TILE_ELEMS;
        for (int r0 = 0; r0 < Q_ROWS; r0 += ROWS_AT_ONCE) {
            __m512 acc[ROWS_AT_ONCE][2];
            for (int i = 0; i < ROWS_AT_ONCE; i++)
                acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int c = 0; c < 2; c++) {  /* dim halves */
                const uint16_t *keys0 = kb + c * TILE_ELEMS, *keys1 = kb + (2 + c) * TILE_ELEMS;
                for (int r = 0; r < 16; r++) {  /* pairs of dims */
                    const __m512bh k0 = (__m512bh)_mm512_load_si512(keys0 + 32 * r);
                    const __m512bh k1 = (__m512bh)_mm512_load_si512(keys1 + 32 * r);
                    for (int i = 0; i < ROWS_AT_ONCE; i++) {
                        const __m512bh dims =
                            pair_of(w.q_rows + (r0 + i) * w.q_row_stride + 32 * c + 2 * r);
                        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], dims, k0);
                        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], dims, k1);
                    }
                }
            }
            for (int i = 0; i < ROWS_AT_ONCE; i++) {
                _mm512_store_ps(w.s + (r0 + i) * KEY_BLOCK, acc[i][0]);
                _mm512_store_ps(w.s + (r0 + i) * KEY_BLOCK + 16, acc[i][1]);
            }
        }

        softmax_block(&w, b, num_cached, q0, scale_log2);  /* w.alpha: 1 where no max moved */
        const uint16_t *vb = v_packed + b * 4 * TILE_ELEMS;
        for (int r0 = 0; r0 < Q_ROWS; r0 += ROWS_AT_ONCE) {
            __m512 acc[ROWS_AT_ONCE][4];
            for (int i = 0; i < ROWS_AT_ONCE; i++) {
                const __m512 a = _mm512_set1_ps(w.alpha[r0 + i]);
                for (int d = 0; d < 4; d++)
                    acc[i][d] =
                        _mm512_mul_ps(_mm512_load_ps(w.o + (r0 + i) * HEAD_DIM + 16 * d), a);
            }
            for (int r = 0; r < 16; r++) {  /* pairs of keys */
                __m512bh values[4];
                for (int d = 0; d < 4; d++)
                    values[d] = (__m512bh)_mm512_load_si512(vb + d * TILE_ELEMS + 32 * r);
                for (int i = 0; i < ROWS_AT_ONCE; i++) {
                    const __m512bh keys = pair_of(w.p + (r0 + i) * KEY_BLOCK + 2 * r);
                    for (int d = 0; d < 4; d++)
                        acc[i][d] = _mm512_dpbf16_ps(acc[i][d], keys, values[d]);
                }
            }
            for (int i = 0; i < ROWS_AT_ONCE; i++)
                for (int d = 0; d < 4; d++)
                    _mm512_store_ps(w.o + (r0 + i) * HEAD_DIM + 16 * d, acc[i][d]);
        }
    }
    store_rows(&w, q0, head, num_heads, out);
}

/* Returns 0, or -1 (bad shape) / -2 (out of memory). */
int avx512_prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                  uint16_t *out, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                  int64_t n, int64_t num_cached, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, float scale,
                                  int64_t num_threads) {
    return run_prefill_attention(q, k, v, out, q_stride, k_stride, v_stride, n, num_cached, num_heads,
                                 num_kv_heads, head_dim, scale, num_threads, attend_block, NULL,
                                 NULL);
}
