/* Float panels in AVX-512: the products of two or more activation rows (batched decode,
 * verifies) on a CPU with AVX-512F, Q4_1 and Q8_0 alike.
 *
 * The same algorithm as block_gemm.c's AVX2 panels, twice as wide: PANEL_ROWS weight rows are
 * dequantized (w = d * q + m, one rounding, as the other paths) into a panel that stays in L1,
 * step s (16 inputs) of row r at w[(s * PANEL_ROWS + r) * 16], then a register tile of
 * PANEL_ROWS weight rows x TILE_COLS activation rows runs over it: 24 accumulators of 16
 * lanes, per step 4 activation loads and 6 weight loads feed 24 multiply-adds. The activations
 * are the float rows themselves (not rounded), as in every float-tile product.
 *
 * Why: on this machine's CPU (an AVX-512 EPYC) one thread's multiply-adds from L1 run at 31
 * GMAC/s in 16 lanes against 17 in AVX2's 8 (a 6 x 2 tile over a 768-input panel, measured
 * side by side), and a batched decode step is bound by these products, not by weight bytes.
 */
#include "block_gemm.h"

#if PG_X86
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f")))
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f")))

#define PANEL_ROWS 6    /* weight rows of a panel */
#define TILE_COLS 4     /* activation rows of a register tile */
#define PANEL_BLOCKS 24 /* the most blocks of a panel (18 KB): longer rows in K chunks */
#define LANES 16

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

/* Weight rows n..n+rn (rn <= PANEL_ROWS), blocks b0..b1, dequantized into the panel. A Q4_1
 * block's 16 code bytes hold elements 0..15 in their low nibbles and 16..31 in their high
 * ones: one widening gives both steps of the block. */
AVX512_INLINE void dequantize_panel(const Problem *p, int q4_1, int64_t n, int rn, int64_t b0,
                                    int64_t b1, float *w) {
    const __m512i low = _mm512_set1_epi32(0x0f);
    const int64_t block_bytes = q4_1 ? 16 : QK;
    for (int r = 0; r < rn; r++) {
        const int64_t row = (n + r) * p->nb;
        /* the next panel's codes are fetched while this one is multiplied: the LM head's
         * 49152 rows come from memory (8 rows: 2.9 -> 1.9 ms, 2 threads) */
        const int64_t ahead = (n + r + PANEL_ROWS < p->N ? n + r + PANEL_ROWS : n + r) * p->nb;
        for (int64_t b = b0; b < b1; b++) {
            _mm_prefetch((const char *)(p->codes + (ahead + b) * block_bytes), _MM_HINT_T0);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(p->d[row + b]));
            float *out = w + ((b - b0) * 2 * PANEL_ROWS + r) * LANES;
            if (q4_1) {
                const __m512 m = _mm512_set1_ps(_cvtsh_ss(p->m[row + b]));
                const __m128i c = _mm_loadu_si128((const __m128i *)(p->codes + (row + b) * 16));
                const __m512i q = _mm512_cvtepu8_epi32(c);
                _mm512_store_ps(out, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(
                                                            _mm512_and_si512(q, low)), m));
                _mm512_store_ps(out + PANEL_ROWS * LANES,
                                _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m));
            } else {
                const int8_t *c = (const int8_t *)p->codes + (row + b) * QK;
                for (int i = 0; i < 2; i++) {
                    const __m128i q8 = _mm_loadu_si128((const __m128i *)(c + LANES * i));
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8));
                    _mm512_store_ps(out + i * PANEL_ROWS * LANES, _mm512_mul_ps(d, v));
                }
            }
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
    for (int t = 0; t < tc; t++)
        for (int r = 0; r < rn; r++) {
            const float sum = _mm512_reduce_add_ps(acc[r][t]);
            y[t * N + r] = add ? y[t * N + r] + sum : sum;
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

AVX512 void pg_float_rows_avx512(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
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
