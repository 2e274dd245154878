/* The elementwise parts of a transformer layer on CPU, fused: torch's bf16 kernels for these run at
 * well under a tenth of the memory speed on a 512-token prompt (an RMSNorm of [512, 576] takes 0.4 ms
 * on one core), and a layer has five of them.
 *
 * The `_bf16` kernels take bf16 tensors (as uint16), the `_f32` ones float; all row-major and
 * contiguous unless a row stride is given. Math is in fp32; a bf16 result is rounded to bf16 once
 * (round to nearest even). Rows run in parallel over
 * `num_threads` OpenMP threads of torch's own runtime (libgomp.so.1, as in paged_attention.c). Built
 * with -ffinite-math-only (engine/fused_ops.py): a NaN or infinite input gives an undefined result.
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

/* With `residual`: x += residual first (in place). Then out = x / rms(x) * weight, per row of `cols`. */
int add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                      int64_t rows, int64_t cols, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * cols;
        float sum = 0.f;
        if (residual) {
            const uint16_t *rr = residual + r * cols;
#pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < cols; c++) {
                uint16_t v = float_to_bf16(bf16_to_float(xr[c]) + bf16_to_float(rr[c]));
                xr[c] = v;
                float f = bf16_to_float(v);
                sum += f * f;
            }
        } else {
#pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < cols; c++) {
                float f = bf16_to_float(xr[c]);
                sum += f * f;
            }
        }
        const float rstd = 1.0f / sqrtf(sum / (float)cols + eps);
        uint16_t *outr = out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) {
            outr[c] = float_to_bf16(bf16_to_float(xr[c]) * rstd * bf16_to_float(weight[c]));
        }
    }
    return 0;
}

/* x += y, in place. */
int add_bf16(uint16_t *x, const uint16_t *y, int64_t numel, int64_t num_threads) {
#pragma omp parallel for simd num_threads(num_threads) schedule(static) if (numel > 65536)
    for (int64_t i = 0; i < numel; i++) {
        x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
    }
    return 0;
}

/* out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]. */
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict g = gate_up + r * 2 * inter;
        const uint16_t *restrict u = gate_up + r * 2 * inter + inter;
        uint16_t *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            const float gf = bf16_to_float(g[j]);
            o[j] = float_to_bf16(gf / (1.0f + exp_approx(-gf)) * bf16_to_float(u[j]));
        }
    }
    return 0;
}

/* Rotary embedding of `heads` heads of `head_dim` at the start of each row of x (row stride `x_stride`
 * elements; q and k side by side): out[r, h, d] = x*cos + swap_halves(x)*signed_sin, cos and signed_sin
 * [rows, head_dim] (rotate_half's sign folded into signed_sin). out is contiguous [rows, heads, head_dim]. */
int rope_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *signed_sin, uint16_t *out,
              int64_t rows, int64_t heads, int64_t head_dim, int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *cr = cos + r * head_dim, *sr = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * x_stride + h * head_dim;
            uint16_t *oh = out + (r * heads + h) * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const int64_t other = d < half ? d + half : d - half;
                oh[d] = float_to_bf16(bf16_to_float(xh[d]) * bf16_to_float(cr[d])
                                      + bf16_to_float(xh[other]) * bf16_to_float(sr[d]));
            }
        }
    }
    return 0;
}

/* The same four for fp32 tensors (float), for CPUs without native bf16: torch's fp32 kernels for these
 * take ~2.5 ms of each layer of a 512-token prompt on an AVX2 core, these ~1.2 (docs/benchmarks.md).
 * No rounding between the steps of an op; the sums of squares run in another order than torch's. */
int add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                     int64_t cols, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * cols;
        float sum = 0.f;
        if (residual) {
            const float *rr = residual + r * cols;
#pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < cols; c++) {
                const float v = xr[c] + rr[c];
                xr[c] = v;
                sum += v * v;
            }
        } else {
#pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < cols; c++) {
                sum += xr[c] * xr[c];
            }
        }
        const float rstd = 1.0f / sqrtf(sum / (float)cols + eps);
        float *outr = out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) {
            outr[c] = xr[c] * rstd * weight[c];
        }
    }
    return 0;
}

int add_f32(float *x, const float *y, int64_t numel, int64_t num_threads) {
#pragma omp parallel for simd num_threads(num_threads) schedule(static) if (numel > 65536)
    for (int64_t i = 0; i < numel; i++) {
        x[i] += y[i];
    }
    return 0;
}

int silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gate_up + r * 2 * inter;
        const float *restrict u = gate_up + r * 2 * inter + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            o[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
        }
    }
    return 0;
}

int rope_f32(const float *x, int64_t x_stride, const float *cos, const float *signed_sin, float *out,
             int64_t rows, int64_t heads, int64_t head_dim, int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *cr = cos + r * head_dim, *sr = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * x_stride + h * head_dim;
            float *oh = out + (r * heads + h) * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const int64_t other = d < half ? d + half : d - half;
                oh[d] = xh[d] * cr[d] + xh[other] * sr[d];
            }
        }
    }
    return 0;
}
