/* The elementwise parts of a transformer layer on CPU, fused: torch's bf16 kernels for these run at
 * well under a tenth of the memory speed on a 512-token prompt (an RMSNorm of [512, 576] takes 0.4 ms
 * on one core), and a layer has five of them.
 *
 * The `_bf16` kernels take bf16 tensors (as uint16), the `_f32` ones float; all row-major and
 * contiguous unless a row stride is given. Math is in fp32; a bf16 result is rounded to bf16 once
 * (round to nearest even). One source for both: elementwise_kernels.h, included once per type. Rows
 * run in parallel over `num_threads` OpenMP threads of torch's own runtime (libgomp.so.1, as in
 * paged_attention.c). Built with -ffinite-math-only (engine/fused_ops.py): a NaN or infinite input
 * gives an undefined result.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return (uint16_t)rounded;
}

/* bf16 (as uint16): each result rounded to bf16 once (round to nearest even) */
#define ELEM uint16_t
#define LOAD(e) bf16_to_float(e)
#define STORE(f) float_to_bf16(f)
#define NAME(op) op##_bf16
#include "elementwise_kernels.h"
#undef ELEM
#undef LOAD
#undef STORE
#undef NAME

/* fp32, for CPUs without native bf16: torch's fp32 kernels for these take ~2.5 ms of each layer of a
 * 512-token prompt on an AVX2 core, these ~1.2 (docs/benchmarks-archive.md). No rounding between
 * the steps of an op; the sums of squares run in another order than torch's. */
#define ELEM float
#define LOAD(e) (e)
#define STORE(f) (f)
#define NAME(op) op##_f32
#include "elementwise_kernels.h"
#undef ELEM
#undef LOAD
#undef STORE
#undef NAME
