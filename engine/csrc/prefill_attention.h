/* What the two causal bf16 prefill attention kernels share (prefill_attention_amx.c with AMX tiles,
 * prefill_attention_avx512.c with AVX512-BF16 dot products): head_dim 64, 16 query rows x 32 keys a
 * block, K and V packed once per call into 1 KiB tiles of pairs of bf16 (the layout AMX's B operand
 * wants, and one 512-bit register a row for vdpbf16ps), the online softmax, the driver over OpenMP
 * threads.
 *   K tile (key tile t of 16 keys, dim half c): [r 0..15][key 0..15][e 0..1] = K[16t + key][32c + 2r + e]
 *   V tile (key block h of 32 keys, dim tile d): [r 0..15][dim 0..15][e 0..1] = V[32h + 2r + e][16d + dim]
 * A key block b's four K tiles start at packed + b * 4 * TILE_ELEMS (t = 2b, c = 0; 2b, 1; 2b + 1, 0;
 * 2b + 1, 1), its four V tiles (d = 0..3) likewise.
 *
 * Layouts: q [n, num_heads, 64], k/v [num_cached + n, num_kv_heads, 64], bf16 (as uint16), rows
 * `*_stride` elements apart, heads 64 apart; out [n, num_heads, 64] bf16, contiguous. Query head h reads
 * kv head h / (num_heads / num_kv_heads). Work items (one query head x 16 query rows) run over
 * `num_threads` OpenMP threads (torch's runtime, as in paged_attention.c), the longest first.
 */
#ifndef PDSERVE_PREFILL_ATTENTION_H
#define PDSERVE_PREFILL_ATTENTION_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HEAD_DIM 64
#define Q_ROWS 16
#define KEY_BLOCK 32
#define TILE_BYTES 1024
#define TILE_ELEMS (TILE_BYTES / 2)

/* 2^x for finite x <= RESCALE_LOG2: 2^round(x) by vscalefps (0 below 2^-149) times 2^rest by its
 * degree-4 Taylor polynomial, ~5e-5 relative: a tenth of bf16's rounding of P. Lanes of masked keys
 * may come out NaN (their scores are not looked at); the caller zeroes them. */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static void pack_kv(const uint16_t *k, const uint16_t *v, int64_t kv_stride_k, int64_t kv_stride_v,
                    int64_t num_keys, int64_t num_blocks, int64_t head, int64_t num_kv_heads,
                    uint16_t *k_packed, uint16_t *v_packed) {
    (void)num_kv_heads;
    const int64_t padded = num_blocks * KEY_BLOCK;
    for (int64_t t = 0; t < padded / 16; t++)          /* key tiles */
        for (int c = 0; c < 2; c++) {                   /* dim halves */
            uint16_t *tile = k_packed + (t * 2 + c) * TILE_ELEMS;
            for (int key = 0; key < 16; key++) {
                const int64_t token = 16 * t + key;
                const uint16_t *row = k + token * kv_stride_k + head * HEAD_DIM + 32 * c;
                for (int r = 0; r < 16; r++)
                    for (int e = 0; e < 2; e++)
                        tile[(r * 16 + key) * 2 + e] = token < num_keys ? row[2 * r + e] : 0;
            }
        }
    for (int64_t h = 0; h < padded / 32; h++)           /* key halves */
        for (int d = 0; d < 4; d++) {                   /* dim tiles */
            uint16_t *tile = v_packed + (h * 4 + d) * TILE_ELEMS;
            for (int r = 0; r < 16; r++)
                for (int e = 0; e < 2; e++) {
                    const int64_t token = 32 * h + 2 * r + e;
                    const uint16_t *row = v + token * kv_stride_v + head * HEAD_DIM + 16 * d;
                    for (int dim = 0; dim < 16; dim++)
                        tile[(r * 16 + dim) * 2 + e] = token < num_keys ? row[dim] : 0;
                }
        }
}

#define RESCALE_LOG2 8.f

/* The online softmax of one block's scores `s` [16 x KEY_BLOCK] (fp32, unscaled) into P (bf16), the
 * rows' running maxima (log2 units), their sums of P (16 partial sums a row) and alpha (each row's
 * factor for O, 1 where its maximum did not move). With `masked`, row r sees the block's first
 * `first_row_visible + min(r, rows - 1)` keys. Returns whether any alpha is not 1. */
static inline __attribute__((always_inline)) int softmax_rows(
    const float *s, uint16_t *p, float *row_max, float *sums, float *alpha, float scale_log2,
    int masked, int64_t first_row_visible, int64_t rows) {
    const __m512 scale = _mm512_set1_ps(scale_log2);
    int rescale = 0;
    for (int r = 0; r < Q_ROWS; r++) {
        __mmask16 keep[2] = {0xffff, 0xffff};
        if (masked) {
            const int64_t visible = first_row_visible + (r < rows ? r : rows - 1);
            for (int j = 0; j < 2; j++) {
                const int64_t left = visible - 16 * j;
                keep[j] = left >= 16 ? (__mmask16)0xffff
                          : left <= 0 ? (__mmask16)0
                                      : (__mmask16)((1u << left) - 1);
            }
        }
        const __m512 s0 = _mm512_load_ps(s + r * KEY_BLOCK), s1 = _mm512_load_ps(s + r * KEY_BLOCK + 16);
        /* s * scale > max + RESCALE_LOG2, without the multiply (scale > 0) */
        const __m512 bound = _mm512_set1_ps((row_max[r] + RESCALE_LOG2) / scale_log2);
        alpha[r] = 1.f;
        if (_mm512_mask_cmp_ps_mask(keep[0], s0, bound, _CMP_GT_OQ) |
            _mm512_mask_cmp_ps_mask(keep[1], s1, bound, _CMP_GT_OQ)) {
            const __m512 top = _mm512_max_ps(
                _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep[0], s0),
                _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep[1], s1));
            const float new_max = _mm512_reduce_max_ps(top) * scale_log2;
            alpha[r] = exp2f(row_max[r] - new_max);
            row_max[r] = new_max;
            _mm512_store_ps(sums + 16 * r,
                            _mm512_mul_ps(_mm512_load_ps(sums + 16 * r), _mm512_set1_ps(alpha[r])));
            rescale = 1;
        }
        const __m512 m = _mm512_set1_ps(row_max[r]);
        __m512 e0 = exp2_ps(_mm512_fmsub_ps(s0, scale, m));
        __m512 e1 = exp2_ps(_mm512_fmsub_ps(s1, scale, m));
        if (masked) {
            e0 = _mm512_maskz_mov_ps(keep[0], e0);
            e1 = _mm512_maskz_mov_ps(keep[1], e1);
        }
        _mm512_store_ps(sums + 16 * r,
                        _mm512_add_ps(_mm512_load_ps(sums + 16 * r), _mm512_add_ps(e0, e1)));
        _mm512_store_si512(
            (__m512i *)(p + r * KEY_BLOCK),
            _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e0)),
                               (__m256i)_mm512_cvtneps_pbh(e1), 1));
    }
    return rescale;
}

/* One work item's state: its 16 query rows, `q_row_stride` elements apart (for the last item, with
 * fewer rows left, `q_tail`: a zero-padded copy, so no load reads past q), the block's scores and P,
 * O (fp32), and the online softmax's running maxima, partial sums and rescaling factors. */
typedef struct {
    _Alignas(64) uint16_t q_tail[Q_ROWS * HEAD_DIM];
    _Alignas(64) float s[Q_ROWS * KEY_BLOCK];
    _Alignas(64) uint16_t p[Q_ROWS * KEY_BLOCK];
    _Alignas(64) float o[Q_ROWS * HEAD_DIM];
    _Alignas(64) float sums[Q_ROWS * 16];
    _Alignas(64) float row_max[Q_ROWS];
    _Alignas(64) float alpha[Q_ROWS];
    const uint16_t *q_rows;
    int64_t q_row_stride, rows;
} work_item;

static inline void start_item(work_item *w, const uint16_t *q, int64_t q_stride, int64_t head,
                              int64_t q0, int64_t n) {
    w->rows = n - q0 < Q_ROWS ? n - q0 : Q_ROWS;
    w->q_rows = q + q0 * q_stride + head * HEAD_DIM;
    w->q_row_stride = q_stride;
    if (w->rows < Q_ROWS) {
        memset(w->q_tail, 0, sizeof w->q_tail);
        for (int64_t r = 0; r < w->rows; r++)
            memcpy(w->q_tail + r * HEAD_DIM, w->q_rows + r * q_stride, HEAD_DIM * 2);
        w->q_rows = w->q_tail;
        w->q_row_stride = HEAD_DIM;
    }
    for (int r = 0; r < Q_ROWS; r++) {
        w->row_max[r] = -INFINITY;
        _mm512_store_ps(w->sums + 16 * r, _mm512_setzero_ps());
    }
}

/* The online softmax of key block `b`'s scores (`w->s`) into `w->p`; whether any row's O must be
 * rescaled (by `w->alpha`). */
static inline int softmax_block(work_item *w, int64_t b, int64_t num_cached, int64_t q0,
                                float scale_log2) {
    /* the first row's last visible key: every row sees all of an earlier block */
    const int64_t first_row_visible = num_cached + q0 - b * KEY_BLOCK + 1;
    return first_row_visible >= KEY_BLOCK
               ? softmax_rows(w->s, w->p, w->row_max, w->sums, w->alpha, scale_log2, 0, 0, 0)
               : softmax_rows(w->s, w->p, w->row_max, w->sums, w->alpha, scale_log2, 1,
                              first_row_visible, w->rows);
}

/* The item's real rows of O (fp32 in `w->o`, 64 a row) divided by their sums of P, into `out` as
 * bf16. */
static inline void store_rows(const work_item *w, int64_t q0, int64_t head, int64_t num_heads,
                              uint16_t *out) {
    for (int64_t r = 0; r < w->rows; r++) {
        const __m512 inv =
            _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(w->sums + 16 * r)));
        uint16_t *dst = out + ((q0 + r) * num_heads + head) * HEAD_DIM;
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                    _mm512_load_ps(w->o + r * HEAD_DIM + 16 * j), inv)));
    }
}

/* One work item: query head `head`'s rows [q0, q0 + 16) over its kv head's packed keys and values. */
typedef void (*attend_fn)(const uint16_t *q, int64_t q_stride, int64_t head, int64_t q0, int64_t n,
                          int64_t num_cached, const uint16_t *k_packed, const uint16_t *v_packed,
                          float scale_log2, uint16_t *out, int64_t num_heads);

/* Packs K and V, then runs every work item. `begin`/`end` (or NULL) run once on each thread around
 * its items. Returns 0, or -1 (bad shape) / -2 (out of memory). */
static inline __attribute__((always_inline)) int run_prefill_attention(
    const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t q_stride,
    int64_t k_stride, int64_t v_stride, int64_t n, int64_t num_cached, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, float scale, int64_t num_threads, attend_fn attend,
    void (*begin)(void), void (*end)(void)) {
    if (head_dim != HEAD_DIM || n <= 0 || num_cached < 0 || num_kv_heads <= 0 ||
        num_heads % num_kv_heads)
        return -1;
    const int64_t num_keys = num_cached + n;
    const int64_t num_blocks = (num_keys + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t head_elems = num_blocks * KEY_BLOCK * HEAD_DIM;  /* packed K (or V) of one kv head */
    uint16_t *packed = aligned_alloc(64, (size_t)(2 * num_kv_heads * head_elems * 2));
    if (!packed) return -2;
    uint16_t *k_packed = packed, *v_packed = packed + num_kv_heads * head_elems;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t q_blocks = (n + Q_ROWS - 1) / Q_ROWS;
    const float scale_log2 = scale * 1.4426950408889634f;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < num_kv_heads; h++)
            pack_kv(k, v, k_stride, v_stride, num_keys, num_blocks, h, num_kv_heads,
                    k_packed + h * head_elems, v_packed + h * head_elems);
        if (begin) begin();
        /* the last query blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < q_blocks * num_heads; item++) {
            const int64_t qb = q_blocks - 1 - item / num_heads, head = item % num_heads;
            const int64_t kv = head / group;
            attend(q, q_stride, head, qb * Q_ROWS, n, num_cached, k_packed + kv * head_elems,
                   v_packed + kv * head_elems, scale_log2, out, num_heads);
        }
        if (end) end();
    }
    free(packed);
    return 0;
}

#endif
