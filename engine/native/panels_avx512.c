/* Float products in AVX-512: two or more activation rows (batched decode, verifies) on a CPU
 * with AVX-512F, Q4_1 and Q8_0 alike. The activations are the float rows themselves (not
 * rounded), as in every float-tile product; each weight is dequantized (d * q + m, one
 * rounding, as the other paths) once per product and used by every activation row.
 *
 * Up to FUSED_ROWS (8) activation rows: fused tiles. A tile of a few weight rows x every
 * activation row runs over the whole of K; each weight block is dequantized in registers and
 * multiplied at once. From 9 rows on: panels, as block_gemm.c's AVX2 ones but 16 lanes wide:
 * PANEL_ROWS weight rows dequantized into an L1 panel, then register tiles of 6 weight rows x 4
 * activation rows over it. Both prefetch the next tile's codes (the LM head comes from
 * memory).
 *
 * Measured side by side, 2 threads, SmolLM2's shapes at 8 rows (benchmarks/
 * bench_batched_decode.py): AVX2 panels -> AVX-512 panels 1.3-1.7x, panels -> fused tiles a
 * further 1.14-1.28x (at 2 and 4 rows 1.3-1.5x: a panel is stored and loaded back for too few
 * rows to pay for it). One thread's multiply-adds from L1 on this CPU: 31 GMAC/s in 16 lanes
 * against 17 in AVX2's 8.
 */
#include "blocks_avx512.h"

#if PG_X86
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f")))

#define PANEL_ROWS 6    /* weight rows of a panel */
#define TILE_COLS 4     /* activation rows of a register tile */
#define PANEL_BLOCKS 24 /* the most blocks of a panel (18 KB): longer rows in K chunks */

int pg_cpu_has_avx512(void) {
#if defined(__GNUC__)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = pg_cpu_has_avx2() && __builtin_cpu_supports("avx512f");
    }
    return known;
#else
    return 0;
#endif
}

/* Weight rows n..n+rn (rn <= PANEL_ROWS), blocks b0..b1, dequantized into the panel. */
AVX512_INLINE void dequantize_panel(const Problem *p, int q4_1, int64_t n, int rn, int64_t b0,
                                    int64_t b1, float *w) {
    const int64_t block_bytes = q4_1 ? 16 : QK;
    for (int r = 0; r < rn; r++) {
        const int64_t row = (n + r) * p->nb;
        /* the next panel's codes are fetched while this one is multiplied: the LM head's
         * 49152 rows come from memory (8 rows: 2.9 -> 1.9 ms, 2 threads) */
        const int64_t ahead = (n + r + PANEL_ROWS < p->N ? n + r + PANEL_ROWS : n + r) * p->nb;
        for (int64_t b = b0; b < b1; b++) {
            _mm_prefetch((const char *)(p->codes + (ahead + b) * block_bytes), _MM_HINT_T0);
            __m512 v[2];
            dequantize_block(p, q4_1, row, b, v);
            float *out = w + ((b - b0) * 2 * PANEL_ROWS + r) * LANES;
            _mm512_store_ps(out, v[0]);
            _mm512_store_ps(out + PANEL_ROWS * LANES, v[1]);
        }
    }
}

/* y[t][r] (+)= panel row r . activation row t over `steps` steps of 16 inputs, for rn panel
 * rows and tc activation rows (constants at each call, so each pair compiles to its own
 * unrolled loop). */
AVX512_INLINE void panel_tile(const float *w, int rn, const float *x, int64_t K, int tc,
                              int64_t steps, float *y, int64_t N, int add) {
    __m512 acc[PANEL_ROWS][TILE_COLS];
    for (int r = 0; r < rn; r++)
        for (int t = 0; t < tc; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < steps; s++) {
        __m512 xv[TILE_COLS];
        for (int t = 0; t < tc; t++) xv[t] = _mm512_loadu_ps(x + t * K + s * LANES);
        for (int r = 0; r < rn; r++) {
            __m512 wv = _mm512_load_ps(w + (s * PANEL_ROWS + r) * LANES);
            __asm__("" : "+v"(wv)); /* one load per step, not one folded into each FMA */
            for (int t = 0; t < tc; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int t = 0; t < tc; t++) {
        float *out = y + t * N;
        int r = 0;
        for (; r + 4 <= rn; r += 4) { /* four rows' sums side by side, stored as one vector */
            __m256 h[4];
            for (int i = 0; i < 4; i++)
                h[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[r + i][t]),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                         _mm512_castps_pd(acc[r + i][t]), 1)));
            const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
            if (add) s4 = _mm_add_ps(s4, _mm_loadu_ps(out + r));
            _mm_storeu_ps(out + r, s4);
        }
        for (; r < rn; r++) {
            const float sum = _mm512_reduce_add_ps(acc[r][t]);
            out[r] = add ? out[r] + sum : sum;
        }
    }
}

/* Panel rows (rn of them) against every activation row: tiles of 4, then 2, then 1. */
AVX512_INLINE void panel_rows(const Problem *p, const float *w, int rn, int64_t n, int64_t b0,
                              int64_t steps, int add) {
    const float *x = p->xf + b0 * QK;
    float *y = p->y + n;
    const int64_t K = p->K, N = p->N;
    int64_t t = 0;
    for (; t + TILE_COLS <= p->T; t += TILE_COLS)
        panel_tile(w, rn, x + t * K, K, TILE_COLS, steps, y + t * N, N, add);
    if (p->T - t >= 2) {
        panel_tile(w, rn, x + t * K, K, 2, steps, y + t * N, N, add);
        t += 2;
    }
    if (t < p->T) panel_tile(w, rn, x + t * K, K, 1, steps, y + t * N, N, add);
}

/* Fused tiles, for at most FUSED_ROWS activation rows: rn weight rows x tc activation rows
 * (rn * tc <= 24 accumulators) over the whole of K, each weight block dequantized in
 * registers and used at once by every activation row. Every weight is dequantized once, as in
 * a panel, but never stored and loaded back, and each sum is reduced once per row, not once
 * per K chunk. */
#define FUSED_ROWS 8

AVX512_INLINE void fused_tile(const Problem *p, int q4_1, int64_t n, int rn, int tc) {
    __m512 acc[6][FUSED_ROWS];
    for (int r = 0; r < rn; r++)
        for (int t = 0; t < tc; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t block_bytes = q4_1 ? 16 : QK, K = p->K;
    const int64_t ahead = (n + 2 * rn <= p->N ? n + rn : n) * p->nb;
    for (int64_t b = 0; b < p->nb; b++) {
        __m512 w[6][2];
        for (int r = 0; r < rn; r++) {
            /* the next tile's codes, while this one is multiplied (the LM head is read from
             * memory) */
            _mm_prefetch((const char *)(p->codes + (ahead + r * p->nb + b) * block_bytes),
                         _MM_HINT_T0);
            dequantize_block(p, q4_1, (n + r) * p->nb, b, w[r]);
        }
        for (int h = 0; h < 2; h++) {
            for (int t = 0; t < tc; t++) {
                const __m512 xv = _mm512_loadu_ps(p->xf + t * K + b * QK + h * LANES);
                for (int r = 0; r < rn; r++) acc[r][t] = _mm512_fmadd_ps(w[r][h], xv, acc[r][t]);
            }
        }
    }
    for (int t = 0; t < tc; t++)
        for (int r = 0; r < rn; r++) p->y[t * p->N + n + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Weight rows n0..n1 against tc (constant) activation rows in fused tiles of rn rows. */
AVX512_INLINE void fused_rows(const Problem *p, int q4_1, int64_t n0, int64_t n1, int rn,
                              int tc) {
    int64_t n = n0;
    for (; n + rn <= n1; n += rn) fused_tile(p, q4_1, n, rn, tc);
    for (; n < n1; n++) fused_tile(p, q4_1, n, 1, tc);
}

AVX512_INLINE void fused_products(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    /* tiles whose accumulators and weight vectors fit the 32 registers (at 8 rows, 2 x 8
     * measured up to 8% faster than 3 x 8, which leaves too few for the rest) */
    switch (p->T) {
    case 2: fused_rows(p, q4_1, n0, n1, 6, 2); break;
    case 3: fused_rows(p, q4_1, n0, n1, 4, 3); break;
    case 4: fused_rows(p, q4_1, n0, n1, 4, 4); break;
    case 5: fused_rows(p, q4_1, n0, n1, 3, 5); break;
    case 6: fused_rows(p, q4_1, n0, n1, 3, 6); break;
    case 7: fused_rows(p, q4_1, n0, n1, 2, 7); break;
    default: fused_rows(p, q4_1, n0, n1, 2, 8); break;
    }
}

AVX512 void pg_float_rows_avx512(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    if (p->T <= FUSED_ROWS) {
        if (q4_1) fused_products(p, 1, n0, n1);
        else fused_products(p, 0, n0, n1);
        return;
    }
    float panel[PANEL_ROWS * PANEL_BLOCKS * QK] __attribute__((aligned(64)));
    const int64_t chunks = (p->nb + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    const int64_t per = (p->nb + chunks - 1) / chunks;
    for (int64_t b0 = 0; b0 < p->nb; b0 += per) {
        const int64_t b1 = b0 + per < p->nb ? b0 + per : p->nb, steps = (b1 - b0) * 2;
        for (int64_t n = n0; n < n1;) {
            const int rn = n1 - n >= PANEL_ROWS ? PANEL_ROWS : n1 - n >= 4 ? 4 : 1;
            dequantize_panel(p, q4_1, n, rn, b0, b1, panel);
            if (rn == PANEL_ROWS) panel_rows(p, panel, PANEL_ROWS, n, b0, steps, b0 > 0);
            else if (rn == 4) panel_rows(p, panel, 4, n, b0, steps, b0 > 0);
            else panel_rows(p, panel, 1, n, b0, steps, b0 > 0);
            n += rn;
        }
    }
}
#else
int pg_cpu_has_avx512(void) { return 0; }
void pg_float_rows_avx512(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    (void)p; (void)q4_1; (void)n0; (void)n1;
}
#endif
