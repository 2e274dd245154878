/* The kernels of elementwise.c for one element type, included there once per type (no include
 * guard): ELEM is the stored type, LOAD(e) an element as float, STORE(f) a float rounded to ELEM,
 * NAME(op) the kernel's exported name. Math is in fp32; each result is stored (rounded) once.
 * Each returns 0, or -1 for a shape it does not take (nothing written). */

/* With `residual`: x += residual first (in place). Then out = x / rms(x) * weight, per row of `cols`. */
int NAME(add_rms_norm)(ELEM *x, const ELEM *residual, const ELEM *weight, ELEM *out, int64_t rows,
                       int64_t cols, float eps, int64_t num_threads) {
    if (rows < 0 || cols <= 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        ELEM *xr = x + r * cols;
        float sum = 0.f;
        if (residual) {
            const ELEM *rr = residual + r * cols;
#pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < cols; c++) {
                const ELEM v = STORE(LOAD(xr[c]) + LOAD(rr[c]));
                xr[c] = v;
                const float f = LOAD(v);
                sum += f * f;
            }
        } else {
#pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < cols; c++) {
                const float f = LOAD(xr[c]);
                sum += f * f;
            }
        }
        const float rstd = 1.0f / sqrtf(sum / (float)cols + eps);
        ELEM *outr = out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) {
            outr[c] = STORE(LOAD(xr[c]) * rstd * LOAD(weight[c]));
        }
    }
    return 0;
}

/* x += y, in place. */
int NAME(add)(ELEM *x, const ELEM *y, int64_t numel, int64_t num_threads) {
    if (numel < 0) return -1;
#pragma omp parallel for simd num_threads(num_threads) schedule(static) if (numel > 65536)
    for (int64_t i = 0; i < numel; i++) {
        x[i] = STORE(LOAD(x[i]) + LOAD(y[i]));
    }
    return 0;
}

/* out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]. */
int NAME(silu_mul)(const ELEM *gate_up, ELEM *out, int64_t rows, int64_t inter, int64_t num_threads) {
    if (rows < 0 || inter < 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *restrict g = gate_up + r * 2 * inter;
        const ELEM *restrict u = gate_up + r * 2 * inter + inter;
        ELEM *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            const float gf = LOAD(g[j]);
            o[j] = STORE(gf / (1.0f + exp_approx(-gf)) * LOAD(u[j]));
        }
    }
    return 0;
}

/* Rotary embedding of `heads` heads of `head_dim` at the start of each row of x (row stride `x_stride`
 * elements; q and k side by side): out[r, h, d] = x*cos + swap_halves(x)*signed_sin, cos and signed_sin
 * [rows, head_dim] (rotate_half's sign folded into signed_sin). out is contiguous [rows, heads, head_dim]. */
int NAME(rope)(const ELEM *x, int64_t x_stride, const ELEM *cos, const ELEM *signed_sin, ELEM *out,
               int64_t rows, int64_t heads, int64_t head_dim, int64_t num_threads) {
    /* halves swap: an even head_dim; a row (read only where there are two) holds its heads */
    if (rows < 0 || heads < 0 || head_dim <= 0 || head_dim % 2 ||
        (rows > 1 && x_stride < heads * head_dim))
        return -1;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *cr = cos + r * head_dim, *sr = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const ELEM *xh = x + r * x_stride + h * head_dim;
            ELEM *oh = out + (r * heads + h) * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const int64_t other = d < half ? d + half : d - half;
                oh[d] = STORE(LOAD(xh[d]) * LOAD(cr[d]) + LOAD(xh[other]) * LOAD(sr[d]));
            }
        }
    }
    return 0;
}
