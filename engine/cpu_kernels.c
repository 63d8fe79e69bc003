/* pdlab's fused elementwise kernels for the CPU float32 forward (engine/cpu_kernels.py builds
 * this file with the system C compiler and calls it through ctypes; engine/runner.py uses it).
 *
 * Each function replaces a chain of small torch ops of one decoder layer by one pass over
 * contiguous float32 rows, on the calling thread. The arithmetic is the modules' own, op by
 * op, in the same order (built with -ffp-contract=off so no multiply-add is fused), so the
 * results equal transformers' to float32 rounding: RMSNorm differs only in the order of the
 * sum of squares, SiLU only in exp's last bits (a Cephes-style polynomial here, Sleef's in
 * torch), RoPE and the K/V copy not at all (bit for bit). Loops over LANES independent
 * accumulators let the compiler vectorise without -ffast-math (which would reorder the
 * arithmetic); SiLU's exp is written with AVX2 intrinsics where the compiler targets AVX2
 * (same operations, same results as the scalar form).
 *
 * Two more replace torch kernels rather than module ops (at the end of this file): a GEMM for
 * decode-sized row counts and decode attention. They use explicit FMA intrinsics (not
 * affected by -ffp-contract=off) and sum in their own order, so they agree with torch's
 * kernels to float32 rounding, as torch's own kernels (MKL, oneDNN) agree with each other.
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
    /* constant first: min/max return their second operand when one is NaN, so NaN stays
     * NaN (as in the scalar form's comparisons and in torch) instead of becoming e^88 */
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
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

/* Linear layer y = x @ W.T + bias for a few rows (decode batches), float32:
 *   x: [m, k] rows ldx apart, each contiguous; W: [n, k] as stored by torch.nn.Linear;
 *   y: [m, n] contiguous; bias: [n] or NULL.
 * W is packed once (pd_pack_linear) into panels of PD_PANEL output columns, [ceil(n / 16)][k]
 * [16], zero padded, so the kernel streams each panel contiguously. Each panel is multiplied
 * by blocks of at most 6 rows (balanced: 16 rows = 6 + 5 + 5) held in 6 x 2 AVX2
 * accumulators, the register blocking of BLIS's Haswell sgemm (6 x 16); the next panel is
 * prefetched while the first block runs (unless the caller asks not to: pd_linear), because
 * at decode sizes the weights stream from DRAM. Each output is bias + sum over k in order,
 * fused multiply-adds (an explicit FMA is not affected by -ffp-contract=off); torch's sgemm
 * sums in another order, so results agree to float32 rounding (~1e-6 of the output scale), as
 * oneDNN's and MKL's do with each other.
 * Without AVX2/FMA the same loops run in scalar C (pd_linear_vectorized() returns 0 and the
 * runner keeps torch's kernels). */
#define PD_PANEL 16
#define PD_MAX_ROWS 6

void pd_pack_linear(const float *restrict w, float *restrict panels, int64_t n, int64_t k) {
    for (int64_t j = 0; j < (n + PD_PANEL - 1) / PD_PANEL; j++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < PD_PANEL; c++) {
                int64_t col = j * PD_PANEL + c;
                panels[(j * k + kk) * PD_PANEL + c] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* One register block of a GEMM (PD_BLOCKS: AVX2 6 x 16; PD_BLOCKS512: AVX-512 12 x 32):
 * (x, ldx, panel, k, bias, y, ldy, cols, prefetch), the signature of PD_BLOCK below. */
typedef void (*pd_block_fn)(const float *, int64_t, const float *, int64_t, const float *,
                            float *, int64_t, int64_t, const float *);

#if defined(__AVX2__) && defined(__FMA__)
int pd_linear_vectorized(void) { return 1; }
#define PD_UNROLL _Pragma("GCC unroll 8")
/* One block of MR rows times one panel; every loop over r is unrolled so the accumulators
 * stay in registers (a loop the compiler keeps rolled spills them to the stack). */
#define PD_BLOCK(MR)                                                                        \
static void pd_block##MR(const float *restrict x, int64_t ldx, const float *restrict p,    \
                         int64_t k, const float *restrict bias, float *restrict y,          \
                         int64_t ldy, int64_t cols, const float *prefetch) {                \
    __m256 lo[MR], hi[MR];                                                                  \
    PD_UNROLL for (int r = 0; r < MR; r++) {                                                \
        lo[r] = _mm256_loadu_ps(bias);                                                      \
        hi[r] = _mm256_loadu_ps(bias + 8);                                                  \
    }                                                                                       \
    for (int64_t kk = 0; kk < k; kk++) {                                                    \
        if (prefetch) _mm_prefetch((const char *)(prefetch + kk * PD_PANEL), _MM_HINT_T0);  \
        const float *row = p + kk * PD_PANEL;                                               \
        __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);                    \
        PD_UNROLL for (int r = 0; r < MR; r++) {                                            \
            __m256 b = _mm256_broadcast_ss(x + r * ldx + kk);                               \
            lo[r] = _mm256_fmadd_ps(b, w0, lo[r]);                                          \
            hi[r] = _mm256_fmadd_ps(b, w1, hi[r]);                                          \
        }                                                                                   \
    }                                                                                       \
    if (cols == PD_PANEL) {                                                                 \
        PD_UNROLL for (int r = 0; r < MR; r++) {                                            \
            _mm256_storeu_ps(y + r * ldy, lo[r]);                                           \
            _mm256_storeu_ps(y + r * ldy + 8, hi[r]);                                       \
        }                                                                                   \
    } else {                                                                                \
        float tmp[MR][PD_PANEL];                                                            \
        PD_UNROLL for (int r = 0; r < MR; r++) {                                            \
            _mm256_storeu_ps(tmp[r], lo[r]);                                                \
            _mm256_storeu_ps(tmp[r] + 8, hi[r]);                                            \
        }                                                                                   \
        for (int r = 0; r < MR; r++) memcpy(y + r * ldy, tmp[r], cols * sizeof(float));     \
    }                                                                                       \
}
PD_BLOCK(1) PD_BLOCK(2) PD_BLOCK(3) PD_BLOCK(4) PD_BLOCK(5) PD_BLOCK(6)
static const pd_block_fn PD_BLOCKS[PD_MAX_ROWS + 1] = {
    0, pd_block1, pd_block2, pd_block3, pd_block4, pd_block5, pd_block6};
#else
int pd_linear_vectorized(void) { return 0; }
static void pd_block_scalar(int64_t mr, const float *x, int64_t ldx, const float *p, int64_t k,
                            const float *bias, float *y, int64_t ldy, int64_t cols) {
    for (int64_t r = 0; r < mr; r++)
        for (int64_t c = 0; c < cols; c++) {
            float acc = bias[c];
            for (int64_t kk = 0; kk < k; kk++)
                acc = fmaf(x[r * ldx + kk], p[kk * PD_PANEL + c], acc);
            y[r * ldy + c] = acc;
        }
}
#endif

/* Rows are taken PD_X_BLOCK_BYTES of x at a time: every panel against one row block, then
 * the next block. Without it a prefill's x (thousands of rows: 4.7 MB at 2048 x 576) streams
 * from L3 once per 16-column panel, and the kernel fell from ~36 GFLOP/s at 512 rows to ~27
 * at 2048 on an AMD Zen 1 core (512 KiB L2), where oneDNN held ~34. A row block stays in L2
 * while the panels pass; each panel is re-read once per block, little traffic at these
 * compute-bound sizes. 192 KiB: well under the smallest L2 seen (512 KiB, Zen 1 and Zen 3).
 * Every output's sum runs in the same order, so results are unchanged bit for bit, and
 * decode batches (a few rows: one block) run exactly as before. */
#define PD_X_BLOCK_BYTES (192 * 1024)
static int64_t pd_row_block(int64_t k, int64_t block_rows) {
    int64_t rows = PD_X_BLOCK_BYTES / (4 * (k > 0 ? k : 1));
    rows -= rows % block_rows;
    return rows < block_rows ? block_rows : rows;
}

static void pd_linear_rows(const float *restrict x, int64_t ldx, int64_t m, int64_t k,
                           const float *restrict panels, int64_t n, const float *restrict bias,
                           float *restrict y, int prefetch) {
    int64_t num_panels = (n + PD_PANEL - 1) / PD_PANEL;
    int64_t num_blocks = (m + PD_MAX_ROWS - 1) / PD_MAX_ROWS;
    for (int64_t j = 0; j < num_panels; j++) {
        int64_t cols = n - j * PD_PANEL < PD_PANEL ? n - j * PD_PANEL : PD_PANEL;
        const float *panel = panels + j * k * PD_PANEL;
        const float *next = prefetch && j + 1 < num_panels ? panel + k * PD_PANEL : NULL;
        float panel_bias[PD_PANEL] = {0};
        if (bias) memcpy(panel_bias, bias + j * PD_PANEL, cols * sizeof(float));
        for (int64_t block = 0, i = 0; block < num_blocks; block++) {
            int64_t left = num_blocks - block, mr = (m - i + left - 1) / left;  /* balanced */
#if defined(__AVX2__) && defined(__FMA__)
            PD_BLOCKS[mr](x + i * ldx, ldx, panel, k, panel_bias, y + i * n + j * PD_PANEL, n,
                          cols, block == 0 ? next : NULL);
#else
            (void)next;
            pd_block_scalar(mr, x + i * ldx, ldx, panel, k, panel_bias, y + i * n + j * PD_PANEL,
                            n, cols);
#endif
            i += mr;
        }
    }
}

/* prefetch 0: no software prefetch of the next panel, the hardware prefetcher alone (on an
 * AMD Zen 3 core a 1-row decode read its weights from DRAM 25% faster so, and 4-16 rows
 * 9-20% slower: the selector measures both, as the candidates "pdlab" and "pdlab-hwpf").
 * Prefetching changes no result. */
void pd_linear(const float *restrict x, int64_t ldx, int64_t m, int64_t k,
               const float *restrict panels, int64_t n, const float *restrict bias,
               float *restrict y, int64_t prefetch) {
    int64_t rows = pd_row_block(k, PD_MAX_ROWS);
    for (int64_t i = 0; i < m; i += rows)
        pd_linear_rows(x + i * ldx, ldx, m - i < rows ? m - i : rows, k, panels, n, bias,
                       y + i * n, prefetch != 0);
}

/* The same linear layer with AVX-512 (pd_linear512), for CPUs that have avx512f: W packed
 * (pd_pack_linear_width with PD_PANEL512 = 32) into panels of 32 output columns, [ceil(n /
 * 32)][k][32], multiplied by blocks of at most 12 rows (balanced, as above) held in 12 x 2
 * zmm accumulators (24 of the 32 registers, plus the two weight vectors): the register
 * blocking of BLIS's Skylake-X sgemm (32 x 12) with the roles of the operands as in the
 * AVX2 kernel (weights loaded, x broadcast; the broadcast folds into the FMA's memory
 * operand). Each output is again bias + sum over k in order with one FMA per term, so its
 * results equal pd_linear's bit for bit. The functions are compiled for avx512f by a target
 * attribute, not by the build's -march, so the library still builds for an AVX2-only CPU;
 * pd_linear512_available() says whether this CPU runs them (cpuid), and is 0 where the
 * build leaves them out (PD_NO_AVX512: PDLAB_CPU_KERNELS_ISA=avx2, or not x86-64 GCC/clang). */
#define PD_PANEL512 32
#define PD_MAX_ROWS512 12

void pd_pack_linear_width(const float *restrict w, float *restrict panels, int64_t n,
                          int64_t k, int64_t width) {
    for (int64_t j = 0; j < (n + width - 1) / width; j++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < width; c++) {
                int64_t col = j * width + c;
                panels[(j * k + kk) * width + c] = col < n ? w[col * k + kk] : 0.0f;
            }
}

#if defined(PD_EMULATE_AVX512)
/* Tests only (PDLAB_CPU_KERNELS_ISA=avx512-emulated, `make test-avx512-emulated`): the
 * AVX-512 functions below on SIMDe's portable _mm512 intrinsics (github.com/simd-everywhere/
 * simde; -I its headers), so a CPU without avx512f runs them and the kernel tests check their
 * results; pd_linear512_available() says 1 on any CPU. Never built for a run: each zmm
 * operation becomes two ymm ones or a loop, slower than the AVX2 kernels. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
/* Where SIMDe 0.8.2 is not the instruction, the instruction written out lane by lane:
 * its masked store writes 0 to the lanes outside the mask (past a buffer's end, too), its
 * masked load reads them, and it has no _mm512_reduce_add_ps (GCC's order: halves first). */
static inline void pd_mask_storeu16(void *p, simde__mmask16 m, simde__m512 v) {
    float a[16];
    simde_mm512_storeu_ps(a, v);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) ((float *)p)[i] = a[i];
}
static inline simde__m512 pd_maskz_loadu16(simde__mmask16 m, const void *p) {
    float a[16];
    for (int i = 0; i < 16; i++) a[i] = m >> i & 1 ? ((const float *)p)[i] : 0.0f;
    return simde_mm512_loadu_ps(a);
}
static inline float pd_reduce_add16(simde__m512 v) {
    float a[16], t[8], u[4];
    simde_mm512_storeu_ps(a, v);
    for (int i = 0; i < 8; i++) t[i] = a[i + 8] + a[i];
    for (int i = 0; i < 4; i++) u[i] = t[i + 4] + t[i];
    return (u[0] + u[2]) + (u[1] + u[3]);
}
#undef _mm512_mask_storeu_ps
#undef _mm512_maskz_loadu_ps
#undef _mm512_reduce_add_ps
#define _mm512_mask_storeu_ps pd_mask_storeu16
#define _mm512_maskz_loadu_ps pd_maskz_loadu16
#define _mm512_reduce_add_ps pd_reduce_add16
#define PD_AVX512
#define PD_HAS_AVX512_CODE 1
int pd_linear512_available(void) { return 1; }
#elif !defined(PD_NO_AVX512) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PD_AVX512 __attribute__((target("avx512f")))
#define PD_HAS_AVX512_CODE 1
int pd_linear512_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#endif
#if defined(PD_HAS_AVX512_CODE)
#define PD_UNROLL12 _Pragma("GCC unroll 12")
#define PD_BLOCK512(MR)                                                                     \
PD_AVX512 static void pd_block512_##MR(const float *restrict x, int64_t ldx,               \
                                       const float *restrict p, int64_t k,                  \
                                       const float *restrict bias, float *restrict y,       \
                                       int64_t ldy, int64_t cols, const float *prefetch) {  \
    __m512 lo[MR], hi[MR];                                                                  \
    PD_UNROLL12 for (int r = 0; r < MR; r++) {                                              \
        lo[r] = _mm512_loadu_ps(bias);                                                      \
        hi[r] = _mm512_loadu_ps(bias + 16);                                                 \
    }                                                                                       \
    for (int64_t kk = 0; kk < k; kk++) {                                                    \
        if (prefetch) {                                                                     \
            _mm_prefetch((const char *)(prefetch + kk * PD_PANEL512), _MM_HINT_T0);         \
            _mm_prefetch((const char *)(prefetch + kk * PD_PANEL512 + 16), _MM_HINT_T0);    \
        }                                                                                   \
        const float *row = p + kk * PD_PANEL512;                                            \
        __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);                   \
        PD_UNROLL12 for (int r = 0; r < MR; r++) {                                          \
            __m512 b = _mm512_set1_ps(x[r * ldx + kk]);                                     \
            lo[r] = _mm512_fmadd_ps(b, w0, lo[r]);                                          \
            hi[r] = _mm512_fmadd_ps(b, w1, hi[r]);                                          \
        }                                                                                   \
    }                                                                                       \
    if (cols == PD_PANEL512) {                                                              \
        PD_UNROLL12 for (int r = 0; r < MR; r++) {                                          \
            _mm512_storeu_ps(y + r * ldy, lo[r]);                                           \
            _mm512_storeu_ps(y + r * ldy + 16, hi[r]);                                      \
        }                                                                                   \
    } else { /* a partial last panel: masked stores of its first cols columns */            \
        __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);                 \
        __mmask16 m1 = (__mmask16)(cols <= 16 ? 0 : (1u << (cols - 16)) - 1);              \
        PD_UNROLL12 for (int r = 0; r < MR; r++) {                                          \
            _mm512_mask_storeu_ps(y + r * ldy, m0, lo[r]);                                  \
            _mm512_mask_storeu_ps(y + r * ldy + 16, m1, hi[r]);                             \
        }                                                                                   \
    }                                                                                       \
}
PD_BLOCK512(1) PD_BLOCK512(2) PD_BLOCK512(3) PD_BLOCK512(4) PD_BLOCK512(5) PD_BLOCK512(6)
PD_BLOCK512(7) PD_BLOCK512(8) PD_BLOCK512(9) PD_BLOCK512(10) PD_BLOCK512(11) PD_BLOCK512(12)
static const pd_block_fn PD_BLOCKS512[PD_MAX_ROWS512 + 1] = {
    0, pd_block512_1, pd_block512_2, pd_block512_3, pd_block512_4, pd_block512_5,
    pd_block512_6, pd_block512_7, pd_block512_8, pd_block512_9, pd_block512_10,
    pd_block512_11, pd_block512_12};

/* pd_linear512 on one block of rows (every panel against them). */
PD_AVX512 static void pd_linear512_rows(const float *restrict x, int64_t ldx, int64_t m,
                                        int64_t k, const float *restrict panels, int64_t n,
                                        const float *restrict bias, float *restrict y) {
    int64_t num_panels = (n + PD_PANEL512 - 1) / PD_PANEL512;
    int64_t num_blocks = (m + PD_MAX_ROWS512 - 1) / PD_MAX_ROWS512;
    for (int64_t j = 0; j < num_panels; j++) {
        int64_t cols = n - j * PD_PANEL512 < PD_PANEL512 ? n - j * PD_PANEL512 : PD_PANEL512;
        const float *panel = panels + j * k * PD_PANEL512;
        const float *next = j + 1 < num_panels ? panel + k * PD_PANEL512 : NULL;
        float panel_bias[PD_PANEL512] = {0};
        if (bias) memcpy(panel_bias, bias + j * PD_PANEL512, cols * sizeof(float));
        for (int64_t block = 0, i = 0; block < num_blocks; block++) {
            int64_t left = num_blocks - block, mr = (m - i + left - 1) / left;  /* balanced */
            PD_BLOCKS512[mr](x + i * ldx, ldx, panel, k, panel_bias,
                             y + i * n + j * PD_PANEL512, n, cols, block == 0 ? next : NULL);
            i += mr;
        }
    }
}

/* x: [m, k] rows ldx apart; panels: pd_pack_linear_width(W, ., n, k, 32); y: [m, n]
 * contiguous; bias: [n] or NULL; rows in blocks of PD_X_BLOCK_BYTES of x, as pd_linear.
 * Returns 0, or -1 with nothing written where this CPU or build has no AVX-512 (the caller
 * checks pd_linear512_available() first). */
int pd_linear512(const float *restrict x, int64_t ldx, int64_t m, int64_t k,
                 const float *restrict panels, int64_t n, const float *restrict bias,
                 float *restrict y) {
    if (!pd_linear512_available()) return -1;
    int64_t rows = pd_row_block(k, PD_MAX_ROWS512);
    for (int64_t i = 0; i < m; i += rows)
        pd_linear512_rows(x + i * ldx, ldx, m - i < rows ? m - i : rows, k, panels, n, bias,
                          y + i * n);
    return 0;
}
#else
int pd_linear512_available(void) { return 0; }
int pd_linear512(const float *restrict x, int64_t ldx, int64_t m, int64_t k,
                 const float *restrict panels, int64_t n, const float *restrict bias,
                 float *restrict y) {
    (void)x; (void)ldx; (void)m; (void)k; (void)panels; (void)n; (void)bias; (void)y;
    return -1;
}
#endif

/* Paged decode attention (vLLM's paged attention, for one query token per request): for
 * KV head h the `group` query heads (GQA) of request r attend over its first lens[r] cached
 * tokens, read in place from the paged store through its block table:
 *   out[r, h*G + g, :] = softmax(scale * K q^T) V,  q = q[r, h*G + g, :],
 *   token t of request r: k_cache/v_cache + h * head_stride
 *                         + (block_tables[r, t / block_size] * block_size + t % block_size) * dim
 * k_cache, v_cache: one layer's K and V, [H_kv, num_blocks, block_size, dim] (head_stride =
 * num_blocks * block_size * dim); block_tables [rows, max_blocks] int64; q rows q_row_stride
 * apart, heads dim apart; out [rows, kv_heads * group, dim] contiguous; scores: a workspace
 * of group * max(lens) floats. Returns 0, or -1 with nothing written when a lens[r] is outside
 * 1 .. max_blocks * block_size or a block it reads is outside 0 .. num_blocks - 1.
 * The softmax is the exact form (max subtracted, exp, sum, one division), not a flash
 * kernel's online form, so results agree with torch's SDPA to float32 rounding. Why not
 * torch: its CPU flash kernel blocks queries by 32+ rows and a decode row has `group` (3
 * for SmolLM2) per KV head, so it ran at ~7-17 GFLOP/s, and a request's blocks had to be
 * one strided view or gathered (benchmarks/README.md, "A GEMM kernel for decode rows"). */
static inline float pd_dot(const float *a, const float *b, int64_t dim) {
    int64_t d = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; d + 16 <= dim; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    if (d + 8 <= dim) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        d += 8;
    }
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sum = _mm_cvtss_f32(s);
#endif
    for (; d < dim; d++) sum = fmaf(a[d], b[d], sum);
    return sum;
}

/* out[0:dim] += sum_t p[t] * v[t * dim : (t + 1) * dim], t < len */
static inline void pd_weighted_sum(const float *restrict p, const float *restrict v,
                                   int64_t len, int64_t dim, float *restrict out) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 32 <= dim; d += 32) {  /* 4 accumulators of 8 dims: one pass over v */
        __m256 a0 = _mm256_loadu_ps(out + d), a1 = _mm256_loadu_ps(out + d + 8);
        __m256 a2 = _mm256_loadu_ps(out + d + 16), a3 = _mm256_loadu_ps(out + d + 24);
        for (int64_t t = 0; t < len; t++) {
            const float *row = v + t * dim + d;
            __m256 w = _mm256_broadcast_ss(p + t);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), a3);
        }
        _mm256_storeu_ps(out + d, a0);
        _mm256_storeu_ps(out + d + 8, a1);
        _mm256_storeu_ps(out + d + 16, a2);
        _mm256_storeu_ps(out + d + 24, a3);
    }
    for (; d + 8 <= dim; d += 8) {
        __m256 a0 = _mm256_loadu_ps(out + d);
        for (int64_t t = 0; t < len; t++)
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(v + t * dim + d), a0);
        _mm256_storeu_ps(out + d, a0);
    }
#endif
    for (; d < dim; d++) {
        float acc = out[d];
        for (int64_t t = 0; t < len; t++) acc = fmaf(p[t], v[t * dim + d], acc);
        out[d] = acc;
    }
}

/* s[0:len] = softmax(s[0:len]) in place: e^(s - max) / sum (the sum in 8 partial lanes) */
static inline void pd_softmax(float *s, int64_t len) {
    float top = s[0], sum = 0.0f;
    for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; t + 8 <= len; t += 8) {
        __m256 e = pd_expf8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; t < len; t++) {
        s[t] = pd_expf(s[t] - top);
        sum += s[t];
    }
    float inv = 1.0f / sum;
    for (t = 0; t < len; t++) s[t] *= inv;
}

/* s[g * ld + o] = scale * (q_g . K_o) for keys o < n of one KV block (K_o = block + o * dim)
 * and query heads g < group (q_g = q + g * dim). Eight keys at a time, one accumulator per key
 * over dim and one horizontal-add tree per 8 dots: a dot of SmolLM2's 64 dims is only 8 FMAs,
 * so pd_dot's horizontal sum per dot cost about as much as the dot itself.
 * benchmarks.decode_attention on a Zen 3 core: 0.83x the time at B = 16 with K/V in cache;
 * 0.99x with K/V evicted, as in a decode step, where DRAM decides (~10 GB/s; a software
 * prefetch of the next block, tried, was slower there: a request's blocks are mostly
 * consecutive and the hardware prefetcher follows them). Other keys (a block's last n % 8,
 * dims not a multiple of 8): pd_dot. */
static inline void pd_block_scores(const float *q, const float *block, int64_t n,
                                   int64_t group, int64_t dim, float scale,
                                   float *restrict s, int64_t ld) {
    int64_t o = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; o + 8 <= n; o += 8) {
            const float *k = block + o * dim;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * dim;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
                       a6 = a0, a7 = a0;
                for (int64_t d = 0; d < dim; d += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + d);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + dim + d), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * dim + d), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * dim + d), a3);
                    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * dim + d), a4);
                    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * dim + d), a5);
                    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * dim + d), a6);
                    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * dim + d), a7);
                }
                /* lanes of hadd(hadd(a0, a1), hadd(a2, a3)): per 128-bit half, the partial
                 * sums of keys 0-3 (low half: lanes 0-3 of each a, high: lanes 4-7) */
                __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
                __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                            _mm256_permute2f128_ps(lo, hi, 0x31));
                _mm256_storeu_ps(s + g * ld + o, _mm256_mul_ps(vscale, sums));
            }
        }
    }
#endif
    for (; o < n; o++)
        for (int64_t g = 0; g < group; g++)
            s[g * ld + o] = scale * pd_dot(q + g * dim, block + o * dim, dim);
}

int pd_paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_cache,
                              const float *v_cache, int64_t head_stride, int64_t num_blocks,
                              int64_t block_size, const int64_t *restrict block_tables,
                              int64_t max_blocks, const int64_t *restrict lens, int64_t rows,
                              int64_t kv_heads, int64_t group, int64_t dim, float scale,
                              float *restrict scores, float *restrict out) {
    for (int64_t r = 0; r < rows; r++) {
        if (lens[r] < 1 || lens[r] > max_blocks * block_size) return -1;
        for (int64_t i = 0; i < (lens[r] + block_size - 1) / block_size; i++) {
            int64_t block = block_tables[r * max_blocks + i];
            if (block < 0 || block >= num_blocks) return -1;
        }
    }
    const int64_t block_floats = block_size * dim;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = lens[r], *table = block_tables + r * max_blocks;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *keys = k_cache + h * head_stride, *values = v_cache + h * head_stride;
            const float *qh = q + r * q_row_stride + h * group * dim;
            float *oh = out + (r * kv_heads + h) * group * dim;
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const float *block = keys + table[t0 / block_size] * block_floats;
                int64_t n = len - t0 < block_size ? len - t0 : block_size;
                pd_block_scores(qh, block, n, group, dim, scale, scores + t0, len);
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * len, *og = oh + g * dim;
                pd_softmax(s, len);
                memset(og, 0, dim * sizeof(float));
                for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                    int64_t n = len - t0 < block_size ? len - t0 : block_size;
                    pd_weighted_sum(s + t0, values + table[t0 / block_size] * block_floats, n,
                                    dim, og);
                }
            }
        }
    }
    return 0;
}

/* Causal attention of one prompt chunk on the GEMM blocks (pd_causal_attention with the
 * AVX2 6 x 16 blocks, pd_causal_attention512 with the AVX-512 12 x 32 blocks):
 * n queries at positions start .. start + n - 1 over ctx = start + n keys of their request;
 * query i sees keys 0 .. start + i:
 *   out[i, h*G + g, :] = softmax(scale * q_i K^T over keys <= start + i) V,
 *   q_i = q[i, h*G + g, :],  K, V = k / v + h * kv_head_stride  ([ctx, dim], rows dim apart)
 * q: rows q_row_stride apart, heads dim apart; out [n, kv_heads * group, dim] contiguous.
 * With W the blocks' panel width (16 or 32) and R their most rows (6 or 12): per KV head, K
 * is packed once into W-key panels (kpack: [ceil(ctx/W)][dim][W]) and V into W-dim panels
 * (vpack: [ceil(dim/W)][ctx][W]); then per query head and block of at most R query rows: the
 * scores of the keys the block's last row sees (R x W blocks, one FMA per term, the sum over
 * dim in order), the exact softmax of each row over its own keys (the keys past a row's end
 * set to 0), and P V over the block's keys (R x W blocks again). So the work follows the
 * causal FLOPs, and a block's scores (R x ctx) stay in L1/L2. scores: a workspace of
 * R * ceil(ctx/W) * W floats. Agrees with torch's SDPA to float32 rounding (another
 * summation order). Returns 0, or -1 with nothing written where this CPU/build lacks the
 * ISA. */
static void pd_causal_blocks(const float *q, int64_t q_row_stride, const float *k,
                             const float *v, int64_t kv_head_stride, int64_t n, int64_t start,
                             int64_t kv_heads, int64_t group, int64_t dim, float scale,
                             float *restrict kpack, float *restrict vpack,
                             float *restrict scores, float *restrict out, int64_t width,
                             int64_t max_rows, const pd_block_fn *blocks,
                             void (*softmax)(float *, int64_t, float)) {
    static const float zeros[32] = {0};  /* the blocks' bias: width <= 32 */
    const int64_t ctx = start + n, key_panels = (ctx + width - 1) / width;
    const int64_t dim_panels = (dim + width - 1) / width;
    const int64_t ld = key_panels * width, hq = kv_heads * group;
    for (int64_t h = 0; h < kv_heads; h++) {
        pd_pack_linear_width(k + h * kv_head_stride, kpack, ctx, dim, width);
        const float *vh = v + h * kv_head_stride;  /* vpack[p][t][c] = V[t][W p + c] */
        for (int64_t p = 0; p < dim_panels; p++)
            for (int64_t t = 0; t < ctx; t++)
                for (int64_t c = 0; c < width; c++)
                    vpack[(p * ctx + t) * width + c] =
                        width * p + c < dim ? vh[t * dim + width * p + c] : 0.0f;
        for (int64_t g = 0; g < group; g++) {
            const int64_t head = h * group + g;
            const int64_t num_blocks = (n + max_rows - 1) / max_rows;
            for (int64_t block = 0, i = 0; block < num_blocks; block++) {
                int64_t left = num_blocks - block, mr = (n - i + left - 1) / left;
                int64_t keys = start + i + mr;  /* the block's last row sees keys < this */
                for (int64_t p = 0; p * width < keys; p++)
                    blocks[mr](q + i * q_row_stride + head * dim, q_row_stride,
                               kpack + p * dim * width, dim, zeros, scores + p * width, ld,
                               width, NULL);
                for (int64_t r = 0; r < mr; r++) {
                    float *s = scores + r * ld;
                    int64_t len = start + i + r + 1;
                    softmax(s, len, scale);
                    for (int64_t t = len; t < keys; t++) s[t] = 0.0f;
                }
                for (int64_t p = 0; p < dim_panels; p++) {
                    int64_t cols = dim - p * width < width ? dim - p * width : width;
                    blocks[mr](scores, ld, vpack + p * ctx * width, keys, zeros,
                               out + i * hq * dim + head * dim + p * width, hq * dim, cols,
                               NULL);
                }
                i += mr;
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* s[0:len] = softmax(scale * s[0:len]) in place on 8 lanes (pd_softmax after the scale) */
static void pd_softmax_scaled(float *s, int64_t len, float scale) {
    const __m256 k = _mm256_set1_ps(scale);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8)
        _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), k));
    for (; t < len; t++) s[t] *= scale;
    pd_softmax(s, len);
}

int pd_causal_attention(const float *q, int64_t q_row_stride, const float *k, const float *v,
                        int64_t kv_head_stride, int64_t n, int64_t start, int64_t kv_heads,
                        int64_t group, int64_t dim, float scale, float *restrict kpack,
                        float *restrict vpack, float *restrict scores, float *restrict out) {
    pd_causal_blocks(q, q_row_stride, k, v, kv_head_stride, n, start, kv_heads, group, dim,
                     scale, kpack, vpack, scores, out, PD_PANEL, PD_MAX_ROWS, PD_BLOCKS,
                     pd_softmax_scaled);
    return 0;
}
#else
int pd_causal_attention(const float *q, int64_t q_row_stride, const float *k, const float *v,
                        int64_t kv_head_stride, int64_t n, int64_t start, int64_t kv_heads,
                        int64_t group, int64_t dim, float scale, float *kpack, float *vpack,
                        float *scores, float *out) {
    (void)q; (void)q_row_stride; (void)k; (void)v; (void)kv_head_stride; (void)n; (void)start;
    (void)kv_heads; (void)group; (void)dim; (void)scale; (void)kpack; (void)vpack;
    (void)scores; (void)out;
    return -1;
}
#endif

#if defined(PD_HAS_AVX512_CODE)
/* pd_expf on 16 lanes: pd_expf8's operations in the same order, so equal results lane by lane */
PD_AVX512 static inline __m512 pd_expf16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);  /* constant first: NaN stays NaN */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));  /* (): SIMDe shifts it unbracketed */
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 z = _mm512_mul_ps(r, r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

/* s[0:len] = softmax(scale * s[0:len]) in place, every pass on 16 lanes (a prompt chunk's
 * rows: the scalar passes of pd_softmax were about a quarter of the chunk attention's time
 * on a Zen 4 core); the tail lanes of the last vector are masked out of the max and sum. */
PD_AVX512 static void pd_softmax512(float *s, int64_t len, float scale) {
    const __m512 k = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + t), k);
        _mm512_storeu_ps(s + t, x);
        top = _mm512_max_ps(top, x);
    }
    __mmask16 tail = (__mmask16)((1u << (len - t)) - 1);
    if (tail) {
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + t), k);
        _mm512_mask_storeu_ps(s + t, tail, x);
        top = _mm512_mask_max_ps(top, tail, top, x);
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 acc = _mm512_setzero_ps();
    for (t = 0; t + 16 <= len; t += 16) {
        __m512 e = pd_expf16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
        _mm512_storeu_ps(s + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (tail) {
        __m512 e = pd_expf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), shift));
        _mm512_mask_storeu_ps(s + t, tail, e);
        acc = _mm512_mask_add_ps(acc, tail, acc, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(acc));
    for (t = 0; t + 16 <= len; t += 16)
        _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    if (tail)
        _mm512_mask_storeu_ps(s + t, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + t), inv));
}

int pd_causal_attention512(const float *q, int64_t q_row_stride, const float *k,
                           const float *v, int64_t kv_head_stride, int64_t n, int64_t start,
                           int64_t kv_heads, int64_t group, int64_t dim, float scale,
                           float *restrict kpack, float *restrict vpack,
                           float *restrict scores, float *restrict out) {
    if (!pd_linear512_available()) return -1;
    pd_causal_blocks(q, q_row_stride, k, v, kv_head_stride, n, start, kv_heads, group, dim,
                     scale, kpack, vpack, scores, out, PD_PANEL512, PD_MAX_ROWS512,
                     PD_BLOCKS512, pd_softmax512);
    return 0;
}
#else
int pd_causal_attention512(const float *q, int64_t q_row_stride, const float *k,
                           const float *v, int64_t kv_head_stride, int64_t n, int64_t start,
                           int64_t kv_heads, int64_t group, int64_t dim, float scale,
                           float *kpack, float *vpack, float *scores, float *out) {
    (void)q; (void)q_row_stride; (void)k; (void)v; (void)kv_head_stride; (void)n; (void)start;
    (void)kv_heads; (void)group; (void)dim; (void)scale; (void)kpack; (void)vpack;
    (void)scores; (void)out;
    return -1;
}
#endif
