/* One decode step of a Llama-family model in one call: every layer, for T sequences with one
 * new token each, on block-quantized weights (block_gemm.c) and a paged KV cache of float32 or
 * of float16 (kv_half: K and V rounded to the nearest half when stored, widened when read).
 *
 * Per layer, for hidden states h [T, H] (the residual stream):
 *   x = rms_norm(h) * attn_norm;  [q k v] = x @ Wqkv^T;  rotate q, k;  store k, v at the slots;
 *   a = softmax(q k^T * scale) v over the sequence's pages;  h += a @ Wo^T;
 *   x = rms_norm(h) * ffn_norm;   [g u] = x @ Wgu^T;  h += (silu(g) * u) @ Wdown^T;
 * and at the end h = rms_norm(h) * final_norm. The same arithmetic as the engine's torch path
 * with these weights (engine.native_linear: int16 activations per block of 32), only the order
 * of some float sums differs.
 *
 * Why one call: at one token per sequence a layer's ops are tiny (a 576-wide norm takes well
 * under a microsecond), and a step of 30 layers runs ~300 of them. Run one by one from Python,
 * the dispatch around each op costs more than the op. Here the whole step is one OpenMP parallel
 * region: products are split by output rows, attention by (token, query head), and the small
 * row ops run on one thread between barriers.
 *
 * The caller (engine/native_step.py) checks the model and the step's metadata; this file checks
 * the values that would make it read or write out of bounds (positions, slots, lengths, pages).
 */
#include <math.h>
#include <stdint.h>

#include "block_gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const uint8_t *codes; /* Q4_1 [N, K/32, 16] or Q8_0 [N, K/32, 32] */
    const uint16_t *d;    /* [N, K/32] fp16 scales */
    const uint16_t *m;    /* [N, K/32] fp16 mins (Q4_1), NULL for Q8_0 */
    int64_t N, K;
} PgWeight;

typedef struct {
    const float *attn_norm, *ffn_norm; /* [H] */
    PgWeight qkv, o, gate_up, down;    /* [(Hq+2Hkv)D, H], [H, HqD], [2F, H], [H, F] */
    void *k_cache, *v_cache;           /* [pages, page_size, Hkv, D] float, or half (kv_half) */
} PgLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_pages, page_size, max_position;
    int64_t interleaved; /* rotary pairs (2i, 2i+1); else (i, i + D/2) */
    int64_t kv_half;     /* the caches hold IEEE halves (else floats) */
    float rms_eps, scale;
    const float *cos_sin;    /* [max_position, D]: cos of the D/2 angles, then their sin */
    const float *final_norm; /* [H] */
    const PgLayer *layers;   /* [num_layers] */
} PgModel;

typedef struct {
    int64_t T;                 /* sequences, one new token each */
    const int64_t *positions;  /* [T] */
    const int64_t *slots;      /* [T] page * page_size + offset (negative: not stored) */
    const int32_t *block_table; /* [T, table_width] */
    int64_t table_width;
    const int32_t *seq_lens; /* [T] tokens of each sequence, the new one included */
} PgStep;

/* One product's input: the float rows, and below FLOAT_TILE_ROWS rows their int16 blocks. */
typedef struct {
    const float *x;
    int16_t *q;
    float *d, *s;
} Input;

/* Attention is split into items of (token, run of up to SPLIT keys): per KV head an item reads
 * the run's keys and values once for the G query heads that share them, and leaves per head the
 * partial softmax state (max score, sum of exponentials, unnormalised output [D]); a second
 * pass merges a head's runs. Runs keep every thread busy on one long sequence. */
#define SPLIT 128
#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_HEADS 64 /* query heads the AVX2 attention takes in one pass (more: per KV head) */

typedef struct {
    float *part; /* [T, Hq, runs, 2 + D]: max, sum, output */
    int64_t runs; /* runs per sequence: ceil(longest / SPLIT) */
} Partials;

/* Everything one step writes besides the caches. */
typedef struct {
    float *h, *x, *qkv, *attn, *delta, *gate_up, *act, *scratch;
    Input in;
    Partials att;
    int64_t scratch_per_thread;
} Work;

static int check_step(const PgModel *m, const PgStep *s) {
    if (s->T <= 0 || s->table_width <= 0) return PG_BAD_SHAPE;
    for (int64_t t = 0; t < s->T; t++) {
        int64_t len = s->seq_lens[t], pos = s->positions[t], slot = s->slots[t];
        if (pos < 0 || pos >= m->max_position) return PG_BAD_SHAPE;
        if (len < 1 || len > s->table_width * m->page_size) return PG_BAD_SHAPE;
        if (slot >= m->num_pages * m->page_size) return PG_BAD_SHAPE;
        const int32_t *table = s->block_table + t * s->table_width;
        for (int64_t p = 0; p < (len + m->page_size - 1) / m->page_size; p++)
            if (table[p] < 0 || table[p] >= m->num_pages) return PG_BAD_SHAPE;
    }
    return PG_OK;
}

static int check_weight(const PgWeight *w, int64_t N, int64_t K) {
    return w->codes && w->d && w->N == N && w->K == K && K % QK == 0 ? PG_OK : PG_BAD_SHAPE;
}

static int check_model(const PgModel *m) {
    int64_t H = m->hidden, D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
    if (m->num_layers <= 0 || H <= 0 || D <= 0 || D % 2 || Hkv <= 0 || Hq % Hkv) return PG_BAD_SHAPE;
    if (Hq / Hkv > MAX_GROUP) return PG_BAD_SHAPE;
    if (!m->layers || !m->cos_sin || !m->final_norm || m->page_size <= 0) return PG_BAD_SHAPE;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const PgLayer *L = m->layers + l;
        int bad = check_weight(&L->qkv, (Hq + 2 * Hkv) * D, H) | check_weight(&L->o, H, Hq * D) |
                  check_weight(&L->gate_up, 2 * m->intermediate, H) |
                  check_weight(&L->down, H, m->intermediate);
        if (bad || !L->attn_norm || !L->ffn_norm || !L->k_cache || !L->v_cache) return PG_BAD_SHAPE;
    }
    return PG_OK;
}

/* ---------------------------------------------------------------- small row ops */

/* x = rms_norm(h) * w for each of T rows of width n. */
static void norm_rows(const float *h, const float *w, int64_t T, int64_t n, float eps, float *x) {
    for (int64_t t = 0; t < T; t++) {
        const float *r = h + t * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += r[i] * r[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        float *o = x + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = r[i] * inv * w[i];
    }
}

/* Row t of x [T, K] taken as the next product's input: below FLOAT_TILE_ROWS rows its int16
 * blocks (from that many rows on the products read the floats); row 0 points the input at x. */
static void take_row(const float *x, int64_t t, int64_t T, int64_t K, Input *in, int avx2) {
    int64_t nb = K / QK;
    if (t == 0) in->x = x;
    if (!pg_float_tiles(T))
        pg_quantize_row(x + t * K, nb, in->q + t * K, in->d + t * nb, in->s + t * nb, avx2);
}

static void take_input(const float *x, int64_t T, int64_t K, Input *in, int avx2) {
    for (int64_t t = 0; t < T; t++) take_row(x, t, T, K, in, avx2);
}

static void add_rows(float *h, const float *delta, int64_t count) {
#pragma omp simd
    for (int64_t i = 0; i < count; i++) h[i] += delta[i];
}

/* Each row of h [T, H]: add delta's row (unless delta is NULL), norm it into x and take x as
 * the next product's input. Called by every thread of the team: the rows are shared out, and
 * the loop's closing barrier ends it. */
static void residual_norm(const PgModel *m, float *h, const float *delta, const float *weight,
                          int64_t T, float *x, Input *in, int avx2) {
    const int64_t H = m->hidden;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        if (delta) add_rows(h + t * H, delta + t * H, H);
        norm_rows(h + t * H, weight, 1, H, m->rms_eps, x + t * H);
        take_row(x, t, T, H, in, avx2); /* read by the products, after the barrier */
    }
}

/* Rotate one head x [D] at the angles of `row` (cos then sin, D/2 each). */
static void rotate(float *x, const float *row, int64_t D, int interleaved) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = row[i], s = row[half + i];
        float *a = interleaved ? x + 2 * i : x + i, *b = interleaved ? x + 2 * i + 1 : x + half + i;
        float x0 = *a, x1 = *b;
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
    }
}

#if PG_X86
/* rotate, 8 lanes at a time, for `heads` consecutive heads of D (a multiple of 16): the same
 * products and sums, each rounded as in the scalar loop (no fused multiply-add), so both give
 * the same bits. */
AVX2 static void rotate_heads_avx2(float *x, int64_t heads, const float *row, int64_t D,
                                   int interleaved) {
    const int64_t half = D / 2;
    const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for (float *end = x + heads * D; x < end; x += D) {
        if (interleaved) { /* pairs (2i, 2i+1): cos and sin of pair i in lanes 2i and 2i+1 */
            for (int64_t i = 0; i < half; i += 4) {
                __m256 c = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(row + i)),
                                                    twice);
                __m256 sn = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_loadu_ps(row + half + i)), twice);
                __m256 v = _mm256_loadu_ps(x + 2 * i), swapped = _mm256_permute_ps(v, 0xb1);
                /* even lanes x0 c - x1 s, odd lanes x1 c + x0 s */
                _mm256_storeu_ps(x + 2 * i, _mm256_addsub_ps(_mm256_mul_ps(v, c),
                                                             _mm256_mul_ps(swapped, sn)));
            }
            continue;
        }
        for (int64_t i = 0; i < half; i += 8) {
            __m256 c = _mm256_loadu_ps(row + i), sn = _mm256_loadu_ps(row + half + i);
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
            _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, sn)));
            _mm256_storeu_ps(x + half + i,
                             _mm256_add_ps(_mm256_mul_ps(a, sn), _mm256_mul_ps(b, c)));
        }
    }
}
#endif

/* rotate for `heads` consecutive heads of D, in AVX2 where D allows. */
static void rotate_heads(float *x, int64_t heads, const float *row, int64_t D, int interleaved,
                         int avx2) {
#if PG_X86
    if (avx2 && D % 16 == 0) {
        rotate_heads_avx2(x, heads, row, D, interleaved);
        return;
    }
#endif
    (void)avx2;
    for (int64_t h = 0; h < heads; h++) rotate(x + h * D, row, D, interleaved);
}

/* Token t: rotate its Q and K heads in place in qkv, then copy K and V into the caches (halves
 * rounded by F16C on the AVX2 path, as pg_float_to_half). */
static void rotate_and_store(const PgModel *m, const PgLayer *L, const PgStep *s, int64_t t,
                             float *qkv, int avx2) {
    int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
    float *row = qkv + t * (Hq + 2 * Hkv) * D;
    const float *angles = m->cos_sin + s->positions[t] * D;
    rotate_heads(row, Hq + Hkv, angles, D, (int)m->interleaved, avx2);
    int64_t slot = s->slots[t];
    if (slot < 0) return;
    const float *kn = row + Hq * D, *vn = row + (Hq + Hkv) * D;
    if (m->kv_half) {
        pg_halves_from_floats(kn, Hkv * D, (uint16_t *)L->k_cache + slot * Hkv * D, avx2);
        pg_halves_from_floats(vn, Hkv * D, (uint16_t *)L->v_cache + slot * Hkv * D, avx2);
        return;
    }
    memcpy((float *)L->k_cache + slot * Hkv * D, kn, sizeof(float) * (size_t)(Hkv * D));
    memcpy((float *)L->v_cache + slot * Hkv * D, vn, sizeof(float) * (size_t)(Hkv * D));
}

/* Element i of a cache row (float, or half when `half`). */
static inline float kv_at(const char *row, int64_t i, int half) {
    return half ? pg_half_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static float dot(const float *a, const char *row, int64_t n, int half) {
    float sum = 0.0f;
    if (!half) {
        const float *b = (const float *)row;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
        return sum;
    }
    for (int64_t i = 0; i < n; i++) sum += a[i] * kv_at(row, i, 1);
    return sum;
}

/* Rows j0..j0+n of token t's K or V cache (pages of ps rows, `stride` bytes from one row to the
 * next, one head's row `offset` bytes into it): row j at rows[j - j0]. One table lookup per
 * page, not per row. */
static inline __attribute__((always_inline)) void kv_rows(const void *cache, int64_t offset,
                                                          const int32_t *table, int64_t j0,
                                                          int64_t n, int64_t ps, int64_t stride,
                                                          const char **rows) {
    for (int64_t j = 0; j < n;) {
        int64_t page = (j0 + j) / ps, off = (j0 + j) % ps;
        const char *base = (const char *)cache + ((int64_t)table[page] * ps + off) * stride + offset;
        for (int64_t i = 0; off + i < ps && j < n; i++, j++) rows[j] = base + i * stride;
    }
}

/* Keys j0..j1 (j1 - j0 <= SPLIT) of token t's sequence for the G query heads of KV head kvh:
 * each key and value row is read once for all G heads. Any head_dim, any CPU. */
static void attend_run_generic(const PgModel *m, const PgLayer *L, const PgStep *s, int64_t t,
                               int64_t kvh, int64_t run, const float *qkv, const Partials *out) {
    int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, ps = m->page_size;
    int half = (int)m->kv_half;
    int64_t G = Hq / Hkv, es = half ? 2 : 4, stride = Hkv * D * es, j0 = run * SPLIT;
    int64_t len = s->seq_lens[t], n = len - j0 < SPLIT ? len - j0 : SPLIT;
    const int32_t *table = s->block_table + t * s->table_width;
    const float *q = qkv + t * (Hq + 2 * Hkv) * D + kvh * G * D; /* its G heads of D */
    float scores[MAX_GROUP][SPLIT], best[MAX_GROUP], total[MAX_GROUP];
    float *state[MAX_GROUP];
    const char *rows[SPLIT];
    for (int64_t g = 0; g < G; g++) {
        state[g] = out->part + ((t * Hq + kvh * G + g) * out->runs + run) * (2 + D);
        best[g] = -INFINITY;
        total[g] = 0.0f;
        for (int64_t i = 0; i < D; i++) state[g][2 + i] = 0.0f;
    }
    kv_rows(L->k_cache, kvh * D * es, table, j0, n, ps, stride, rows);
    for (int64_t j = 0; j < n; j++) {
        for (int64_t g = 0; g < G; g++) {
            float score = dot(q + g * D, rows[j], D, half) * m->scale;
            scores[g][j] = score;
            best[g] = score > best[g] ? score : best[g];
        }
    }
    kv_rows(L->v_cache, kvh * D * es, table, j0, n, ps, stride, rows);
    for (int64_t j = 0; j < n; j++) {
        for (int64_t g = 0; g < G; g++) {
            float p = expf(scores[g][j] - best[g]), *o = state[g] + 2;
            total[g] += p;
            for (int64_t i = 0; i < D; i++) o[i] += p * kv_at(rows[j], i, half);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        state[g][0] = best[g];
        state[g][1] = total[g];
    }
}

#if PG_X86
#define PREFETCH 8 /* key rows fetched ahead */

AVX2_INLINE void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(row + i, _MM_HINT_T0);
}

/* Elements i..i+7 of a cache row as floats (widened from halves when `half`). */
AVX2_INLINE __m256 load8(const char *row, int64_t i, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    return _mm256_loadu_ps((const float *)row + i);
}

/* e^x for x <= 0 (softmax weights), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
 * degree-6 Taylor polynomial (relative error < 2e-7), times 2^n through the exponent bits.
 * Lanes below -87 give 0 (e^-87 is under float's smallest normal). */
AVX2_INLINE __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x); /* ln2, high bits */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);     /* ln2, low bits */
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    __m256 e = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), bits));
    return _mm256_andnot_ps(under, e);
}

/* attend_run_generic for every KV head of the run at once, for D a multiple of 32 and at most
 * MAX_HEADS query heads: every query head's scores key by key, each key row read whole (all
 * KV heads, one contiguous row of the page) while the rows ahead are fetched, then each head's
 * output 32 floats at a time in four registers over all keys (the value rows were fetched
 * whole during the scores; the output is stored once). One KV head at a time read a third of
 * each row at the row stride, which the prefetchers followed worse: at 4k tokens of context
 * the decode step took 14-21% longer. Called with a constant `half`: one loop per cache
 * dtype. */
AVX2_INLINE void attend_run_avx2_body(const PgModel *m, const PgLayer *L, const PgStep *s,
                                      int64_t t, int64_t run, const float *qkv,
                                      const Partials *out, int half) {
    int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, ps = m->page_size;
    int64_t G = Hq / Hkv, es = half ? 2 : 4, stride = Hkv * D * es, j0 = run * SPLIT;
    int64_t len = s->seq_lens[t], n = len - j0 < SPLIT ? len - j0 : SPLIT;
    const int32_t *table = s->block_table + t * s->table_width;
    const float *q = qkv + t * (Hq + 2 * Hkv) * D; /* its Hq query heads of D */
    float scores[MAX_HEADS][SPLIT];
    const char *rows[SPLIT], *vrows[SPLIT];
    kv_rows(L->k_cache, 0, table, j0, n, ps, stride, rows);
    kv_rows(L->v_cache, 0, table, j0, n, ps, stride, vrows);
    for (int64_t j = 0; j < n; j++) {
        if (j + PREFETCH < n) prefetch_row(rows[j + PREFETCH], stride);
        prefetch_row(vrows[j], stride);
        for (int64_t kvh = 0, h = 0; kvh < Hkv; kvh++) {
            const char *k = rows[j] + kvh * D * es; /* this KV head's part of the row */
            for (int64_t g = 0; g < G; g++, h++) {  /* its G query heads */
                const float *qh = q + h * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), load8(k, i, half), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), load8(k, i + 8, half), a1);
                }
                scores[h][j] = pg_hsum8(_mm256_add_ps(a0, a1)) * m->scale;
            }
        }
    }
    for (int64_t h = 0; h < Hq; h++) {
        int64_t offset = h / G * D * es;
        float *state = out->part + ((t * Hq + h) * out->runs + run) * (2 + D);
        float best = -INFINITY, total = 0.0f, *p = scores[h];
        for (int64_t j = 0; j < n; j++) best = p[j] > best ? p[j] : best;
        __m256 sum8 = _mm256_setzero_ps(), top = _mm256_set1_ps(best);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + j), top));
            _mm256_storeu_ps(p + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        total = pg_hsum8(sum8);
        for (; j < n; j++) {
            p[j] = expf(p[j] - best);
            total += p[j];
        }
        for (int64_t c = 0; c < D; c += 32) {
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
            for (int64_t j = 0; j < n; j++) {
                const char *v = vrows[j] + offset;
                __m256 pj = _mm256_set1_ps(p[j]);
                o0 = _mm256_fmadd_ps(pj, load8(v, c, half), o0);
                o1 = _mm256_fmadd_ps(pj, load8(v, c + 8, half), o1);
                o2 = _mm256_fmadd_ps(pj, load8(v, c + 16, half), o2);
                o3 = _mm256_fmadd_ps(pj, load8(v, c + 24, half), o3);
            }
            _mm256_storeu_ps(state + 2 + c, o0);
            _mm256_storeu_ps(state + 2 + c + 8, o1);
            _mm256_storeu_ps(state + 2 + c + 16, o2);
            _mm256_storeu_ps(state + 2 + c + 24, o3);
        }
        state[0] = best;
        state[1] = total;
    }
}

AVX2 static void attend_run_avx2(const PgModel *m, const PgLayer *L, const PgStep *s, int64_t t,
                                 int64_t run, const float *qkv, const Partials *out) {
    if (m->kv_half) attend_run_avx2_body(m, L, s, t, run, qkv, out, 1);
    else attend_run_avx2_body(m, L, s, t, run, qkv, out, 0);
}
#endif


/* Token t's query head h: merge its runs' partial states into out [D]. */
static void merge_runs(const PgModel *m, const PgStep *s, int64_t t, int64_t h,
                       const Partials *in, float *out) {
    int64_t D = m->head_dim, runs = (s->seq_lens[t] + SPLIT - 1) / SPLIT;
    const float *state = in->part + (t * m->num_heads + h) * in->runs * (2 + D);
    float best = -INFINITY, total = 0.0f;
    for (int64_t r = 0; r < runs; r++) best = state[r * (2 + D)] > best ? state[r * (2 + D)] : best;
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    for (int64_t r = 0; r < runs; r++) {
        const float *run = state + r * (2 + D);
        float w = expf(run[0] - best);
        total += w * run[1];
#pragma omp simd
        for (int64_t i = 0; i < D; i++) out[i] += w * run[2 + i];
    }
    float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < D; i++) out[i] *= inv;
}

/* SiLU(g) * u over elements i0..i1 of the T rows of gate_up [T, 2F] (g then u), into act [T, F];
 * the element range counts across rows (t * F + i). */
static void silu_and_mul_scalar(const float *gu, int64_t F, int64_t i0, int64_t i1, float *act) {
    for (int64_t k = i0; k < i1; k++) {
        int64_t t = k / F, i = k % F;
        float g = gu[t * 2 * F + i], u = gu[t * 2 * F + F + i];
        act[k] = g / (1.0f + expf(-g)) * u;
    }
}

#if PG_X86
/* The same, 8 lanes at a time (F a multiple of 8, i0 and i1 too): sigmoid(g) from e = e^-|g|
 * (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below. */
AVX2 static void silu_and_mul_avx2(const float *gu, int64_t F, int64_t i0, int64_t i1, float *act) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (int64_t k = i0; k < i1; k += 8) {
        int64_t t = k / F, i = k % F;
        __m256 g = _mm256_loadu_ps(gu + t * 2 * F + i), u = _mm256_loadu_ps(gu + t * 2 * F + F + i);
        __m256 e = exp_neg8(_mm256_or_ps(g, sign)); /* e^-|g| */
        __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), g); /* sign bit of g picks e * r */
        _mm256_storeu_ps(act + k, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
}
#endif

/* This thread's share of act = SiLU(g) * u (a multiple of 8 elements each where F allows). */
static void silu_and_mul(const float *gu, int64_t T, int64_t F, float *act, int tid, int nthreads,
                         int avx2) {
    int64_t total = T * F, per = (total + nthreads - 1) / nthreads;
    per = (per + 7) / 8 * 8;
    int64_t i0 = tid * per < total ? tid * per : total, i1 = i0 + per < total ? i0 + per : total;
#if PG_X86
    if (avx2 && F % 8 == 0) {
        silu_and_mul_avx2(gu, F, i0, i1, act);
        return;
    }
#endif
    (void)avx2;
    silu_and_mul_scalar(gu, F, i0, i1, act);
}

/* ---------------------------------------------------------------- the step */

/* This thread's share of y [T, N] = in @ W^T. */
static void product(const PgWeight *w, const Input *in, int64_t T, float *y, float *scratch,
                    int tid, int nthreads, int avx2) {
    const float *xf = pg_float_tiles(T) ? in->x : NULL;
    Problem p = {w->codes, w->d, w->m, w->N, w->K, w->K / QK, T, in->q, in->d, in->s, xf, y};
    RowRange r = pg_row_share(w->N, tid, nthreads);
    if (r.n0 < r.n1) pg_product_rows(&p, w->m != NULL, r.n0, r.n1, scratch, avx2);
}

/* One layer, run by every thread of the team (the barriers are the team's). Its MLP output is
 * left in w->delta for the next layer (or the final norm) to add. */
static void layer(const PgModel *m, const PgLayer *L, const PgStep *s, Work *w, int first,
                  int tid, int nthreads, int avx2) {
    int64_t T = s->T, D = m->head_dim, Hq = m->num_heads, F = m->intermediate;
    float *scratch = w->scratch + tid * w->scratch_per_thread;
    /* the previous layer's MLP output is added first */
    residual_norm(m, w->h, first ? NULL : w->delta, L->attn_norm, T, w->x, &w->in, avx2);
    product(&L->qkv, &w->in, T, w->qkv, scratch, tid, nthreads, avx2);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) rotate_and_store(m, L, s, t, w->qkv, avx2);
    int64_t Hkv = m->num_kv_heads, runs = w->att.runs;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < T * runs; item++) {
        /* run-major: consecutive items read the same run of every sequence, so sequences that
         * share prefix pages (sessions with one system prompt) find them in cache; one item
         * takes every KV head (the AVX2 pass reads whole cache rows front to back) */
        int64_t run = item / T, t = item % T;
        if (run * SPLIT >= s->seq_lens[t]) continue;
#if PG_X86
        if (avx2 && m->head_dim % 32 == 0 && Hq <= MAX_HEADS) {
            attend_run_avx2(m, L, s, t, run, w->qkv, &w->att);
            continue;
        }
#endif
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            attend_run_generic(m, L, s, t, kvh, run, w->qkv, &w->att);
    }
#pragma omp for schedule(static)
    for (int64_t th = 0; th < T * Hq; th++)
        merge_runs(m, s, th / Hq, th % Hq, &w->att, w->attn + th * D);
#pragma omp single
    take_input(w->attn, T, Hq * D, &w->in, avx2);
    product(&L->o, &w->in, T, w->delta, scratch, tid, nthreads, avx2);
#pragma omp barrier
    residual_norm(m, w->h, w->delta, L->ffn_norm, T, w->x, &w->in, avx2);
    product(&L->gate_up, &w->in, T, w->gate_up, scratch, tid, nthreads, avx2);
#pragma omp barrier
    silu_and_mul(w->gate_up, T, F, w->act, tid, nthreads, avx2);
#pragma omp barrier
#pragma omp single
    take_input(w->act, T, F, &w->in, avx2);
    product(&L->down, &w->in, T, w->delta, scratch, tid, nthreads, avx2);
#pragma omp barrier
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* hidden [T, H]: in, the new tokens' embeddings; out, the final normed hidden states.
 * work: the caller's scratch of *work_bytes bytes, kept across steps (a fresh allocation of a
 * few hundred KB per step is fresh pages from the kernel, zeroed on first touch). When it is
 * too small, nothing runs: *work_bytes is set to the size needed and PG_NEED_WORKSPACE
 * returned. */
int pg_decode_step(const PgModel *m, const PgStep *s, float *hidden, void *work,
                   int64_t *work_bytes, int nthreads, int avx2) {
    int status = check_model(m);
    if (status == PG_OK) status = check_step(m, s);
    if (status != PG_OK) return status;
    if (pg_cpu_lacks(avx2)) return PG_NO_AVX2;
    if (nthreads < 1) nthreads = 1;
    int64_t T = s->T, H = m->hidden, D = m->head_dim, Hq = m->num_heads, F = m->intermediate;
    int64_t width = (Hq + 2 * m->num_kv_heads) * D, widest = max3(H, Hq * D, F);
    int64_t longest = 1;
    for (int64_t t = 0; t < T; t++) longest = s->seq_lens[t] > longest ? s->seq_lens[t] : longest;
    Work w;
    w.att.runs = (longest + SPLIT - 1) / SPLIT;
    w.scratch_per_thread = 2 * TILE_N * (widest / QK);
    int64_t floats = T * (2 * H + width + Hq * D + 3 * F) + 2 * T * (widest / QK) +
                     T * Hq * w.att.runs * (2 + D) + nthreads * w.scratch_per_thread;
    int64_t needed = (int64_t)(sizeof(float) * (size_t)floats + sizeof(int16_t) * (size_t)(T * widest));
    if (!work || *work_bytes < needed) {
        *work_bytes = needed;
        return PG_NEED_WORKSPACE;
    }
    float *next = work;
    w.h = hidden;
    w.x = next, next += T * H;
    w.qkv = next, next += T * width;
    w.attn = next, next += T * Hq * D;
    w.delta = next, next += T * H;
    w.gate_up = next, next += T * 2 * F;
    w.act = next, next += T * F;
    w.in.d = next, next += T * (widest / QK);
    w.in.s = next, next += T * (widest / QK);
    w.att.part = next, next += T * Hq * w.att.runs * (2 + D);
    w.scratch = next, next += nthreads * w.scratch_per_thread;
    w.in.q = (int16_t *)next;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        int tid = omp_get_thread_num(), team = omp_get_num_threads();
#else
        int tid = 0, team = 1;
#endif
        for (int64_t l = 0; l < m->num_layers; l++)
            layer(m, m->layers + l, s, &w, l == 0, tid, team, avx2);
#pragma omp single
        {
            add_rows(w.h, w.delta, T * H);
            norm_rows(w.h, m->final_norm, T, H, m->rms_eps, w.h);
        }
    }
    return PG_OK;
}
