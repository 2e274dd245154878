/* Decode attention over a paged KV cache, reading each sequence's K/V blocks in place.
 *
 * One query token per sequence. For each sequence the kernel makes two passes over its blocks, in
 * order: scores q.k of every query head against every cached token (a token's K row for all kv heads
 * is contiguous and read once), a softmax in fp32, then the probability-weighted sum of V rows. No
 * gather, no padding, no mask: the block table and the context length say which rows exist.
 *
 * Layouts (row-major, contiguous):
 *   q, out        float32 [batch, num_heads, head_dim]
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim], bf16 (as uint16) or float32
 *   block_tables  int64 [batch, max_blocks]
 *   context_lens  int64 [batch]
 * Sequences run in parallel over `num_threads` OpenMP threads. Linked against libgomp.so.1, the
 * kernel shares the OpenMP runtime torch has already loaded, so its threads are torch's threads and
 * the two never oversubscribe the cores (a Python thread pool did, and was no faster than torch).
 *
 * Where the compiler targets AVX2 with FMA, an intrinsics path (below) serves head sizes that are
 * multiples of 8, and where it targets AVX-512 a 16-lane path serves multiples of 16 (the AVX2 path the
 * rest); the plain loops serve everything else and every other CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define MAX_HEAD_DIM 256

/* Offset of token t's row (all kv heads) in a cache, through the sequence's block table. */
static inline int64_t row_offset(const int64_t *table, int64_t t, int64_t block_size, int64_t row_size) {
    return (table[t / block_size] * block_size + t % block_size) * row_size;
}

/* Each of `rows` rows of `len` scores becomes its softmax, in place. */
static void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * len, top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max:top)
        for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;
#pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; t++) { sg[t] = exp_approx(sg[t] - top); sum += sg[t]; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

/* ---- The AVX2 path (x86 with AVX2 and FMA; head_dim a multiple of 8) ------------------------------
 * The plain loops above leave the work to the auto-vectorizer: a horizontal sum per q.k and the V
 * accumulators in memory. On an AVX2 core they read the cache at ~7 GB/s, under half of the ~17 GB/s
 * one core draws from memory, because they are bound by their own loads and stores. This path keeps
 * the same three passes (scores, softmax, V) but walks K and V block by block, and shares every K and
 * V row it loads among the (up to three at a time) query heads of its kv head. The next block is
 * prefetched (the hardware cannot guess where the block table points) while this one is computed, a
 * kv head's share of it during each kv head of this one, a line or two per step of the inner loops:
 * issued all at once, its 192 lines (fp32, SmolLM2's heads) stalled on the core's miss buffers instead
 * of overlapping the arithmetic; a share at a time before each kv head, 1.05-1.37x faster over 30
 * layers' caches that miss every level (fp32 and bf16, one and two threads), and spread through the
 * loops 1.4-2.1x faster again on a Zen 1 EPYC (fp32; bf16 1.1-1.35x; docs/benchmarks-archive.md):
 *   scores: 4 tokens x 3 heads in 12 accumulator registers, reduced four at a time by hadd;
 *   V:      16 output lanes x 3 heads in 6 registers over a block's tokens.
 * bf16 rows are widened to fp32 once per block. The order of the sums differs from the plain loops,
 * not the precision (fp32 throughout). */
#define NOT_HANDLED (-100)

/* Wherever the compiler targets AVX2 with FMA, AVX-512 cores included (there, for head sizes the
 * AVX-512 path below does not serve): on an Intel Xeon with AVX-512 (and AMX) it beat the plain loops, which vectorize over 16 lanes there, by 1.3-1.8x (bf16, 9 query
 * heads over 3 kv heads of 64, contexts of 600: batch 3, 30 layers, 3.8 against 6.3 ms on one thread,
 * 2.5 against 4.5 on two; not measured on an AMD AVX-512 core: `python -m benchmarks.paged_attention_bench`, which builds the plain loops
 * alone with -DPDSERVE_PLAIN_LOOPS). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(PDSERVE_PLAIN_LOOPS)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* Lane i (i < 4) of the result: the sum of v[i]'s eight lanes. */
INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* A block's n rows of one kv head as fp32 rows `*stride` floats apart: in place for an fp32 cache,
 * widened into `scratch` ([block_size, head_dim]) for bf16. */
INLINE const float *rows_f32(const float *rows, int64_t n, int64_t row_size, int64_t head_dim,
                             float *scratch, int64_t *stride) {
    (void)n; (void)head_dim; (void)scratch;
    *stride = row_size;
    return rows;
}
INLINE const float *rows_bf16(const uint16_t *rows, int64_t n, int64_t row_size, int64_t head_dim,
                              float *scratch, int64_t *stride) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < head_dim; d += 8) {
            const __m128i half = _mm_loadu_si128((const __m128i *)(rows + j * row_size + d));
            _mm256_storeu_ps(scratch + j * head_dim + d,
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
        }
    *stride = head_dim;
    return scratch;
}

INLINE void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)block + o, _MM_HINT_T0);
}

/* The lines of the next block's share still to prefetch, issued a few at a time through the inner
 * loops of this block's arithmetic: on a Zen 1 EPYC a kv head's share (64 lines, fp32) issued at once
 * before its arithmetic stalled on the miss buffers; spread, 30 layers of 8 sequences of 540 tokens
 * (fp32, one thread) took 27-35 against 45-52 ms (docs/benchmarks-archive.md). Two blocks ahead,
 * into L2, or one line per K step (the rest at the end) were no faster; four K and two V lines per
 * step slower. */
typedef struct { const char *at, *end; } Lines;

INLINE Lines lines_of(const char *share, int64_t bytes) {
    Lines lines = {share, share ? share + bytes : NULL};
    return lines;
}

/* How many lines each of `steps` inner iterations prefetches so that all are issued by the last. */
INLINE int64_t lines_per_step(const Lines *lines, int64_t steps) {
    const int64_t left = lines->at ? (lines->end - lines->at) / 64 : 0;
    return (left + steps - 1) / steps;
}

INLINE void prefetch_lines(Lines *lines, int64_t count) {
    for (; count > 0 && lines->at < lines->end; count--, lines->at += 64) _mm_prefetch(lines->at, _MM_HINT_T0);
}

/* The first min(4, count) lanes of `four` to dst[0..]. */
INLINE void store_scores(float *dst, __m128 four, int64_t count) {
    if (count >= 4) {  /* a store, not a call of memcpy for a variable size */
        _mm_storeu_ps(dst, four);
        return;
    }
    float lane[4];
    _mm_storeu_ps(lane, four);
    for (int64_t j = 0; j < count; j++) dst[j] = lane[j];
}

/* scores[g][t0 + j] = scale * q_g.k_j for HEADS query heads (q rows head_dim apart, scores rows `len`
 * apart) and the block's n tokens (k_j = k + j * stride), prefetching `ahead` on the way. */
INLINE void block_scores(const float *q, const float *k, int64_t stride, int64_t n, int64_t head_dim,
                         float scale, float *scores, int64_t len, const int heads, Lines *ahead) {
    const __m128 s = _mm_set1_ps(scale);
    const int64_t step_lines = lines_per_step(ahead, (n + 3) / 4 * (head_dim / 8));
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const float *kj[4];
        for (int j = 0; j < 4; j++) kj[j] = k + (j0 + j < n ? j0 + j : n - 1) * stride;  /* past n: unused */
        __m256 acc[3][4];
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) {
            __m256 x[4];
            for (int j = 0; j < 4; j++) x[j] = _mm256_loadu_ps(kj[j] + d);
            prefetch_lines(ahead, step_lines);
            for (int g = 0; g < heads; g++) {
                const __m256 qv = _mm256_loadu_ps(q + g * head_dim + d);
                for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qv, x[j], acc[g][j]);
            }
        }
        for (int g = 0; g < heads; g++)
            store_scores(scores + g * len + j0, _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), s),
                         n - j0);
    }
}

/* out_g[c..] += sum_j p_g[j] * v_j[c..] for HEADS query heads (outputs head_dim apart, p rows `len`
 * apart) over the block's n tokens, 16 lanes (then 8) at a time, prefetching `ahead` on the way. */
INLINE void block_values(float *out, const float *p, int64_t len, const float *v, int64_t stride, int64_t n,
                         int64_t head_dim, const int heads, Lines *ahead) {
    const int64_t step_lines = lines_per_step(ahead, head_dim / 16 * n + 1);
    int64_t c = 0;
    for (; c + 16 <= head_dim; c += 16) {
        __m256 a[3][2];
        for (int g = 0; g < heads; g++)
            for (int w = 0; w < 2; w++) a[g][w] = _mm256_loadu_ps(out + g * head_dim + c + 8 * w);
        for (int64_t j = 0; j < n; j++) {
            const __m256 x0 = _mm256_loadu_ps(v + j * stride + c), x1 = _mm256_loadu_ps(v + j * stride + c + 8);
            prefetch_lines(ahead, step_lines);
            for (int g = 0; g < heads; g++) {
                const __m256 b = _mm256_broadcast_ss(p + g * len + j);
                a[g][0] = _mm256_fmadd_ps(b, x0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(b, x1, a[g][1]);
            }
        }
        for (int g = 0; g < heads; g++)
            for (int w = 0; w < 2; w++) _mm256_storeu_ps(out + g * head_dim + c + 8 * w, a[g][w]);
    }
    for (; c < head_dim; c += 8) {
        for (int g = 0; g < heads; g++) {
            __m256 a = _mm256_loadu_ps(out + g * head_dim + c);
            for (int64_t j = 0; j < n; j++)
                a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * len + j), _mm256_loadu_ps(v + j * stride + c), a);
            _mm256_storeu_ps(out + g * head_dim + c, a);
        }
    }
}

/* The heads of one kv head, three at a time, each call specialized for its count. */
#define FOR_HEAD_GROUPS(FIRST, COUNT, CALL) do {                                                   \
    for (int64_t g0_ = (FIRST); g0_ < (FIRST) + (COUNT); g0_ += 3) {                                \
        const int64_t left_ = (FIRST) + (COUNT) - g0_, g = g0_;                                     \
        if (left_ >= 3) { const int heads = 3; CALL; }                                              \
        else if (left_ == 2) { const int heads = 2; CALL; }                                         \
        else { const int heads = 1; CALL; }                                                         \
    }                                                                                               \
} while (0)

/* For each block of the sequence (t0: its first token, n: its tokens, `block`: its first byte) and each
 * kv head h of it, BODY, which prefetches `share`, the next block's share for one kv head (NULL after the
 * last block; the hardware cannot guess where the block table points). Uses the names of the sequence
 * functions' bodies (block_bytes, head_bytes: a kv head's share of a block). */
#define FOR_KV_BLOCKS(CACHE, BODY) do {                                                             \
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                              \
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;                            \
        const char *block = (const char *)(CACHE) + table[t0 / block_size] * block_bytes;           \
        const char *next = t0 + block_size < len ? (const char *)(CACHE) + table[t0 / block_size + 1] * block_bytes : NULL; \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                \
            const char *share = next ? next + h * head_bytes : NULL;                                \
            BODY;                                                                                   \
        }                                                                                           \
    }                                                                                               \
} while (0)

/* FOR_KV_BLOCKS with `rows`, kv head h's rows of the block as fp32 `stride` floats apart, then CALL for
 * every group of its query heads (g, heads), which prefetch the lines of `ahead`, the next block's share
 * (any left after them are issued at the end). */
#define FOR_BLOCK_ROWS(ELEM, CACHE, ROWS, CALL) FOR_KV_BLOCKS(CACHE,                                \
    int64_t stride;                                                                                 \
    Lines ahead_lines = lines_of(share, head_bytes);                                                \
    Lines *ahead = &ahead_lines;                                                                    \
    const float *rows = ROWS((const ELEM *)block + h * head_dim, n, row_size, head_dim, scratch, &stride); \
    FOR_HEAD_GROUPS(h * group, group, CALL);                                                        \
    prefetch_lines(ahead, head_bytes / 64))

#define DEFINE_SIMD_SEQUENCE(NAME, ELEM, ROWS)                                                     \
static int NAME(const float *qb, const ELEM *k_cache, const ELEM *v_cache, const int64_t *table,   \
                int64_t len, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, \
                int64_t block_size, float scale) {                                                  \
    if (head_dim % 8 != 0 || len < 1) return NOT_HANDLED;                                          \
    const int64_t group = num_heads / num_kv_heads, row_size = num_kv_heads * head_dim;            \
    const int64_t block_bytes = block_size * row_size * (int64_t)sizeof(ELEM);                     \
    const int64_t head_bytes = block_bytes / num_kv_heads; /* a kv head's share of a block */       \
    float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * len + block_size * head_dim)); \
    if (!scores) return -2;                                                                         \
    float *scratch = scores + num_heads * len;                                                      \
    FOR_BLOCK_ROWS(ELEM, k_cache, ROWS, block_scores(qb + g * head_dim, rows, stride, n, head_dim, scale, \
                                               scores + g * len + t0, len, heads, ahead));          \
    if (len > block_size) prefetch_block(v_cache + table[0] * block_size * row_size, block_bytes);  \
    softmax_rows(scores, num_heads, len);                                                           \
    memset(out, 0, sizeof(float) * (size_t)(num_heads * head_dim));                                 \
    FOR_BLOCK_ROWS(ELEM, v_cache, ROWS, block_values(out + g * head_dim, scores + g * len + t0, len, rows, stride, \
                                               n, head_dim, heads, ahead));                         \
    free(scores);                                                                                   \
    return 0;                                                                                       \
}

DEFINE_SIMD_SEQUENCE(avx2_sequence_f32, float, rows_f32)
DEFINE_SIMD_SEQUENCE(avx2_sequence_bf16, uint16_t, rows_bf16)

#if defined(__AVX512F__) && !defined(PDSERVE_NO_AVX512)
/* ---- The AVX-512 path (head_dim a multiple of 16) ---------------------------------------------------
 * The AVX2 path's passes, block walk and prefetches at twice the width, with each bf16 row widened in
 * the registers it is loaded into (the AVX2 path widens every block into `scratch` and reads it back,
 * once for K and once for V), and the next block prefetched into L2 (below). On an AVX512-BF16 AMD
 * EPYC a decode step's attention over 16 sequences of 540 tokens (one thread) had been 44 % of the
 * step, about three times what the cache's bytes take to read there; 30 layers of it now take 14.5
 * against 23.9 ms with the blocks in order, 21.3 against 41.7 shuffled (docs/benchmarks.md):
 *   scores: 4 tokens x 3 heads in 12 accumulators, each folded to 8 lanes and reduced four at a time;
 *   V:      64 output lanes x 3 heads in 12 accumulators over a block's tokens (then 16 at a time).
 * fp32 arithmetic throughout, as in the AVX2 path; only the order of the sums differs. */

/* 16 fp32 lanes from the row at `p` (bf16, widened, or fp32). */
INLINE __m512 load16(const void *p, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* The next block is prefetched into L2, not L1 as in the AVX2 path: a block's share of 32 lines
 * (bf16) issued into L1 stalled on its miss buffers, and perf put 15 % of the kernel on the prefetch
 * loop's own instructions; into L2, 30 layers of 16 sequences of 540 tokens took 20.9 against 35.2 ms
 * with the blocks shuffled and 14.8 against 16.4 in order (one thread; L3 the same as L2, two blocks
 * ahead the same as one, no prefetch 49.0 / 28.2). */
INLINE void prefetch_block_l2(const void *block, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)block + o, _MM_HINT_T1);
}

INLINE __m256 fold8(__m512 a) {  /* lanes i and i + 8 added */
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* As block_scores, for the rows of one kv head `row_bytes` apart from `k`. */
INLINE void block_scores512(const float *q, const char *k, int64_t row_bytes, int64_t n, int64_t head_dim,
                            float scale, float *scores, int64_t len, const int heads, const int bf16) {
    const __m128 s = _mm_set1_ps(scale);
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const char *kj[4];
        for (int j = 0; j < 4; j++) kj[j] = k + (j0 + j < n ? j0 + j : n - 1) * row_bytes;  /* past n: unused */
        __m512 acc[3][4];
        for (int g = 0; g < 3; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 x[4];
            for (int j = 0; j < 4; j++) x[j] = load16(kj[j] + d * elem, bf16);
            for (int g = 0; g < heads; g++) {
                const __m512 qv = _mm512_loadu_ps(q + g * head_dim + d);
                for (int j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(qv, x[j], acc[g][j]);
            }
        }
        for (int g = 0; g < heads; g++)
            store_scores(scores + g * len + j0,
                         _mm_mul_ps(hsum4(fold8(acc[g][0]), fold8(acc[g][1]), fold8(acc[g][2]), fold8(acc[g][3])), s),
                         n - j0);
    }
}

/* As block_values, for the rows of one kv head `row_bytes` apart from `v`: W vectors of 16 outputs per
 * head for the columns from c. */
INLINE void values_span512(float *out, const float *p, int64_t len, const char *v, int64_t row_bytes,
                           int64_t n, int64_t head_dim, int64_t c, const int heads, const int bf16,
                           const int W) {
    const int64_t elem = bf16 ? 2 : 4;
    __m512 a[3][4];
    for (int g = 0; g < heads; g++)
        for (int w = 0; w < W; w++) a[g][w] = _mm512_loadu_ps(out + g * head_dim + c + 16 * w);
    for (int64_t j = 0; j < n; j++) {
        __m512 x[4];
        for (int w = 0; w < W; w++) x[w] = load16(v + j * row_bytes + (c + 16 * w) * elem, bf16);
        for (int g = 0; g < heads; g++) {
            const __m512 b = _mm512_set1_ps(p[g * len + j]);
            for (int w = 0; w < W; w++) a[g][w] = _mm512_fmadd_ps(b, x[w], a[g][w]);
        }
    }
    for (int g = 0; g < heads; g++)
        for (int w = 0; w < W; w++) _mm512_storeu_ps(out + g * head_dim + c + 16 * w, a[g][w]);
}

INLINE void block_values512(float *out, const float *p, int64_t len, const char *v, int64_t row_bytes,
                            int64_t n, int64_t head_dim, const int heads, const int bf16) {
    int64_t c = 0;
    for (; c + 64 <= head_dim; c += 64) values_span512(out, p, len, v, row_bytes, n, head_dim, c, heads, bf16, 4);
    for (; c < head_dim; c += 16) values_span512(out, p, len, v, row_bytes, n, head_dim, c, heads, bf16, 1);
}

/* FOR_KV_BLOCKS with `rows`, kv head h's first row in the block as stored (bytes), then CALL for every
 * group of its query heads (g, heads); the next block prefetched into L2. */
#define FOR_BLOCK_HEADS(CACHE, CALL) FOR_KV_BLOCKS(CACHE,                                           \
    if (share) prefetch_block_l2(share, head_bytes);                                                \
    const char *rows = block + h * head_dim * elem;                                                 \
    FOR_HEAD_GROUPS(h * group, group, CALL))

INLINE int avx512_sequence(const float *qb, const void *k_cache, const void *v_cache, const int64_t *table,
                           int64_t len, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, const int bf16) {
    if (head_dim % 16 != 0 || len < 1) return NOT_HANDLED;
    const int64_t elem = bf16 ? 2 : 4, group = num_heads / num_kv_heads;
    const int64_t row_bytes = num_kv_heads * head_dim * elem, block_bytes = block_size * row_bytes;
    const int64_t head_bytes = block_bytes / num_kv_heads; /* a kv head's share of a block */
    float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * len));
    if (!scores) return -2;
    FOR_BLOCK_HEADS(k_cache, block_scores512(qb + g * head_dim, rows, row_bytes, n, head_dim, scale,
                                             scores + g * len + t0, len, heads, bf16));
    if (len > block_size) prefetch_block_l2((const char *)v_cache + table[0] * block_bytes, block_bytes);
    softmax_rows(scores, num_heads, len);
    memset(out, 0, sizeof(float) * (size_t)(num_heads * head_dim));
    FOR_BLOCK_HEADS(v_cache, block_values512(out + g * head_dim, scores + g * len + t0, len, rows, row_bytes,
                                             n, head_dim, heads, bf16));
    free(scores);
    return 0;
}

/* The AVX-512 path where it serves the head size, else the AVX2 path. */
#define DEFINE_DISPATCH(NAME, ELEM, BF16, AVX2)                                                     \
static int NAME(const float *qb, const ELEM *k_cache, const ELEM *v_cache, const int64_t *table,   \
                int64_t len, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, \
                int64_t block_size, float scale) {                                                  \
    const int code = avx512_sequence(qb, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, \
                                     head_dim, block_size, scale, BF16);                            \
    if (code != NOT_HANDLED) return code;                                                           \
    return AVX2(qb, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size, scale); \
}
DEFINE_DISPATCH(simd_sequence_f32, float, 0, avx2_sequence_f32)
DEFINE_DISPATCH(simd_sequence_bf16, uint16_t, 1, avx2_sequence_bf16)
#else
#define simd_sequence_f32 avx2_sequence_f32
#define simd_sequence_bf16 avx2_sequence_bf16
#endif

#else /* no AVX2 (or PDSERVE_PLAIN_LOOPS): the plain loops serve every call */
#define simd_sequence_f32(...) NOT_HANDLED
#define simd_sequence_bf16(...) NOT_HANDLED
#endif

#define DEFINE_KERNEL(NAME, ELEM, LOAD, SIMD)                                                             \
static int NAME##_generic(const float *qb, const ELEM *k_cache, const ELEM *v_cache,              \
         const int64_t *table, int64_t len, float *out, int64_t num_heads, int64_t num_kv_heads,    \
         int64_t head_dim, int64_t block_size, float scale) {                                       \
    const int64_t group = num_heads / num_kv_heads;                                                 \
    const int64_t row_size = num_kv_heads * head_dim; /* one token's K (or V), all kv heads */      \
    if (head_dim > MAX_HEAD_DIM) return -1;                                                         \
    float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * (len > 0 ? len : 1)));     \
    if (!scores) return -2;                                                                         \
    float row[MAX_HEAD_DIM];                                                                        \
    /* Pass 1: every head's score against each cached token; a token's row is contiguous. */        \
    for (int64_t t = 0; t < len; t++) {                                                             \
        const ELEM *k = k_cache + row_offset(table, t, block_size, row_size);                       \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                \
            _Pragma("omp simd")                                                                     \
            for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(k[h * head_dim + d]);              \
            for (int64_t g = h * group; g < (h + 1) * group; g++) {                                 \
                const float *qv = qb + g * head_dim;                                                \
                float s = 0.f;                                                                      \
                _Pragma("omp simd reduction(+:s)")                                                  \
                for (int64_t d = 0; d < head_dim; d++) s += qv[d] * row[d];                         \
                scores[g * len + t] = s * scale;                                                    \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    softmax_rows(scores, num_heads, len);                                                           \
    /* Pass 2: the probability-weighted sum of V rows, accumulated in place in `out`. */            \
    memset(out, 0, sizeof(float) * (size_t)(num_heads * head_dim));                                 \
    for (int64_t t = 0; t < len; t++) {                                                             \
        const ELEM *v = v_cache + row_offset(table, t, block_size, row_size);                       \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                \
            _Pragma("omp simd")                                                                     \
            for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(v[h * head_dim + d]);              \
            for (int64_t g = h * group; g < (h + 1) * group; g++) {                                 \
                const float p = scores[g * len + t];                                                \
                float *a = out + g * head_dim;                                                      \
                _Pragma("omp simd")                                                                 \
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * row[d];                          \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    free(scores);                                                                                   \
    return 0;                                                                                       \
}                                                                                                   \
                                                                                                    \
static int NAME##_sequence(const float *qb, const ELEM *k_cache, const ELEM *v_cache,              \
         const int64_t *table, int64_t len, float *out, int64_t num_heads, int64_t num_kv_heads,    \
         int64_t head_dim, int64_t block_size, float scale) {                                       \
    const int code = SIMD(qb, k_cache, v_cache, table, len, out, num_heads, num_kv_heads,           \
                          head_dim, block_size, scale);                                             \
    if (code != NOT_HANDLED) return code;                                                           \
    return NAME##_generic(qb, k_cache, v_cache, table, len, out, num_heads, num_kv_heads,           \
                          head_dim, block_size, scale);                                             \
}                                                                                                   \
                                                                                                    \
int NAME(const float *q, const ELEM *k_cache, const ELEM *v_cache, const int64_t *block_tables,     \
         const int64_t *context_lens, float *out, int64_t batch, int64_t num_heads,                 \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,            \
         float scale, int64_t num_threads) {                                                        \
    int failed = 0;                                                                                 \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(|:failed) if(num_threads > 1)") \
    for (int64_t b = 0; b < batch; b++)                                                             \
        failed |= NAME##_sequence(q + b * num_heads * head_dim, k_cache, v_cache,                   \
                                  block_tables + b * max_blocks, context_lens[b],                   \
                                  out + b * num_heads * head_dim, num_heads, num_kv_heads,          \
                                  head_dim, block_size, scale);                                     \
    return failed;                                                                                  \
}

#define LOAD_BF16(x) bf16_to_float(x)
#define LOAD_F32(x) (x)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16, simd_sequence_bf16)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32, simd_sequence_f32)
