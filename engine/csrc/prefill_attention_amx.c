/* Causal bf16 prefill attention with AMX tiles (Intel Sapphire Rapids and later), head_dim 64.
 *
 * A prompt's `n` new tokens attend to `num_cached` context tokens (all visible) and, among themselves,
 * to those before them. Flash attention: each work item is one query head x 16 query rows, walking the
 * visible keys 64 at a time with an fp32 online softmax, so no score matrix is ever materialised.
 *   scores  S[16 x 64] = Q[16 x 64] . K^T   8 tile products: Q in 2 A tiles (32 dims each, loaded
 *                                            straight from q with its token stride), K in B tiles
 *   softmax in AVX-512 over S, exp2 by a degree-5 polynomial and vscalefps; P rounded to bf16
 *   values  O[16 x 64] += P[16 x 64] . V    8 tile products into 4 fresh accumulators, added to the
 *                                            fp32 O rows (in memory) after rescaling them
 * B tiles want the VNNI layout (pairs of rows interleaved), so K and V are first packed once per call
 * into 1 KiB tiles, zero-padded to a whole 64-key block:
 *   K tile (key tile t of 16 keys, dim half c): [r 0..15][key 0..15][e 0..1] = K[16t + key][32c + 2r + e]
 *   V tile (key half h of 32 keys, dim tile d):  [r 0..15][dim 0..15][e 0..1] = V[32h + 2r + e][16d + dim]
 * Tiles: tmm0-1 Q, tmm2-5 S then the PV accumulators, tmm6 P, tmm7 the B operand.
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
#define KEY_BLOCK 64
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

/* 2^x for x <= 0 (to -inf): 2^round(x) by vscalefps times a degree-5 polynomial of the rest, ~2e-7
 * relative; far below bf16's rounding of P. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.8775767e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.9893397e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5826318e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015361e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315308e-1f));
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

/* One query head's rows [q0, q0 + 16) (those < n written) over keys [0, num_cached + last row]. */
static void attend_block(const uint16_t *q, int64_t q_stride, int64_t head, int64_t q0, int64_t n,
                         int64_t num_cached, const uint16_t *k_packed, const uint16_t *v_packed,
                         float scale_log2, uint16_t *out, int64_t num_heads) {
    _Alignas(64) uint16_t q_tail[Q_ROWS * HEAD_DIM];
    _Alignas(64) float s[Q_ROWS * KEY_BLOCK];
    _Alignas(64) uint16_t p[Q_ROWS * KEY_BLOCK];
    _Alignas(64) float o[Q_ROWS * HEAD_DIM];
    _Alignas(64) float pv[Q_ROWS * HEAD_DIM];
    _Alignas(64) float row_max[Q_ROWS], row_sum[Q_ROWS], alpha[Q_ROWS], new_max[Q_ROWS], block_sum[Q_ROWS];
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
    _tile_loadd(0, q_rows, q_row_bytes);
    _tile_loadd(1, q_rows + 32, q_row_bytes);
    memset(o, 0, sizeof o);
    for (int r = 0; r < Q_ROWS; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.f;
    }
    /* row r (query q0 + r) sees keys <= num_cached + q0 + r; padding rows as many as the last real one */
    const int64_t last_key = num_cached + q0 + rows - 1;
    const int64_t num_blocks = last_key / KEY_BLOCK + 1;
    for (int64_t b = 0; b < num_blocks; b++) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        const uint16_t *kb = k_packed + b * 8 * (TILE_BYTES / 2);
#define SCORE(ACC, T)                                                    \
        _tile_loadd(7, kb + (2 * (T)) * (TILE_BYTES / 2), 64);           \
        _tile_dpbf16ps(ACC, 0, 7);                                       \
        _tile_loadd(7, kb + (2 * (T) + 1) * (TILE_BYTES / 2), 64);       \
        _tile_dpbf16ps(ACC, 1, 7);
        SCORE(2, 0)
        SCORE(3, 1)
        SCORE(4, 2)
        SCORE(5, 3)
#undef SCORE
        _tile_stored(2, s, KEY_BLOCK * 4);
        _tile_stored(3, s + 16, KEY_BLOCK * 4);
        _tile_stored(4, s + 32, KEY_BLOCK * 4);
        _tile_stored(5, s + 48, KEY_BLOCK * 4);

        const int64_t first_key = b * KEY_BLOCK;
        const int masked = first_key + KEY_BLOCK - 1 > num_cached + q0;
        for (int r = 0; r < Q_ROWS; r++) {
            __m512 x[4];
            const int64_t r_real = r < rows ? r : rows - 1;
            const int64_t visible = num_cached + q0 + r_real - first_key + 1; /* keys of this block */
            __mmask16 keep[4];
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < 4; j++) {
                const int64_t left = visible - 16 * j;
                keep[j] = !masked || left >= 16 ? (__mmask16)0xffff
                          : left <= 0          ? (__mmask16)0
                                               : (__mmask16)((1u << left) - 1);
                x[j] = _mm512_mul_ps(_mm512_load_ps(s + r * KEY_BLOCK + 16 * j),
                                     _mm512_set1_ps(scale_log2));
                top = _mm512_mask_max_ps(top, keep[j], top, x[j]);
            }
            new_max[r] = fmaxf(row_max[r], _mm512_reduce_max_ps(top));
            const __m512 m = _mm512_set1_ps(new_max[r]);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++) {
                const __m512 e = _mm512_maskz_mov_ps(keep[j], exp2_ps(_mm512_sub_ps(x[j], m)));
                sum = _mm512_add_ps(sum, e);
                _mm256_store_si256((__m256i *)(p + r * KEY_BLOCK + 16 * j),
                                   (__m256i)_mm512_cvtneps_pbh(e));
            }
            block_sum[r] = _mm512_reduce_add_ps(sum);
        }
        {   /* the rows' rescaling factors and sums, 16 at once */
            const __m512 old_max = _mm512_load_ps(row_max), max = _mm512_load_ps(new_max);
            const __m512 a = exp2_ps(_mm512_sub_ps(old_max, max));
            _mm512_store_ps(alpha, a);
            _mm512_store_ps(row_max, max);
            _mm512_store_ps(row_sum, _mm512_fmadd_ps(_mm512_load_ps(row_sum), a,
                                                     _mm512_load_ps(block_sum)));
        }

        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        const uint16_t *vb = v_packed + b * 8 * (TILE_BYTES / 2);
        for (int h = 0; h < 2; h++) {
            _tile_loadd(6, p + 32 * h, KEY_BLOCK * 2);
            _tile_loadd(7, vb + (h * 4 + 0) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(2, 6, 7);
            _tile_loadd(7, vb + (h * 4 + 1) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(3, 6, 7);
            _tile_loadd(7, vb + (h * 4 + 2) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(4, 6, 7);
            _tile_loadd(7, vb + (h * 4 + 3) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(5, 6, 7);
        }
        _tile_stored(2, pv, HEAD_DIM * 4);
        _tile_stored(3, pv + 16, HEAD_DIM * 4);
        _tile_stored(4, pv + 32, HEAD_DIM * 4);
        _tile_stored(5, pv + 48, HEAD_DIM * 4);
        for (int r = 0; r < Q_ROWS; r++) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            for (int j = 0; j < 4; j++) {
                float *orow = o + r * HEAD_DIM + 16 * j;
                _mm512_store_ps(orow, _mm512_fmadd_ps(_mm512_load_ps(orow), a,
                                                      _mm512_load_ps(pv + r * HEAD_DIM + 16 * j)));
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
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
