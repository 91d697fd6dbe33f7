/* specsched's CPU kernels (runtime/cpu_kernels.py builds cpu_attention.c and cpu_kernels.c with the
 * platform's C compiler on first use into one library and loads it with ctypes; no Python or torch
 * headers): what both files share -- the step's attention plan, 16-float vectors, exp -- and the
 * functions they call across. */
#ifndef SPECSCHED_CPU_KERNELS_H
#define SPECSCHED_CPU_KERNELS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, page_size;
    const int32_t *qo_indptr, *kv_lens, *page_indptr, *page_indices;
    const int64_t *slot_mapping; /* [N] where each new token's K/V go: page * ps + offset */
    const uint8_t *mask;         /* NULL: causal */
    const int64_t *mask_offsets; /* [num_seqs] */
    int64_t max_kv;              /* the largest kv_len: the scores scratch */
    float scale;
} StepPlan;

/* exp(x), written so the compiler vectorises it: Cephes' expf polynomial after reducing by ln 2,
 * relative error ~1e-7; 0 below -87 (where expf is subnormal; a masked key's score is -inf and
 * its weight exactly 0), and exp(88) above 88. */
static inline float exp_f(float x) {
    const float c = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : y * scale;
}

/* 16 floats in one vector (one AVX-512 register; the compiler splits it where the CPU has
 * narrower ones); a head of d values is d / 16 of them. aligned(4): loads need no alignment. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define LANES 16

typedef int32_t vi16 __attribute__((vector_size(64)));

static inline v16 load16(const float *x) { return *(const v16 *)x; }

int specsched_paged_attention(const StepPlan *p, int64_t num_tokens, const float *q, int64_t q_stride,
                              const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                              float *out, int64_t out_stride, float *kv);

#endif
