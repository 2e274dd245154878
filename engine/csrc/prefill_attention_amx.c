/* Causal bf16 prefill attention with AMX tiles (Intel Sapphire Rapids and later), head_dim 64.
 *
 * A prompt's `n` new tokens attend to `num_cached` context tokens (all visible) and, among themselves,
 * to those before them. Flash attention: each work item is one query head x 16 query rows, walking the
 * visible keys 32 at a time with an fp32 online softmax, so no score matrix is ever materialised.
 *   scores  S[16 x 32] = Q[16 x 64] . K^T   4 tile products: Q in 2 A tiles (32 dims each, loaded
 *                                            straight from q with its token stride), K in B tiles
 *   softmax in AVX-512 over S, exp2 by a degree-5 polynomial and vscalefps; P rounded to bf16
 *   values  O[16 x 64] += P[16 x 32] . V    4 tile products into O, which stays in 4 tiles throughout
 * B tiles want the VNNI layout (pairs of rows interleaved), so K and V are first packed once per call
 * into 1 KiB tiles, zero-padded to a whole 32-key block:
 *   K tile (key tile t of 16 keys, dim half c): [r 0..15][key 0..15][e 0..1] = K[16t + key][32c + 2r + e]
 *   V tile (key block h of 32 keys, dim tile d): [r 0..15][dim 0..15][e 0..1] = V[32h + 2r + e][16d + dim]
 * Tiles: tmm0-3 O, tmm4-5 S, tmm6 the A operand (Q, then P), tmm7 the B operand.
 * Where the time goes (1024 tokens, one thread, by removing each part): the tile products with their
 * loads and stores ~40 % (packing K and V 6 %), the softmax's bookkeeping ~33 %, its exponentials
 * ~27 %. A first version that kept O in memory, updated by AVX-512 every block, took 1.25x as long.
 *
 * Layouts: q [n, num_heads, 64], k/v [num_cached + n, num_kv_heads, 64], bf16 (as uint16), rows
 * `*_stride` elements apart, heads 64 apart; out [n, num_heads, 64] bf16, contiguous. Query head h reads
 * kv head h / (num_heads / num_kv_heads). Work items run over `num_threads` OpenMP threads (torch's
 * runtime, as in paged_attention.c), the longest first.
 *
 * The caller must have `amx_prefill_init` return 0 once per process (Linux grants AMX state only on
 * request); compiled with -mamx-tile -mamx-bf16 -mavx512bf16, it runs only where the CPU has them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define HEAD_DIM 64
#define Q_ROWS 16
#define KEY_BLOCK 32
#define TILE_BYTES 1024
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_prefill_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

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
            uint16_t *tile = k_packed + (t * 2 + c) * (TILE_BYTES / 2);
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
            uint16_t *tile = v_packed + (h * 4 + d) * (TILE_BYTES / 2);
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

/* One query head's rows [q0, q0 + 16) (those < n written) over keys [0, num_cached + last row], 32
 * keys (KEY_BLOCK) at a time. O stays in tiles 0-3 from the first key to the last: the running maximum a row's
 * exponentials are taken against moves only when a score exceeds it by more than 2^RESCALE_LOG2
 * (rare after the first block), and only then are the O rows rescaled, through memory; meanwhile the
 * exponentials stay below 2^RESCALE_LOG2, harmless in fp32 and bf16. Each row's sum of P stays a
 * vector of 16 partial sums until the end. */
static void attend_block(const uint16_t *q, int64_t q_stride, int64_t head, int64_t q0, int64_t n,
                         int64_t num_cached, const uint16_t *k_packed, const uint16_t *v_packed,
                         float scale_log2, uint16_t *out, int64_t num_heads) {
    _Alignas(64) uint16_t q_tail[Q_ROWS * HEAD_DIM];
    _Alignas(64) float s[Q_ROWS * KEY_BLOCK];
    _Alignas(64) uint16_t p[Q_ROWS * KEY_BLOCK];
    _Alignas(64) float o[Q_ROWS * HEAD_DIM];
    _Alignas(64) float sums[Q_ROWS * 16];
    _Alignas(64) float row_max[Q_ROWS], alpha[Q_ROWS];
    const int64_t rows = n - q0 < Q_ROWS ? n - q0 : Q_ROWS;

    const uint16_t *q_rows = q + q0 * q_stride + head * HEAD_DIM;
    int64_t q_row_bytes = q_stride * 2;
    if (rows < Q_ROWS) {  /* the last block: copy and zero-pad, so no tile row reads past q */
        memset(q_tail, 0, sizeof q_tail);
        for (int64_t r = 0; r < rows; r++)
            memcpy(q_tail + r * HEAD_DIM, q_rows + r * q_stride, HEAD_DIM * 2);
        q_rows = q_tail;
        q_row_bytes = HEAD_DIM * 2;
    }
    for (int r = 0; r < Q_ROWS; r++) {
        row_max[r] = -INFINITY;
        _mm512_store_ps(sums + 16 * r, _mm512_setzero_ps());
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    /* row r (query q0 + r) sees keys <= num_cached + q0 + r; padding rows as many as the last real one */
    const int64_t last_key = num_cached + q0 + rows - 1;
    const int64_t num_blocks = last_key / KEY_BLOCK + 1;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint16_t *kb = k_packed + b * 4 * (TILE_BYTES / 2);
        _tile_zero(4);
        _tile_zero(5);
        _tile_loadd(6, q_rows, q_row_bytes);
        _tile_loadd(7, kb, 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, kb + 2 * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(5, 6, 7);
        _tile_loadd(6, q_rows + 32, q_row_bytes);
        _tile_loadd(7, kb + 1 * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, kb + 3 * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(5, 6, 7);
        _tile_stored(4, s, KEY_BLOCK * 4);
        _tile_stored(5, s + 16, KEY_BLOCK * 4);

        const int64_t first_key = b * KEY_BLOCK;
        /* the first row's last visible key: every row sees all of an earlier block */
        const int64_t first_row_visible = num_cached + q0 - first_key + 1;
        const int rescale = first_row_visible >= KEY_BLOCK
                                ? softmax_rows(s, p, row_max, sums, alpha, scale_log2, 0, 0, 0)
                                : softmax_rows(s, p, row_max, sums, alpha, scale_log2, 1,
                                               first_row_visible, rows);
        if (rescale && b > 0) {  /* O's rows times alpha, through memory */
            _tile_stored(0, o, HEAD_DIM * 4);
            _tile_stored(1, o + 16, HEAD_DIM * 4);
            _tile_stored(2, o + 32, HEAD_DIM * 4);
            _tile_stored(3, o + 48, HEAD_DIM * 4);
            for (int r = 0; r < Q_ROWS; r++) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int j = 0; j < 4; j++)
                    _mm512_store_ps(o + r * HEAD_DIM + 16 * j,
                                    _mm512_mul_ps(_mm512_load_ps(o + r * HEAD_DIM + 16 * j), a));
            }
            _tile_loadd(0, o, HEAD_DIM * 4);
            _tile_loadd(1, o + 16, HEAD_DIM * 4);
            _tile_loadd(2, o + 32, HEAD_DIM * 4);
            _tile_loadd(3, o + 48, HEAD_DIM * 4);
        }
        const uint16_t *vb = v_packed + b * 4 * (TILE_BYTES / 2);
        _tile_loadd(6, p, 64);
        _tile_loadd(7, vb, 64);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, vb + 1 * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(7, vb + 2 * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(7, vb + 3 * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(3, 6, 7);
    }
    _tile_stored(0, o, HEAD_DIM * 4);
    _tile_stored(1, o + 16, HEAD_DIM * 4);
    _tile_stored(2, o + 32, HEAD_DIM * 4);
    _tile_stored(3, o + 48, HEAD_DIM * 4);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sums + 16 * r)));
        uint16_t *dst = out + ((q0 + r) * num_heads + head) * HEAD_DIM;
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_load_ps(o + r * HEAD_DIM + 16 * j), inv)));
    }
}

/* Returns 0, or -1 (bad shape) / -2 (out of memory). */
int amx_prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                               int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t n,
                               int64_t num_cached, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, float scale, int64_t num_threads) {
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
        configure_tiles();
        /* the last query blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < q_blocks * num_heads; item++) {
            const int64_t qb = q_blocks - 1 - item / num_heads, head = item % num_heads;
            const int64_t kv = head / group;
            attend_block(q, q_stride, head, qb * Q_ROWS, n, num_cached, k_packed + kv * head_elems,
                         v_packed + kv * head_elems, scale_log2, out, num_heads);
        }
        _tile_release();
    }
    free(packed);
    return 0;
}
