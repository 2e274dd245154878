/* Scalar helpers the CPU kernels of engine/csrc share, written so that loops over them vectorize. */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H

#include <math.h>
#include <stdint.h>

/* exp(x), about 1 ulp: Cephes' expf range reduction and polynomial, x clamped to [-87, 88]. libm's
 * expf does not vectorize without -ffast-math. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

#endif
