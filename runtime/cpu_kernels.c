/* The decoder layer's small ops, a row at a time (specsched_rms_norm, with the residual add;
 * specsched_rope; specsched_silu_mul), linears over weights laid out in blocks of outputs
 * (specsched_linear), and a whole decoder layer made of them and cpu_attention.c's paged attention
 * in one call (specsched_decoder_layer). */
#include "cpu_kernels.h"

/* ---- the decoder layer's small ops, a row at a time ---- */

/* out[i] = s[i] / sqrt(mean(s^2) + eps) * w over rows of h values, s = x (+ residual, then also
 * written to `total`); rows x_stride / residual_stride floats apart, out and total contiguous. */
void specsched_rms_norm(int64_t n, int64_t h, const float *x, int64_t x_stride, const float *residual,
                        int64_t residual_stride, const float *w, float eps, float *total, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * h;
        const float *s = xr;
        if (residual) {
            const float *rr = residual + r * residual_stride;
            float *t = total + r * h;
#pragma omp simd
            for (int64_t i = 0; i < h; i++) t[i] = xr[i] + rr[i];
            s = t;
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < h; i++) sq += s[i] * s[i];
        const float inv = 1.0f / sqrtf(sq / (float)h + eps);
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = s[i] * inv * w[i];
    }
}

/* RoPE in place, Hugging Face's half-split convention: x [n, heads, d] (token rows x_stride
 * floats apart, heads contiguous), cos / sin_signed [n, d] (sin's first half negated):
 * x[i] <- x[i] cos[i] + x[i +- d/2] sin_signed[i]. */
void specsched_rope(int64_t n, int64_t heads, int64_t d, float *x, int64_t x_stride, const float *cos,
                    const float *sin_signed) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * d, *s = sin_signed + t * d;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *a = x + t * x_stride + hd * d, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float lo = a[i], hi = b[i];
                a[i] = lo * c[i] + hi * s[i];
                b[i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}

/* out [n, i] = silu(gate) * up for rows [gate | up] of 2i values, x_stride floats apart */
void specsched_silu_mul(int64_t n, int64_t i, const float *x, int64_t x_stride, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *g = x + r * x_stride, *u = g + i;
        float *o = out + r * i;
#pragma omp simd
        for (int64_t k = 0; k < i; k++) o[k] = g[k] / (1.0f + exp_f(-g[k])) * u[k];
    }
}

/* Linears: y [n, out] = x [n, in] W^T (+ bias) over W in blocks of LINEAR_BLOCK outputs,
 * [ceil(out / LINEAR_BLOCK), in, LINEAR_BLOCK] with the last block's missing outputs zero
 * (runtime/cpu_kernels.py blocked_weight). A tile of up to LINEAR_ROWS rows keeps a block's outputs
 * in registers while the block's weights stream past in order, each loaded once for the tile, so a
 * few rows cost about one pass over the weights and many rows run at the FMA units' pace; a block
 * is read from memory once for all the tiles (it stays in L2 between them). A row's result does
 * not depend on the other rows. */
#ifdef __AVX512F__
#define LINEAR_VECTORS 4 /* LINEAR_ROWS x LINEAR_VECTORS accumulators + the weights: 32 registers */
#define LINEAR_ROWS 6
#else
#define LINEAR_VECTORS 2 /* a v16 is two AVX2 registers: 16 of them */
#define LINEAR_ROWS 3
#endif
#define LINEAR_BLOCK (LINEAR_VECTORS * LANES)

int64_t specsched_linear_block(void) { return LINEAR_BLOCK; }

typedef int32_t vi16u __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) void linear_tile(const int rows, const int bf16, int64_t in,
                                                              const float *x, int64_t x_stride, const void *w,
                                                              v16 acc[LINEAR_ROWS][LINEAR_VECTORS]) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < LINEAR_VECTORS; j++) acc[r][j] = (v16){0};
    for (int64_t k = 0; k < in; k++) {
        v16 wk[LINEAR_VECTORS];
        if (bf16) { /* a pair of vectors' 32 bfloat16 weights in one load, interleaved: a float's
                     * top half each, the first vector's in the low halves of the 32-bit lanes */
            for (int j = 0; j < LINEAR_VECTORS; j += 2) {
                const vi16 pair = *(const vi16u *)((const uint16_t *)w + k * LINEAR_BLOCK + j * LANES);
                wk[j] = (v16)(pair << 16);
                wk[j + 1] = (v16)(pair & (int32_t)0xFFFF0000u);
            }
        } else {
            for (int j = 0; j < LINEAR_VECTORS; j++) wk[j] = load16((const float *)w + k * LINEAR_BLOCK + j * LANES);
        }
        for (int r = 0; r < rows; r++) {
            const float a = x[r * x_stride + k];
            for (int j = 0; j < LINEAR_VECTORS; j++) acc[r][j] += a * wk[j];
        }
    }
}

static inline __attribute__((always_inline)) void linear(const int bf16, int64_t n, int64_t in, int64_t out,
                                                         const float *x, int64_t x_stride, const void *blocked,
                                                         const float *bias, float *y) {
    for (int64_t o0 = 0; o0 < out; o0 += LINEAR_BLOCK) {
        const void *w = (const char *)blocked + o0 * in * (bf16 ? 2 : 4);
        const int64_t width = out - o0 < LINEAR_BLOCK ? out - o0 : LINEAR_BLOCK;
        for (int64_t r0 = 0; r0 < n; r0 += LINEAR_ROWS) {
            const int rows = n - r0 < LINEAR_ROWS ? (int)(n - r0) : LINEAR_ROWS;
            const float *xr = x + r0 * x_stride;
            v16 acc[LINEAR_ROWS][LINEAR_VECTORS];
            switch (rows) { /* a constant row count for each: the tile's loops unrolled */
#if LINEAR_ROWS > 3
                case 6: linear_tile(6, bf16, in, xr, x_stride, w, acc); break;
                case 5: linear_tile(5, bf16, in, xr, x_stride, w, acc); break;
                case 4: linear_tile(4, bf16, in, xr, x_stride, w, acc); break;
#endif
                case 3: linear_tile(3, bf16, in, xr, x_stride, w, acc); break;
                case 2: linear_tile(2, bf16, in, xr, x_stride, w, acc); break;
                default: linear_tile(1, bf16, in, xr, x_stride, w, acc); break;
            }
            for (int r = 0; r < rows; r++) {
                float tile[LINEAR_BLOCK];
                memcpy(tile, acc[r], sizeof tile);
                float *yr = y + (r0 + r) * out + o0;
                if (bias) {
                    for (int64_t o = 0; o < width; o++) yr[o] = tile[o] + bias[o0 + o];
                } else {
                    memcpy(yr, tile, (size_t)width * sizeof(float));
                }
            }
        }
    }
}

/* `blocked` holds floats (weight_bytes 4) or, where every weight is a bfloat16 value (a
 * checkpoint saved in bfloat16, run in float32), their bfloat16 bits (weight_bytes 2): the same
 * floats, so the same results, from half the memory. */
void specsched_linear(int64_t n, int64_t in, int64_t out, const float *x, int64_t x_stride, const void *blocked,
                      int64_t weight_bytes, const float *bias, float *y) {
    if (weight_bytes == 2)
        linear(1, n, in, out, x, x_stride, blocked, bias, y);
    else
        linear(0, n, in, out, x, x_stride, blocked, bias, y);
}

/* One decoder layer (pre-norm attention and SwiGLU MLP) over a step's n rows, as
 * runtime/decoder_layer.py runs it with the C ops above, in the same order, so bit for bit its
 * result: out [n, hidden] = x + attention + MLP (x's rows x_stride apart). cos / sin_signed: the
 * rows' RoPE tables [n, head_dim]; kv: the layer's pages; scratch: specsched_layer_scratch floats
 * a row. Returns the attention kernel's code (0: done). */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    const float *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *o, *gate_up, *down; /* blocked weights (specsched_linear), their bytes a weight: */
    int64_t qkv_bytes, o_bytes, gate_up_bytes, down_bytes;
    const float *qkv_bias, *o_bias; /* NULL: none */
} LayerWeights;

int64_t specsched_layer_scratch(const LayerWeights *w) {
    const int64_t qkv = (w->num_heads + 2 * w->num_kv_heads) * w->head_dim;
    return 4 * w->hidden + qkv + w->num_heads * w->head_dim + 3 * w->intermediate;
}

int specsched_decoder_layer(const LayerWeights *w, const StepPlan *p, int64_t n, const float *x, int64_t x_stride,
                            const float *cos, const float *sin_signed, float *kv, float *scratch, float *out) {
    const int64_t H = w->hidden, d = w->head_dim, hq = w->num_heads, hkv = w->num_kv_heads, I = w->intermediate;
    const int64_t qkv_w = (hq + 2 * hkv) * d, attn_w = hq * d;
    float *h = scratch, *qkv = h + n * H, *attn = qkv + n * qkv_w, *o = attn + n * attn_w, *total = o + n * H,
          *gate_up = total + n * H, *act = gate_up + n * 2 * I, *mlp = act + n * I;
    specsched_rms_norm(n, H, x, x_stride, NULL, 0, w->input_norm, w->eps, NULL, h);
    specsched_linear(n, H, qkv_w, h, H, w->qkv, w->qkv_bytes, w->qkv_bias, qkv);
    specsched_rope(n, hq + hkv, d, qkv, qkv_w, cos, sin_signed);
    const int rc = specsched_paged_attention(p, n, qkv, qkv_w, qkv + hq * d, qkv_w, qkv + (hq + hkv) * d, qkv_w,
                                             attn, attn_w, kv);
    if (rc != 0) return rc;
    specsched_linear(n, attn_w, H, attn, attn_w, w->o, w->o_bytes, w->o_bias, o);
    specsched_rms_norm(n, H, o, H, x, x_stride, w->post_norm, w->eps, total, h);
    specsched_linear(n, H, 2 * I, h, H, w->gate_up, w->gate_up_bytes, NULL, gate_up);
    specsched_silu_mul(n, I, gate_up, 2 * I, act);
    specsched_linear(n, I, H, act, I, w->down, w->down_bytes, NULL, mlp);
#pragma omp simd
    for (int64_t c = 0; c < n * H; c++) out[c] = total[c] + mlp[c];
    return 0;
}
