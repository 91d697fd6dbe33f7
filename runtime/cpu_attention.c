/* Paged attention for one step, reading the KV pages in place (specsched_paged_attention).
 *
 * Layout (the torch backend's "HND" pages): a layer's cache is [P, 2, Hkv, ps, D], so a page's
 * keys (c = 0) or values (c = 1) of one KV head are one contiguous [ps, D] block.
 * Sequence i has qo_len new tokens (rows qo_indptr[i] .. qo_indptr[i + 1] of q/k/v/out) and
 * kv_len KV tokens after this step's append, in pages page_indices[page_indptr[i] ..]. Its new
 * token t (0-based) sees keys [0, kv_len - qo_len + t] (causal), or with a mask exactly the
 * keys whose mask entry is 1 (mask: concatenation over i of [qo_len, kv_len] bytes, row-major,
 * sequence i's at mask_offsets[i]).
 *
 * Per sequence and KV head, its query rows (tokens x the head's query group) are attended in
 * tiles of up to four, so each key and value is loaded once for them: scores of 16 keys at a time
 * in vector registers, a softmax over them, then the weighted sum of values. A row's result
 * depends only on its own query, its keys and its mask, never on the other rows of the step:
 * a token verified among drafts attends exactly as when decoded alone.
 */
#include "cpu_kernels.h"

static void write_new_kv(const StepPlan *p, int64_t num_tokens, const float *k, int64_t k_stride,
                         const float *v, int64_t v_stride, float *kv) {
    const int64_t hkv = p->num_kv_heads, d = p->head_dim, ps = p->page_size;
    const int64_t block = ps * d; /* one head's keys (or values) in a page */
    for (int64_t n = 0; n < num_tokens; n++) {
        const int64_t page = p->slot_mapping[n] / ps, off = p->slot_mapping[n] % ps;
        float *kdst = kv + page * 2 * hkv * block + off * d;
        float *vdst = kdst + hkv * block;
        for (int64_t h = 0; h < hkv; h++) {
            memcpy(kdst + h * block, k + n * k_stride + h * d, d * sizeof(float));
            memcpy(vdst + h * block, v + n * v_stride + h * d, d * sizeof(float));
        }
    }
}

#define MAX_TILE 4      /* rows attended together */
#define MAX_VECTORS 8   /* head size up to 128 */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* lanes of a where `take` is -1, of b where it is 0 */
static inline v16 select16(vi16 take, v16 a, v16 b) { return (v16)(((vi16)a & take) | ((vi16)b & ~take)); }

static inline float sum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#define PREFETCH_AHEAD 2 /* chunks of LANES keys */

/* Ask for the rows of keys (or values) [j0, j0 + LANES) below `end` of one head: `head_off` is
 * the head's block within a page of `page_stride` floats. */
static inline void prefetch_rows(const float *kv, const int32_t *pages, int64_t ps, int64_t page_stride,
                                 int64_t head_off, int64_t d, int64_t j0, int64_t end) {
    for (int64_t j = j0; j < j0 + LANES && j < end; j++) {
        const char *row = (const char *)(kv + pages[j / ps] * page_stride + head_off + (j % ps) * d);
        for (int64_t b = 0; b < d * (int64_t)sizeof(float); b += 64) __builtin_prefetch(row + b, 0, 3);
    }
}

/* out[l] = the sum of p[l]'s lanes, for LANES vectors: four rounds of pairing halves */
static inline v16 sum16x16(const v16 p[LANES]) {
    v16 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = __builtin_shufflevector(p[j], p[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[j], p[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shufflevector(a[j], a[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(a[j], a[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shufflevector(b[j], b[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(b[j], b[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* `nt` rows of one sequence and KV head -- row r is (token t, query head h * group + g),
 * r = t * group + g -- attended together, so each key and value is loaded once for all of them.
 * `nt` and `nv` (16-float vectors a head) are constants where this is inlined, so the rows'
 * queries and accumulators stay in registers. A row's result does not depend on the rows it
 * is tiled with: a key it does not see scores -inf, weighs exactly 0 and adds exact zeros, and
 * its softmax sum goes through LANES partial sums in a fixed order. */
static inline __attribute__((always_inline)) void attend_tile(
    const StepPlan *p, int64_t seq, int64_t h, int64_t r0, const float *q, int64_t q_stride, float *out,
    int64_t out_stride, const float *kv, float *scores, int64_t score_stride, const int nt, const int nv) {
    const int64_t hkv = p->num_kv_heads, ps = p->page_size, d = nv * LANES;
    const int64_t group = p->num_heads / hkv, block = ps * d;
    const int64_t q0 = p->qo_indptr[seq], qlen = p->qo_indptr[seq + 1] - q0;
    const int64_t kvlen = p->kv_lens[seq];
    const int32_t *pages = p->page_indices + p->page_indptr[seq];
    const uint8_t *mask = p->mask ? p->mask + p->mask_offsets[seq] : NULL;
    const vi16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 neg_inf = (v16){0} - INFINITY;
    /* sized by constants, not nt/nv (arrays of variable size would live in memory) */
    v16 qv[MAX_TILE][MAX_VECTORS], acc[MAX_TILE][MAX_VECTORS], mxv[MAX_TILE];
    float *o[MAX_TILE], mx[MAX_TILE], sum[MAX_TILE];
    int64_t seen[MAX_TILE], tile_seen = 0;
    const uint8_t *mr[MAX_TILE];
    for (int i = 0; i < nt; i++) {
        const int64_t t = (r0 + i) / group, head = h * group + (r0 + i) % group;
        seen[i] = mask ? kvlen : kvlen - qlen + t + 1; /* keys [0, seen) */
        tile_seen = seen[i] > tile_seen ? seen[i] : tile_seen;
        mr[i] = mask ? mask + t * kvlen : NULL;
        for (int c = 0; c < nv; c++) {
            qv[i][c] = load16(q + (q0 + t) * q_stride + head * d + c * LANES) * p->scale;
            acc[i][c] = (v16){0};
        }
        o[i] = out + (q0 + t) * out_stride + head * d;
        mxv[i] = neg_inf;
    }
    /* scores, LANES keys at a time: each row's LANES products of query and key, summed across
     * in one transpose-and-add (sum16x16), then masked */
    const int64_t padded = round_up(tile_seen, LANES);
    for (int64_t j0 = 0; j0 < padded; j0 += LANES) {
        const float *key[LANES];
        for (int l = 0; l < LANES; l++) {
            const int64_t j = j0 + l < tile_seen ? j0 + l : tile_seen - 1; /* past the end: a repeat, masked */
            key[l] = kv + ((int64_t)pages[j / ps] * 2 * hkv + h) * block + (j % ps) * d;
        }
        /* the pages are scattered and, past the weights streamed by the rest of the forward,
         * mostly out of cache: fetch the keys PREFETCH_AHEAD chunks on, and this chunk's values
         * (read after the scores) */
        if (r0 == 0) {
            prefetch_rows(kv, pages, ps, 2 * hkv * block, h * block, d, j0 + PREFETCH_AHEAD * LANES, tile_seen);
            prefetch_rows(kv, pages, ps, 2 * hkv * block, (hkv + h) * block, d, j0, tile_seen);
        }
        for (int i = 0; i < nt; i++) {
            v16 prod[LANES];
            for (int l = 0; l < LANES; l++) {
                prod[l] = qv[i][0] * load16(key[l]);
                for (int c = 1; c < nv; c++) prod[l] += qv[i][c] * load16(key[l] + c * LANES);
            }
            v16 sc = sum16x16(prod);
            vi16 sees = (iota + (int32_t)j0) < (int32_t)seen[i];
            if (mr[i])
                for (int l = 0; l < LANES; l++) sees[l] = sees[l] && mr[i][j0 + l] ? -1 : 0;
            sc = select16(sees, sc, neg_inf);
            mxv[i] = select16(sc > mxv[i], sc, mxv[i]);
            *(v16 *)(scores + i * score_stride + j0) = sc;
        }
    }
    for (int i = 0; i < nt; i++) {
        mx[i] = -INFINITY;
        for (int l = 0; l < LANES; l++) mx[i] = mxv[i][l] > mx[i] ? mxv[i][l] : mx[i];
    }
    for (int i = 0; i < nt; i++) {
        float *restrict si = scores + i * score_stride;
        const float top = mx[i] == -INFINITY ? 0.0f : mx[i]; /* a row that sees nothing weighs all 0 */
#pragma omp simd
        for (int64_t j = 0; j < padded; j++) si[j] = exp_f(si[j] - top);
        v16 lanes = {0};
        for (int64_t j0 = 0; j0 < padded; j0 += LANES) lanes += load16(si + j0);
        sum[i] = sum16(lanes);
    }
    for (int64_t j0 = 0; j0 < tile_seen; j0 += ps) {
        const float *vb = kv + ((int64_t)pages[j0 / ps] * 2 * hkv + hkv + h) * block;
        const int64_t m = tile_seen - j0 < ps ? tile_seen - j0 : ps;
        for (int64_t j = 0; j < m; j++) {
            v16 v[MAX_VECTORS];
            for (int c = 0; c < nv; c++) v[c] = load16(vb + j * d + c * LANES);
            for (int i = 0; i < nt; i++) {
                const float w = scores[i * score_stride + j0 + j];
                for (int c = 0; c < nv; c++) acc[i][c] += w * v[c];
            }
        }
    }
    for (int i = 0; i < nt; i++) {
        const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
        for (int c = 0; c < nv; c++) *(v16 *)(o[i] + c * LANES) = acc[i][c] * inv;
    }
}

/* One sequence, one KV head: its qo_len * group rows, four, two or one at a time. */
static inline __attribute__((always_inline)) void attend_rows(
    const StepPlan *p, int64_t seq, int64_t h, const float *q, int64_t qs, float *out, int64_t os,
    const float *kv, float *scores, int64_t score_stride, const int nv) {
    const int64_t rows = (p->qo_indptr[seq + 1] - p->qo_indptr[seq]) * (p->num_heads / p->num_kv_heads);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) attend_tile(p, seq, h, r, q, qs, out, os, kv, scores, score_stride, 4, nv);
    for (; r + 2 <= rows; r += 2) attend_tile(p, seq, h, r, q, qs, out, os, kv, scores, score_stride, 2, nv);
    for (; r < rows; r++) attend_tile(p, seq, h, r, q, qs, out, os, kv, scores, score_stride, 1, nv);
}

typedef void (*AttendHead)(const StepPlan *, int64_t, int64_t, const float *, int64_t, float *, int64_t,
                           const float *, float *, int64_t);
#define ATTEND_HEAD(name, NV)                                                                            \
    static void name(const StepPlan *p, int64_t seq, int64_t h, const float *q, int64_t qs, float *out,  \
                     int64_t os, const float *kv, float *scores, int64_t score_stride) {                 \
        attend_rows(p, seq, h, q, qs, out, os, kv, scores, score_stride, NV);                            \
    }
ATTEND_HEAD(attend_head_32, 2)
ATTEND_HEAD(attend_head_64, 4)
ATTEND_HEAD(attend_head_128, 8)

/* Append this step's K/V [N, Hkv, D] (token rows k_stride / v_stride floats apart) to a layer's
 * pages `kv`, then attend q [N, Hq, D] (rows q_stride apart) over them into out [N, Hq, D]
 * (rows out_stride apart). Returns 0; -1 when scratch memory could not be had, -2 for a head
 * size other than 32, 64 or 128. */
int specsched_paged_attention(const StepPlan *p, int64_t num_tokens, const float *q, int64_t q_stride,
                              const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                              float *out, int64_t out_stride, float *kv) {
    if (p->head_dim != 32 && p->head_dim != 64 && p->head_dim != 128) return -2;
    write_new_kv(p, num_tokens, k, k_stride, v, v_stride, kv);
    const int64_t score_stride = round_up(p->max_kv > 0 ? p->max_kv : 1, LANES);
    float *scores = malloc(sizeof(float) * (size_t)(4 * score_stride));
    if (!scores) return -1;
    const AttendHead attend_head = p->head_dim == 32 ? attend_head_32 : p->head_dim == 64 ? attend_head_64
        : attend_head_128;
    const int64_t page_stride = 2 * p->num_kv_heads * p->page_size * p->head_dim;
    for (int64_t seq = 0; seq < p->num_seqs; seq++)
        for (int64_t h = 0; h < p->num_kv_heads; h++) {
            /* the first keys of the next head (or sequence) on, while this one is attended */
            const int64_t next = h + 1 < p->num_kv_heads ? seq : seq + 1;
            if (next < p->num_seqs)
                for (int64_t c = 0; c < PREFETCH_AHEAD; c++)
                    prefetch_rows(kv, p->page_indices + p->page_indptr[next], p->page_size, page_stride,
                                  (h + 1) % p->num_kv_heads * p->page_size * p->head_dim, p->head_dim,
                                  c * LANES, p->kv_lens[next]);
            attend_head(p, seq, h, q, q_stride, out, out_stride, kv, scores, score_stride);
        }
    free(scores);
    return 0;
}
