/* pdlab's fused elementwise kernels for the CPU float32 forward (engine/cpu_kernels.py builds
 * this file with the system C compiler and calls it through ctypes; engine/runner.py uses it).
 *
 * Each function replaces a chain of small torch ops of one decoder layer by one pass over
 * contiguous float32 rows, on the calling thread. The arithmetic is the modules' own, op by
 * op, in the same order (built with -ffp-contract=off so no multiply-add is fused), so the
 * results equal transformers' to float32 rounding: RMSNorm differs only in the order of the
 * sum of squares, SiLU only in exp's last bits (a Cephes-style polynomial here, Sleef's in
 * torch), RoPE and the K/V copy not at all (bit for bit). Loops over LANES independent accumulators let the compiler vectorise without
 * -ffast-math (which would reorder the arithmetic); SiLU's exp is written with AVX2 intrinsics
 * where the compiler targets AVX2 (same operations, same results as the scalar form).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

/* Residual add + RMSNorm (Zhang & Sennrich 2019; transformers' LlamaRMSNorm):
 *   h[r, :] += delta[r, :]                              (only if delta != NULL)
 *   out[r, :] = w * (h[r, :] * (1 / sqrt(mean(h[r, :]^2) + eps)))
 * h, delta, out: [rows, dim] contiguous; w: [dim] (Gemma's (1 + w) already folded in). */
void pd_add_rms_norm(float *restrict h, const float *restrict delta, float *restrict out,
                     const float *restrict w,
                     int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim;
        float *o = out + r * dim;
        if (delta != NULL) {
            const float *d = delta + r * dim;
            for (int64_t j = 0; j < dim; j++) hr[j] = hr[j] + d[j];
        }
        float acc[LANES] = {0};
        int64_t j = 0;
        for (; j + LANES <= dim; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += hr[j + l] * hr[j + l];
        float sum = 0.0f;
        for (; j < dim; j++) sum += hr[j] * hr[j];
        for (int l = 0; l < LANES; l++) sum += acc[l];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (j = 0; j < dim; j++) o[j] = w[j] * (hr[j] * inv);
    }
}

/* RoPE with rotate_half (Su et al. 2021; transformers' apply_rotary_pos_emb):
 *   y = x * cos + cat(-x2, x1) * sin,  x = cat(x1, x2), each half d/2 long
 * on d values from x into y (distinct memory: restrict lets the loop vectorise). */
static inline void rope_head(const float *restrict x, float *restrict y,
                             const float *restrict c, const float *restrict s,
                             int64_t half) {
    for (int64_t j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        y[j] = x1 * c[j] - x2 * s[j];
        y[j + half] = x2 * c[j + half] + x1 * s[j + half];
    }
}

/* RoPE on q in place and on k, and the new tokens' K/V written into the paged store:
 *   q[t, h, :]            = rope(q[t, h, :])      for h < hq
 *   k_store[h, slot_t, :] = rope(k[t, h, :])      for h < hkv
 *   v_store[h, slot_t, :] = v[t, h, :]
 * q, k, v: rows t of n, row strides *_stride floats, heads d apart (views of the fused QKV
 * output); cos, sin: [n, d] contiguous; k_store, v_store: one layer's [hkv, NB * B, d], head
 * stride store_head_stride floats; slots: [n] flat token positions (block * B + offset). */
void pd_rope_kv(float *q, int64_t q_stride, const float *k, int64_t k_stride,
                const float *v, int64_t v_stride, const float *cos, const float *sin,
                int64_t n, int64_t hq, int64_t hkv, int64_t d,
                float *k_store, float *v_store, int64_t store_head_stride,
                const int64_t *slots) {
    int64_t half = d / 2;
    float tmp[d];  /* q's head, copied so that rope_head's input and output never alias */
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        float *qt = q + t * q_stride;
        for (int64_t h = 0; h < hq; h++) {
            memcpy(tmp, qt + h * d, (size_t)d * sizeof(float));
            rope_head(tmp, qt + h * d, c, s, half);
        }
        int64_t slot = slots[t];
        for (int64_t h = 0; h < hkv; h++) {
            rope_head(k + t * k_stride + h * d, k_store + h * store_head_stride + slot * d,
                      c, s, half);
            memcpy(v_store + h * store_head_stride + slot * d, v + t * v_stride + h * d,
                   (size_t)d * sizeof(float));
        }
    }
}

/* e^x for x in [-87, 88] (clamped), Cephes' expf: x = n ln2 + r, e^r by a degree-6
 * polynomial, times 2^n built in the exponent bits. Relative error ~1e-7. */
static inline float pd_expf(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return y * scale.f;
}

/* SwiGLU's product (Shazeer 2020; transformers' LlamaMLP act_fn(gate) * up with SiLU):
 *   out[r, j] = (g / (1 + e^-g)) * up,  g = gu[r, j], up = gu[r, inter + j]
 * gu: [rows, 2 * inter] contiguous (the fused gate/up output); out: [rows, inter]. */
#if defined(__AVX2__)
#include <immintrin.h>
/* pd_expf on 8 lanes, the same operations in the same order (so equal results); written
 * with intrinsics because the compiler, left to itself, splits the clamps into branches. */
static inline __m256 pd_expf8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

void pd_silu_mul(const float *restrict gu, float *restrict out, int64_t rows,
                 int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t j = 0;
#if defined(__AVX2__)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= inter; j += 8) {
            __m256 gj = _mm256_loadu_ps(g + j);
            __m256 e = pd_expf8(_mm256_xor_ps(gj, sign));  /* e^-g */
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gj, _mm256_add_ps(one, e)),
                                                  _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; j++) o[j] = (g[j] / (1.0f + pd_expf(-g[j]))) * u[j];
    }
}
