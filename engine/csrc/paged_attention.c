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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256

/* exp for x <= 0 (softmax after subtracting the max), written so that it vectorizes: Cephes' expf
 * range reduction and polynomial, about 1 ulp. libm's expf does not vectorize without -ffast-math. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Offset of token t's row (all kv heads) in a cache, through the sequence's block table. */
static inline int64_t row_offset(const int64_t *table, int64_t t, int64_t block_size, int64_t row_size) {
    return (table[t / block_size] * block_size + t % block_size) * row_size;
}

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

#define DEFINE_KERNEL(NAME, ELEM, LOAD)                                                             \
static int NAME##_sequence(const float *qb, const ELEM *k_cache, const ELEM *v_cache,              \
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
    for (int64_t g = 0; g < num_heads; g++) {                                                       \
        float *sg = scores + g * len, top = -INFINITY, sum = 0.f;                                   \
        _Pragma("omp simd reduction(max:top)")                                                      \
        for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;                          \
        _Pragma("omp simd reduction(+:sum)")                                                        \
        for (int64_t t = 0; t < len; t++) { sg[t] = exp_nonpositive(sg[t] - top); sum += sg[t]; }   \
        const float inv = 1.f / sum;                                                                \
        _Pragma("omp simd")                                                                         \
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;                                             \
    }                                                                                               \
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
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
