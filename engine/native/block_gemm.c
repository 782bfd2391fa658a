/* Block-quantized matrix products for the CPU decode path: y[T, N] = x[T, K] @ W[N, K]^T.
 *
 * W is stored in blocks of 32 consecutive inputs of one output row (GGUF's grids):
 *   Q4_1: per block an fp16 scale d, an fp16 min m and 32 4-bit codes q in 0..15;
 *         w = d * q + m. Codes are 16 bytes per block: byte j holds element j in its low
 *         nibble and element j + 16 in its high nibble (GGUF's own byte order).
 *   Q8_0: per block an fp16 scale d and 32 int8 codes q; w = d * q.
 * The scales live in their own [N, K/32] arrays (the codes in [N, K/32, 16 or 32]), so a row's
 * scales convert eight at a time.
 *
 * One activation row (decode) takes the integer path below. From FLOAT_TILE_ROWS rows on
 * (batched decode, short verifies) the weights are instead dequantized to floats once and
 * multiplied with the float rows, which are not rounded:
 *   Q4_1 (and Q8_0 below PANEL_Q8_ROWS rows): float panels. PANEL_ROWS = 6 weight rows are
 *   dequantized into a small buffer (K in chunks of at most PANEL_BLOCKS blocks, so a panel
 *   stays in L1), then a register tile of 6 weight rows x 2 activation rows runs over it:
 *   12 independent accumulators, and per 8 inputs 8 loads feed 12 multiply-adds. The single
 *   row of the previous float tiles used one accumulator per activation row, 4 multiply-adds
 *   in a chain per block: at T = 2 two chains could not cover the multiply-add's latency on
 *   both pipes. Measured side by side, one thread, Zen 3: Q4_1 3072 x 576 T=2 24.9 -> 37.1
 *   GFLOP/s, T=8 60.7 -> 66.3; 576 x 1536 T=8 49.1 -> 69.2 (two chunks of 768 inputs: a
 *   whole row of 1536 makes a 36 KB panel, past L1, 18% slower; three chunks 7% slower).
 *   Q8_0 from PANEL_Q8_ROWS rows: float tiles, one weight row's block dequantized into 4
 *   registers and multiplied with up to TILE_F activation rows; its dequantization is cheap
 *   enough that the panels measured up to 10% slower on the 49152 x 576 LM head at T=8.
 *
 * On the integer path x is quantized per block of 32 to int16 with a float scale dx (dx = max|x| / 32767, codes
 * rounded to nearest even) and the block sum sx = dx * sum(codes), so that
 *   sum_j w_j x_j = d * dx * sum_j q_j xq_j (+ m * sx for Q4_1),
 * an exact integer dot product per block (AVX2: weights widened to int16, _mm256_madd_epi16),
 * one float multiply-add per block. int16 rather than llama.cpp's int8 activations: int8 per
 * block loses the small channels of a block that holds one of the residual stream's outlier
 * channels (measured on SmolLM2: logit errors 2x larger), and a decode step is bound by weight
 * bytes, not by these multiplies. The AVX2 functions are compiled with a target attribute and
 * chosen at run time; the scalar ones compute the same sums on any CPU.
 *
 * Threads: output rows are split across an OpenMP team. Link this file against the OpenMP
 * runtime torch already loaded (one thread pool for torch's ops and these).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_gemm.h"

#define XMAX 32767.0f /* activation codes are int16 in -XMAX..XMAX */
/* The integer path prefetches the weight codes of the tile PF_TILES tiles ahead: one row's
 * products take too little time per byte for the hardware prefetcher alone to keep the
 * stream in flight (Q8_0 LM head, 49152 x 576, 2 threads: 2.2 -> 1.5 ms; Q4_1 5-10%). The float
 * tiles do enough work per byte that prefetching them measured no gain. */
#ifndef PF_TILES
#define PF_TILES 2
#endif

/* ---------------------------------------------------------------- portable helpers */

int pg_cpu_has_avx2(void) {
#if PG_X86 && defined(__GNUC__)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
    }
    return known;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- activations */

static void quantize_row_scalar(const float *x, int64_t nb, int16_t *q, float *xd, float *xs) {
    for (int64_t b = 0; b < nb; b++) {
        const float *p = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(p[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / XMAX;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            int32_t v = (int32_t)nearbyintf(p[j] * id);
            q[b * QK + j] = (int16_t)v;
            sum += v;
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

#if PG_X86
__attribute__((target("avx2,fma,f16c")))
static void quantize_row_avx2(const float *x, int64_t nb, int16_t *q, float *xd, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const float *p = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
        m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 h = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float d = _mm_cvtss_f32(h) / XMAX;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        /* cvtps rounds with MXCSR's mode: nearest even, like nearbyintf in the scalar path */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(s, 1), _mm256_castsi256_si128(s));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* an in-lane pack leaves the quadwords of two rows of 8 in the order 0 2 1 3 */
        __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);
        __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xd8);
        _mm256_storeu_si256((__m256i *)(q + b * QK), lo);
        _mm256_storeu_si256((__m256i *)(q + b * QK + 16), hi);
        xd[b] = d;
        xs[b] = d * (float)_mm_cvtsi128_si32(s4);
    }
}
#endif

int pg_float_tile_rows(void) { return FLOAT_TILE_ROWS; }

#if PG_X86
/* F16C rounds as pg_float_to_half: nearest even, subnormals, overflow and infinities alike (a
 * NaN stays a NaN, keeping its payload's top bits). */
AVX2 static void halves_f16c(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = pg_float_to_half(x[i]);
}
#endif

void pg_halves_from_floats(const float *x, int64_t n, uint16_t *out, int avx2) {
#if PG_X86
    if (avx2) {
        halves_f16c(x, n, out);
        return;
    }
#endif
    (void)avx2;
    for (int64_t i = 0; i < n; i++) out[i] = pg_float_to_half(x[i]);
}

void pg_quantize_row(const float *x, int64_t nb, int16_t *q, float *xd, float *xs, int avx2) {
#if PG_X86
    if (avx2) {
        quantize_row_avx2(x, nb, q, xd, xs);
        return;
    }
#endif
    (void)avx2;
    quantize_row_scalar(x, nb, q, xd, xs);
}

/* x [T, K] -> codes [T, K], scales and scaled sums [T, K/32]. */
static void quantize_rows(const float *x, int64_t T, int64_t K, int16_t *q, float *xd, float *xs,
                          int avx2) {
    int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++)
        pg_quantize_row(x + t * K, nb, q + t * K, xd + t * nb, xs + t * nb, avx2);
}

int pg_quantize_activations(const float *x, int64_t T, int64_t K, int16_t *q, float *xd,
                            float *xs, int avx2) {
    if (T < 0 || K <= 0 || K % QK) return PG_BAD_SHAPE;
    if (pg_cpu_lacks(avx2)) return PG_NO_AVX2;
    quantize_rows(x, T, K, q, xd, xs, avx2);
    return PG_OK;
}

/* ---------------------------------------------------------------- one matrix product */


static void row_scales_scalar(const uint16_t *h, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++) out[b] = pg_half_to_float(h[b]);
}

static float dot_floats_scalar(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Integer product of weight block b of row n with activation codes x (one block of 32). */
static int32_t block_isum_scalar(const Problem *p, int q4_1, int64_t n, int64_t b,
                                 const int16_t *x) {
    int32_t isum = 0;
    if (q4_1) {
        const uint8_t *w = p->codes + (n * p->nb + b) * 16;
        for (int j = 0; j < 16; j++) isum += (w[j] & 0x0f) * x[j] + (w[j] >> 4) * x[j + 16];
    } else {
        const int8_t *w = (const int8_t *)p->codes + n * p->K + b * QK;
        for (int j = 0; j < QK; j++) isum += w[j] * x[j];
    }
    return isum;
}

static void rows_scalar(const Problem *p, int q4_1, int64_t n0, int64_t n1, float *dw,
                        float *mw) {
    for (int64_t n = n0; n < n1; n++) {
        row_scales_scalar(p->d + n * p->nb, p->nb, dw);
        if (q4_1) row_scales_scalar(p->m + n * p->nb, p->nb, mw);
        for (int64_t t = 0; t < p->T; t++) {
            const int16_t *x = p->xq + t * p->K;
            const float *xd = p->xd + t * p->nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < p->nb; b++)
                acc += dw[b] * xd[b] * (float)block_isum_scalar(p, q4_1, n, b, x + b * QK);
            if (q4_1) acc += dot_floats_scalar(mw, p->xs + t * p->nb, p->nb);
            p->y[t * p->N + n] = acc;
        }
    }
}

/* Weight block b of row n as 32 floats (the values every path multiplies by). */
static void dequantize_block_scalar(const Problem *p, int q4_1, int64_t n, int64_t b, float *w) {
    float d = pg_half_to_float(p->d[n * p->nb + b]);
    if (q4_1) {
        const uint8_t *c = p->codes + (n * p->nb + b) * 16;
        float m = pg_half_to_float(p->m[n * p->nb + b]);
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(c[j] & 0x0f) + m;
            w[j + 16] = d * (float)(c[j] >> 4) + m;
        }
    } else {
        const int8_t *c = (const int8_t *)p->codes + n * p->K + b * QK;
        for (int j = 0; j < QK; j++) w[j] = d * (float)c[j];
    }
}

/* Float tiles (T >= FLOAT_TILE_ROWS): each weight block dequantized to floats once and
 * multiplied with the float activations of every row, no activation rounding. */
static void float_rows_scalar(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    float w[QK];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t t = 0; t < p->T; t++) p->y[t * p->N + n] = 0.0f;
        for (int64_t b = 0; b < p->nb; b++) {
            dequantize_block_scalar(p, q4_1, n, b, w);
            for (int64_t t = 0; t < p->T; t++)
                p->y[t * p->N + n] += dot_floats_scalar(w, p->xf + t * p->K + b * QK, QK);
        }
    }
}

#if PG_X86
AVX2 static void row_scales_avx2(const uint16_t *h, int64_t nb, float *out) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(out + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b))));
    for (; b < nb; b++) out[b] = _cvtsh_ss(h[b]);
}

AVX2 static float dot_floats_avx2(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = pg_hsum8(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* One block b of weight row n as int16 lanes: elements 0..15 in *w0, 16..31 in *w1 (Q4_1's
 * unsigned nibbles, or Q8_0's signed bytes). */
AVX2_INLINE void unpack_block_avx2(const Problem *p, int q4_1, int64_t n, int64_t b, __m256i *w0,
                                   __m256i *w1) {
    if (q4_1) {
        const __m128i low = _mm_set1_epi8(0x0f);
        __m128i raw = _mm_loadu_si128((const __m128i *)(p->codes + (n * p->nb + b) * 16));
        *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
        *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
    } else {
        const uint8_t *w = p->codes + n * p->K + b * QK;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
    }
}

/* A tile of `rn` weight rows (n0..) against activation row t: rn independent accumulators,
 * so the float multiply-adds of consecutive blocks do not wait on each other, and each
 * activation block is loaded once for rn weight rows. Called with constant q4_1 and rn: the
 * loops unroll, the format's branches fold and the accumulators stay in registers. cs holds
 * the rn rows' block scales times the activation row's (row r at r * nb), mw their mins. */
AVX2_INLINE void tile_avx2(const Problem *p, int q4_1, int64_t n0, int rn, int64_t t,
                           const float *cs, const float *mw) {
    const int64_t nb = p->nb;
    __m256 acc[TILE_N];
    for (int r = 0; r < rn; r++) acc[r] = _mm256_setzero_ps();
    const int64_t block_bytes = q4_1 ? QK / 2 : QK, row_bytes = nb * block_bytes;
    const int64_t line_blocks = 64 / block_bytes, ahead = n0 + PF_TILES * TILE_N;
    const int prefetch = rn == TILE_N && ahead + TILE_N <= p->N;
    for (int64_t b = 0; b < nb; b++) {
        const int16_t *x = p->xq + t * p->K + b * QK;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)x); /* elements 0..15 */
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 16)); /* 16..31 */
        if (prefetch && b % line_blocks == 0) /* one 64-byte line of codes per row */
            for (int r = 0; r < TILE_N; r++)
                _mm_prefetch((const char *)(p->codes + (ahead + r) * row_bytes + b * block_bytes),
                             _MM_HINT_T0);
        for (int r = 0; r < rn; r++) {
            __m256i w0, w1;
            unpack_block_avx2(p, q4_1, n0 + r, b, &w0, &w1);
            __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
            __m256 scale = _mm256_broadcast_ss(cs + r * nb + b);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
        }
    }
    for (int r = 0; r < rn; r++) {
        float y = pg_hsum8(acc[r]);
        if (q4_1) y += dot_floats_avx2(mw + r * nb, p->xs + t * nb, nb);
        p->y[t * p->N + n0 + r] = y;
    }
}

/* out[b] = fp16 scale h[b] times the activation block scale xd[b]. */
AVX2 static void scales_times_avx2(const uint16_t *h, const float *xd, int64_t nb, float *out) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b)));
        _mm256_storeu_ps(out + b, _mm256_mul_ps(d, _mm256_loadu_ps(xd + b)));
    }
    for (; b < nb; b++) out[b] = _cvtsh_ss(h[b]) * xd[b];
}

/* Rows n0..n1, TILE_N rows at a time (single rows at the end), each activation row in turn.
 * Called with a constant q4_1. */
AVX2_INLINE void rows_avx2(const Problem *p, int q4_1, int64_t n0, int64_t n1, float *cs,
                           float *mw) {
    const int64_t nb = p->nb;
    for (int64_t n = n0; n < n1;) {
        int rn = n1 - n >= TILE_N ? TILE_N : 1;
        if (q4_1)
            for (int r = 0; r < rn; r++) row_scales_avx2(p->m + (n + r) * nb, nb, mw + r * nb);
        for (int64_t t = 0; t < p->T; t++) {
            for (int r = 0; r < rn; r++)
                scales_times_avx2(p->d + (n + r) * nb, p->xd + t * nb, nb, cs + r * nb);
            if (rn == TILE_N) tile_avx2(p, q4_1, n, TILE_N, t, cs, mw);
            else tile_avx2(p, q4_1, n, 1, t, cs, mw);
        }
        n += rn;
    }
}

/* Weight block b of row n as 32 floats in w[0..3] (elements 0..7, 8..15, 16..23, 24..31). */
AVX2_INLINE void dequantize_block_avx2(const Problem *p, int q4_1, int64_t n, int64_t b,
                                       __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(p->d[n * p->nb + b]));
    if (q4_1) {
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(p->m[n * p->nb + b]));
        __m128i raw = _mm_loadu_si128((const __m128i *)(p->codes + (n * p->nb + b) * 16));
        __m128i q[2] = {_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low)};
        for (int h = 0; h < 2; h++) {
            w[2 * h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[h])), m);
            __m256i upper = _mm256_cvtepu8_epi32(_mm_srli_si128(q[h], 8));
            w[2 * h + 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(upper), m);
        }
    } else {
        const int8_t *c = (const int8_t *)p->codes + n * p->K + b * QK;
        for (int i = 0; i < 4; i++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(c + 8 * i));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
    }
}

/* Float panels (Q4_1 from 2 rows, Q8_0 below 4): PANEL_ROWS weight rows are dequantized into
 * an L1 panel, then a register tile of PANEL_ROWS weight rows x 2 activation rows (12
 * accumulators) runs over it per pair of activation rows. */
#define PANEL_ROWS 6    /* weight rows of a panel */
#define PANEL_COLS 2    /* activation rows of a register tile */
#define PANEL_BLOCKS 24 /* the most blocks of a panel: longer rows are taken in K chunks */
#define PANEL_Q8_ROWS 4 /* Q8_0 from this many activation rows on: float tiles (see below) */

/* Weight rows n..n+rn (rn <= PANEL_ROWS), blocks b0..b1, dequantized into a panel: step s
 * (8 inputs) of row r at w[(s * PANEL_ROWS + r) * 8], a tile's loads of one step adjacent.
 * The block scales convert 8 at a time first and broadcast from memory (a load, no shuffle). */
AVX2_INLINE void dequantize_panel_avx2(const Problem *p, int q4_1, int64_t n, int rn, int64_t b0,
                                       int64_t b1, float *w) {
    float dv[PANEL_BLOCKS], mv[PANEL_BLOCKS];
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int r = 0; r < rn; r++) {
        const int64_t row = (n + r) * p->nb;
        int64_t b = b0;
        for (; b + 8 <= b1; b += 8) {
            __m128i d8 = _mm_loadu_si128((const __m128i *)(p->d + row + b));
            _mm256_storeu_ps(dv + (b - b0), _mm256_cvtph_ps(d8));
            if (q4_1) {
                __m128i m8 = _mm_loadu_si128((const __m128i *)(p->m + row + b));
                _mm256_storeu_ps(mv + (b - b0), _mm256_cvtph_ps(m8));
            }
        }
        for (; b < b1; b++) {
            dv[b - b0] = _cvtsh_ss(p->d[row + b]);
            if (q4_1) mv[b - b0] = _cvtsh_ss(p->m[row + b]);
        }
        for (b = b0; b < b1; b++) {
            const __m256 d = _mm256_broadcast_ss(dv + (b - b0));
            float *out = w + ((b - b0) * 4 * PANEL_ROWS + r) * 8;
            if (q4_1) {
                /* bytes 0..7 hold elements 0..7 (low nibbles) and 16..23 (high), bytes 8..15
                 * elements 8..15 and 24..31: widened to 32 bits, the high nibble is a shift */
                const __m256 m = _mm256_broadcast_ss(mv + (b - b0));
                const uint8_t *c = p->codes + (row + b) * 16;
                __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
                __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8)));
                __m256i q[4] = {_mm256_and_si256(lo, low), _mm256_and_si256(hi, low),
                                _mm256_srli_epi32(lo, 4), _mm256_srli_epi32(hi, 4)};
                for (int i = 0; i < 4; i++) {
                    __m256 v = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);
                    _mm256_store_ps(out + i * PANEL_ROWS * 8, v);
                }
            } else {
                const int8_t *c = (const int8_t *)p->codes + (row + b) * QK;
                for (int i = 0; i < 4; i++) {
                    __m128i q8 = _mm_loadl_epi64((const __m128i *)(c + 8 * i));
                    __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
                    _mm256_store_ps(out + i * PANEL_ROWS * 8, v);
                }
            }
        }
    }
}

/* y[t][r] (+)= panel row r . activation row t over `steps` steps of 8 inputs, for rn panel rows
 * and tc activation rows (constants at each call): rn * tc independent accumulators (12 cover
 * the multiply-add's latency on both pipes); a step's tc activation vectors are held in
 * registers and each weight vector is loaded once for all tc of them. */
AVX2_INLINE void panel_tile_avx2(const float *w, int rn, const float *x, int64_t K, int tc,
                                 int64_t steps, float *y, int64_t N, int add) {
    __m256 acc[PANEL_ROWS][PANEL_COLS];
    for (int r = 0; r < rn; r++)
        for (int t = 0; t < tc; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < steps; s++) {
        __m256 xv[PANEL_COLS];
        for (int t = 0; t < tc; t++) xv[t] = _mm256_loadu_ps(x + t * K + s * 8);
        for (int r = 0; r < rn; r++) {
            __m256 wv = _mm256_load_ps(w + (s * PANEL_ROWS + r) * 8);
            /* in a register: gcc otherwise folds a load of it into each multiply-add */
            __asm__("" : "+x"(wv));
            for (int t = 0; t < tc; t++) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int t = 0; t < tc; t++) {
        float *out = y + t * N;
        int r = 0;
        for (; r + 4 <= rn; r += 4) { /* four rows' sums side by side, stored as one vector */
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][t], acc[r + 1][t]),
                                      _mm256_hadd_ps(acc[r + 2][t], acc[r + 3][t]));
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            if (add) s4 = _mm_add_ps(s4, _mm_loadu_ps(out + r));
            _mm_storeu_ps(out + r, s4);
        }
        for (; r < rn; r++) out[r] = (add ? out[r] : 0.0f) + pg_hsum8(acc[r][t]);
    }
}

/* Panel rows (rn of them) against every activation row, PANEL_COLS rows per tile. */
AVX2_INLINE void panel_rows_avx2(const Problem *p, const float *w, int rn, int64_t n, int64_t b0,
                                 int64_t steps, int add) {
    const float *x = p->xf + b0 * QK;
    float *y = p->y + n;
    int64_t t = 0;
    for (; t + PANEL_COLS <= p->T; t += PANEL_COLS)
        panel_tile_avx2(w, rn, x + t * p->K, p->K, PANEL_COLS, steps, y + t * p->N, p->N, add);
    if (t < p->T) panel_tile_avx2(w, rn, x + t * p->K, p->K, 1, steps, y + t * p->N, p->N, add);
}

/* Rows n0..n1 in panels: K in even chunks of at most PANEL_BLOCKS blocks (a row of 1536 in
 * two), per chunk PANEL_ROWS weight rows at a time dequantized and multiplied with every
 * activation row; later chunks add to y. */
AVX2_INLINE void panel_products_avx2(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    float panel[PANEL_ROWS * PANEL_BLOCKS * QK] __attribute__((aligned(32)));
    int64_t chunks = (p->nb + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    int64_t per = (p->nb + chunks - 1) / chunks;
    for (int64_t b0 = 0; b0 < p->nb; b0 += per) {
        int64_t b1 = b0 + per < p->nb ? b0 + per : p->nb, steps = (b1 - b0) * 4;
        for (int64_t n = n0; n < n1;) {
            int rn = n1 - n >= PANEL_ROWS ? PANEL_ROWS : n1 - n >= 4 ? 4 : 1;
            dequantize_panel_avx2(p, q4_1, n, rn, b0, b1, panel);
            if (rn == PANEL_ROWS) panel_rows_avx2(p, panel, PANEL_ROWS, n, b0, steps, b0 > 0);
            else if (rn == 4) panel_rows_avx2(p, panel, 4, n, b0, steps, b0 > 0);
            else panel_rows_avx2(p, panel, 1, n, b0, steps, b0 > 0);
            n += rn;
        }
    }
}

/* One weight row n against activation rows t0..t0+tn (tn <= TILE_F, a constant at each call):
 * a block is dequantized once and used by tn rows, each with its own accumulator. */
AVX2_INLINE void float_tile_avx2(const Problem *p, int q4_1, int64_t n, int64_t t0, int tn) {
    __m256 acc[TILE_F];
    for (int i = 0; i < tn; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p->nb; b++) {
        __m256 w[4];
        dequantize_block_avx2(p, q4_1, n, b, w);
        for (int i = 0; i < tn; i++) {
            const float *x = p->xf + (t0 + i) * p->K + b * QK;
            __m256 a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), acc[i]);
            a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a);
            a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a);
            acc[i] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a);
        }
    }
    for (int i = 0; i < tn; i++) p->y[(t0 + i) * p->N + n] = pg_hsum8(acc[i]);
}

/* Float products of rows n0..n1: panels, except Q8_0 from PANEL_Q8_ROWS activation rows on,
 * where one row's blocks dequantized in registers feed up to TILE_F activation rows. */
AVX2_INLINE void float_rows_avx2(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    if (q4_1 || p->T < PANEL_Q8_ROWS) {
        panel_products_avx2(p, q4_1, n0, n1);
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t t = 0; t < p->T; t += TILE_F) {
            switch (p->T - t < TILE_F ? p->T - t : TILE_F) { /* constant tile heights */
            case 1: float_tile_avx2(p, q4_1, n, t, 1); break;
            case 2: float_tile_avx2(p, q4_1, n, t, 2); break;
            case 3: float_tile_avx2(p, q4_1, n, t, 3); break;
            case 4: float_tile_avx2(p, q4_1, n, t, 4); break;
            case 5: float_tile_avx2(p, q4_1, n, t, 5); break;
            case 6: float_tile_avx2(p, q4_1, n, t, 6); break;
            case 7: float_tile_avx2(p, q4_1, n, t, 7); break;
            default: float_tile_avx2(p, q4_1, n, t, TILE_F); break;
            }
        }
    }
}

/* The format and the path as constants, so each call below compiles to its own loop. */
AVX2 static void product_rows_avx2(const Problem *p, int q4_1, int64_t n0, int64_t n1, float *dw,
                                   float *mw) {
    if (p->xf && q4_1) float_rows_avx2(p, 1, n0, n1);
    else if (p->xf) float_rows_avx2(p, 0, n0, n1);
    else if (q4_1) rows_avx2(p, 1, n0, n1, dw, mw);
    else rows_avx2(p, 0, n0, n1, dw, dw);
}
#endif

void pg_product_rows(const Problem *p, int q4_1, int64_t n0, int64_t n1, float *scratch,
                     int avx2) {
    float *dw = scratch, *mw = scratch + TILE_N * p->nb;
#if PG_X86
    if (avx2 >= PG_AVX512_BF16 && p->xf && pg_bf16_rows_avx512(p, q4_1, n0, n1)) return;
    if (avx2 >= PG_AVX512 && p->xf) {
        pg_float_rows_avx512(p, q4_1, n0, n1);
        return;
    }
    if (avx2) {
        product_rows_avx2(p, q4_1, n0, n1, dw, mw);
        return;
    }
#endif
    (void)avx2;
    if (p->xf) float_rows_scalar(p, q4_1, n0, n1);
    else rows_scalar(p, q4_1, n0, n1, dw, mw);
}

/* Quantize x, then split the output rows across `nthreads` in runs of TILE_N rows (each
 * thread owns rows n0..n1). */
static int run(Problem *p, const float *x, int nthreads, int avx2, int q4_1) {
    if (p->N <= 0 || p->T < 0 || p->K <= 0 || p->K % QK) return PG_BAD_SHAPE;
    if (pg_cpu_lacks(avx2)) return PG_NO_AVX2;
    if (p->T == 0) return PG_OK;
    if (nthreads < 1) nthreads = 1;
    if ((int64_t)nthreads > p->N) nthreads = (int)p->N;
    int64_t nb = p->nb = p->K / QK;
    size_t codes = sizeof(int16_t) * (size_t)(p->T * p->K), scales = (size_t)(p->T * nb);
    size_t row_scratch = (size_t)(2 * TILE_N * nb) * (size_t)nthreads;
    float *floats = malloc(sizeof(float) * (2 * scales + row_scratch) + codes);
    if (!floats) return PG_NO_MEMORY;
    float *xd = floats, *xs = floats + scales, *scratch = floats + 2 * scales;
    int16_t *xq = (int16_t *)(scratch + row_scratch);
    if (pg_float_tiles(p->T)) {
        p->xf = x;
    } else {
        quantize_rows(x, p->T, p->K, xq, xd, xs, avx2);
        p->xq = xq;
        p->xd = xd;
        p->xs = xs;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        int tid = omp_get_thread_num();
#else
        int tid = 0;
        nthreads = 1;
#endif
        RowRange r = pg_row_share(p->N, tid, nthreads);
        if (r.n0 < r.n1) pg_product_rows(p, q4_1, r.n0, r.n1, scratch + (size_t)tid * 2 * TILE_N * nb, avx2);
    }
    free(floats);
    return PG_OK;
}

int pg_q4_1_matmul(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                   int64_t K, const float *x, int64_t T, float *y, int nthreads, int avx2) {
    Problem p = {codes, d, m, N, K, 0, T, NULL, NULL, NULL, NULL, y};
    return run(&p, x, nthreads, avx2, 1);
}

int pg_q8_0_matmul(const int8_t *codes, const uint16_t *d, int64_t N, int64_t K,
                   const float *x, int64_t T, float *y, int nthreads, int avx2) {
    Problem p = {(const uint8_t *)codes, d, NULL, N, K, 0, T, NULL, NULL, NULL, NULL, y};
    return run(&p, x, nthreads, avx2, 0);
}

/* ---------------------------------------------------------------- dequantization
 * W as float32 [N, K] (row-major): for many activation rows (prefill) a float GEMM on the
 * dequantized weight beats the per-block integer products. Same values as the products use. */

static void dequantize_rows_scalar(const Problem *p, int q4_1, int64_t n0, int64_t n1,
                                   float *out) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < p->nb; b++)
            dequantize_block_scalar(p, q4_1, n, b, out + n * p->K + b * QK);
}

#if PG_X86
AVX2_INLINE void store_blocks_avx2(const Problem *problem, int q4_1, int64_t n0, int64_t n1,
                                   float *out) {
    const Problem local = *problem, *p = &local; /* the stores to out cannot touch a local copy */
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t b = 0; b < p->nb; b++) {
            __m256 w[4];
            dequantize_block_avx2(p, q4_1, n, b, w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + n * p->K + b * QK + 8 * i, w[i]);
        }
    }
}

AVX2 static void dequantize_rows_avx2(const Problem *p, int q4_1, int64_t n0, int64_t n1,
                                      float *out) {
    if (q4_1) store_blocks_avx2(p, 1, n0, n1, out);
    else store_blocks_avx2(p, 0, n0, n1, out);
}
#endif

static int dequantize(Problem *p, float *out, int nthreads, int avx2, int q4_1) {
    if (p->N <= 0 || p->K <= 0 || p->K % QK) return PG_BAD_SHAPE;
    if (pg_cpu_lacks(avx2)) return PG_NO_AVX2;
    p->nb = p->K / QK;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < nthreads; c++) {
        int64_t chunk = (p->N + nthreads - 1) / nthreads;
        int64_t n0 = c * chunk, n1 = n0 + chunk < p->N ? n0 + chunk : p->N;
#if PG_X86
        if (avx2) {
            dequantize_rows_avx2(p, q4_1, n0, n1, out);
            continue;
        }
#endif
        dequantize_rows_scalar(p, q4_1, n0, n1, out);
    }
    return PG_OK;
}

int pg_q4_1_dequantize(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                       int64_t K, float *out, int nthreads, int avx2) {
    Problem p = {codes, d, m, N, K, 0, 0, NULL, NULL, NULL, NULL, NULL};
    return dequantize(&p, out, nthreads, avx2, 1);
}

int pg_q8_0_dequantize(const int8_t *codes, const uint16_t *d, int64_t N, int64_t K,
                       float *out, int nthreads, int avx2) {
    Problem p = {(const uint8_t *)codes, d, NULL, N, K, 0, 0, NULL, NULL, NULL, NULL, NULL};
    return dequantize(&p, out, nthreads, avx2, 0);
}
