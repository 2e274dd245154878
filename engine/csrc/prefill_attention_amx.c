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
 * into 1 KiB tiles, zero-padded to a whole 32-key block (prefill_attention.h, shared with the
 * AVX512-BF16 kernel).
 * Tiles: tmm0-3 O, tmm4-5 S, tmm6 the A operand (Q, then P), tmm7 the B operand.
 * Where the time goes (1024 tokens, one thread, by removing each part): the tile products with their
 * loads and stores ~40 % (packing K and V 6 %), the softmax's bookkeeping ~33 %, its exponentials
 * ~27 %. A first version that kept O in memory, updated by AVX-512 every block, took 1.25x as long.
 *
 * Layouts and threads: prefill_attention.h.
 *
 * The process must hold Linux's permission for the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM),
 * which engine/prefill_attention.py requests before it loads this); compiled with -mamx-tile
 * -mamx-bf16 -mavx512bf16, it runs only where the CPU has them. The tile instructions go through
 * amx_tiles.h, whose operands tell the compiler what memory each reads and writes.
 */
#include "amx_tiles.h"
#include "prefill_attention.h"

/* Every tile 16 rows of 64 bytes. Called through a pointer (run_prefill_attention's `begin`): the
 * config's stores reach memory because amx_load_config reads all of it. */
static void configure_tiles(void) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = AMX_TILE_ROW_BYTES;
        config.rows[t] = AMX_TILE_ROWS;
    }
    amx_load_config(&config);
}

static void release_tiles(void) { amx_release(); }

/* One query head's rows [q0, q0 + 16) (those < n written) over keys [0, num_cached + last row], 32
 * keys (KEY_BLOCK) at a time. O stays in tiles 0-3 from the first key to the last: the running maximum a row's
 * exponentials are taken against moves only when a score exceeds it by more than 2^RESCALE_LOG2
 * (rare after the first block), and only then are the O rows rescaled, through memory; meanwhile the
 * exponentials stay below 2^RESCALE_LOG2, harmless in fp32 and bf16. Each row's sum of P stays a
 * vector of 16 partial sums until the end. */
static void attend_block(const uint16_t *q, int64_t q_stride, int64_t head, int64_t q0, int64_t n,
                         int64_t num_cached, const uint16_t *k_packed, const uint16_t *v_packed,
                         float scale_log2, uint16_t *out, int64_t num_heads) {
    work_item w;
    start_item(&w, q, q_stride, head, q0, n);
    amx_tile_zero(0);
    amx_tile_zero(1);
    amx_tile_zero(2);
    amx_tile_zero(3);
    /* row r (query q0 + r) sees keys <= num_cached + q0 + r; padding rows as many as the last real one */
    const int64_t last_key = num_cached + q0 + w.rows - 1;
    const int64_t num_blocks = last_key / KEY_BLOCK + 1;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint16_t *kb = k_packed + b * 4 * TILE_ELEMS;
        amx_tile_zero(4);
        amx_tile_zero(5);
        amx_tile_load(6, w.q_rows, w.q_row_stride * 2);
        amx_tile_load(7, kb, 64);
        amx_dpbf16ps(4, 6, 7);
        amx_tile_load(7, kb + 2 * TILE_ELEMS, 64);
        amx_dpbf16ps(5, 6, 7);
        amx_tile_load(6, w.q_rows + 32, w.q_row_stride * 2);
        amx_tile_load(7, kb + 1 * TILE_ELEMS, 64);
        amx_dpbf16ps(4, 6, 7);
        amx_tile_load(7, kb + 3 * TILE_ELEMS, 64);
        amx_dpbf16ps(5, 6, 7);
        amx_tile_store(4, w.s, KEY_BLOCK * 4);
        amx_tile_store(5, w.s + 16, KEY_BLOCK * 4);

        const int rescale = softmax_block(&w, b, num_cached, q0, scale_log2);
        if (rescale && b > 0) {  /* O's rows times alpha, through memory */
            amx_tile_store(0, w.o, HEAD_DIM * 4);
            amx_tile_store(1, w.o + 16, HEAD_DIM * 4);
            amx_tile_store(2, w.o + 32, HEAD_DIM * 4);
            amx_tile_store(3, w.o + 48, HEAD_DIM * 4);
            for (int r = 0; r < Q_ROWS; r++) {
                const __m512 a = _mm512_set1_ps(w.alpha[r]);
                for (int j = 0; j < 4; j++)
                    _mm512_store_ps(w.o + r * HEAD_DIM + 16 * j,
                                    _mm512_mul_ps(_mm512_load_ps(w.o + r * HEAD_DIM + 16 * j), a));
            }
            amx_tile_load(0, w.o, HEAD_DIM * 4);
            amx_tile_load(1, w.o + 16, HEAD_DIM * 4);
            amx_tile_load(2, w.o + 32, HEAD_DIM * 4);
            amx_tile_load(3, w.o + 48, HEAD_DIM * 4);
        }
        const uint16_t *vb = v_packed + b * 4 * TILE_ELEMS;
        amx_tile_load(6, w.p, 64);
        amx_tile_load(7, vb, 64);
        amx_dpbf16ps(0, 6, 7);
        amx_tile_load(7, vb + 1 * TILE_ELEMS, 64);
        amx_dpbf16ps(1, 6, 7);
        amx_tile_load(7, vb + 2 * TILE_ELEMS, 64);
        amx_dpbf16ps(2, 6, 7);
        amx_tile_load(7, vb + 3 * TILE_ELEMS, 64);
        amx_dpbf16ps(3, 6, 7);
    }
    amx_tile_store(0, w.o, HEAD_DIM * 4);
    amx_tile_store(1, w.o + 16, HEAD_DIM * 4);
    amx_tile_store(2, w.o + 32, HEAD_DIM * 4);
    amx_tile_store(3, w.o + 48, HEAD_DIM * 4);
    store_rows(&w, q0, head, num_heads, out);
}

/* Returns 0, or -1 (bad shape) / -2 (out of memory). */
int amx_prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                               int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t n,
                               int64_t num_cached, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, float scale, int64_t num_threads) {
    return run_prefill_attention(q, k, v, out, q_stride, k_stride, v_stride, n, num_cached, num_heads,
                                 num_kv_heads, head_dim, scale, num_threads, attend_block,
                                 configure_tiles, release_tiles);
}
