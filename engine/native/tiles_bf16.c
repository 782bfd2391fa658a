/* Products of BF16_MIN_ROWS to BF16_MAX_ROWS activation rows in BF16 dot products (AVX-512
 * BF16): batched decode steps, bound by multiply-adds, not by weight bytes.
 *
 * Each weight block is dequantized once per tile (d * q + m for Q4_1, d * q for Q8_0, one
 * float rounding as on every path) and rounded to bfloat16; the activation rows are rounded to
 * bfloat16 once per product (ties to even). One VDPBF16PS then multiplies 32 pairs into 16
 * float32 sums, twice the multiply-adds per instruction of a float FMA, and a weight block of
 * 32 values is one register instead of two. Products of two bfloat16 values are exact in
 * float32 and the sums are float32, so the error over a float tile is the two roundings to
 * bfloat16 (2^-9 relative per value): measured ~2e-3 of a row's product on random blocks,
 * against Q4_1's own step of ~3% of a block's range. Subnormal inputs count as zero.
 *
 * Measured side by side against panels_avx512.c's float fused tiles, 2 threads, SmolLM2's shapes
 * (ms per product): gate_up 3072 x 576 at 8 rows 0.107 -> 0.078, 6 rows 0.081 -> 0.066, 5 rows
 * 0.066 -> 0.060, 4 rows 0.056 -> 0.055, 2 rows 0.044 -> 0.045; the Q8_0 LM head at 8 rows 1.54
 * -> 1.14. Below BF16_MIN_ROWS rows dequantizing the blocks costs more than the multiply-adds
 * it feeds, the halved multiply-adds gain nothing, and the float tiles (no rounding) run there.
 *
 * Q4_1 codes become bfloat16 with one word permute: a block's 16 entries d * c + m (c = 0..15)
 * rounded to bfloat16 fill both halves of a table of 32 words; the 16 code bytes widened to
 * words index it, the low nibbles as they are (the permute reads an index's low 5 bits, and
 * the high nibble's low bit only picks the table's copy), the high nibbles shifted down.
 * Elements come out in their natural order (0..15 low, 16..31 high), as the activations.
 */
#include "blocks_avx512.h"

int pg_bf16_min_rows(void) { return BF16_MIN_ROWS; }
int pg_bf16_max_rows(void) { return BF16_MAX_ROWS; }

#if PG_X86
#define BF16_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512bf16"
#define BF16_INLINE static inline __attribute__((always_inline, target(BF16_TARGET)))
#define MAX_TILE_ROWS 6 /* weight rows of a tile */

int pg_cpu_has_avx512_bf16(void) {
#if defined(__GNUC__)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = pg_cpu_has_avx512() && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512bf16");
    }
    return known;
#else
    return 0;
#endif
}

/* Weight block `at` (row * nb + block) of Q4_1 as 32 bfloat16 values in element order. */
BF16_INLINE __m512i block_q4_1(const Problem *p, int64_t at) {
    const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(p->d[at])), codes16,
                                          _mm512_set1_ps(_cvtsh_ss(p->m[at])));
    const __m256i half = (__m256i)_mm512_cvtneps_pbh(values);
    const __m512i table = _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p->codes + at * 16)));
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    return _mm512_permutexvar_epi16(index, table);
}

/* Weight block `at` of Q8_0 as 32 bfloat16 values in element order: the float tiles' d * q,
 * rounded. */
BF16_INLINE __m512i block_q8_0(const Problem *p, int64_t at) {
    __m512 w[2];
    dequantize_block(p, 0, at, 0, w);
    return (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
}

/* y[t][n..n+rn] = weight rows n..n+rn . activation rows t (tc of them, bfloat16 xb [tc, K]). */
BF16_INLINE void tile(const Problem *p, const uint16_t *xb, int q4_1, int64_t n, int rn, int tc) {
    __m512 acc[MAX_TILE_ROWS][BF16_MAX_ROWS];
    for (int r = 0; r < rn; r++)
        for (int t = 0; t < tc; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t nb = p->nb, block_bytes = q4_1 ? 16 : QK;
    const int64_t ahead = (n + 2 * rn <= p->N ? n + rn : n) * nb;
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[MAX_TILE_ROWS];
        for (int r = 0; r < rn; r++) {
            /* the next tile's codes, while this one is multiplied (the LM head comes from
             * memory) */
            _mm_prefetch((const char *)(p->codes + (ahead + r * nb + b) * block_bytes),
                         _MM_HINT_T0);
            w[r] = q4_1 ? block_q4_1(p, (n + r) * nb + b) : block_q8_0(p, (n + r) * nb + b);
        }
        for (int t = 0; t < tc; t++) {
            const __m512i x = _mm512_loadu_si512(xb + t * p->K + b * QK);
            for (int r = 0; r < rn; r++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w[r], (__m512bh)x);
        }
    }
    for (int t = 0; t < tc; t++)
        for (int r = 0; r < rn; r++) p->y[t * p->N + n + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Weight rows n0..n1 in tiles of rn rows (constant at each call), then single rows. */
BF16_INLINE void tiles(const Problem *p, const uint16_t *xb, int q4_1, int64_t n0, int64_t n1,
                       int rn, int tc) {
    int64_t n = n0;
    for (; n + rn <= n1; n += rn) tile(p, xb, q4_1, n, rn, tc);
    for (; n < n1; n++) tile(p, xb, q4_1, n, 1, tc);
}

/* The tile that keeps accumulators, weight blocks and one activation block within the 32
 * registers (rn * tc + rn + 1 <= 32), as wide in weight rows as that allows. */
BF16_INLINE void products(const Problem *p, const uint16_t *xb, int q4_1, int64_t n0,
                          int64_t n1) {
    switch (p->T) {
    case 5: tiles(p, xb, q4_1, n0, n1, 4, 5); break;
    case 6: tiles(p, xb, q4_1, n0, n1, 4, 6); break;
    case 7: tiles(p, xb, q4_1, n0, n1, 3, 7); break;
    default: tiles(p, xb, q4_1, n0, n1, 3, 8); break;
    }
}

/* x [count] rounded to bfloat16 (ties to even), count a multiple of 32, order kept. */
BF16_INLINE void round_rows(const float *x, int64_t count, uint16_t *out) {
    for (int64_t i = 0; i < count; i += 2 * LANES) {
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + LANES),
                                               _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(out + i, (__m512i)h);
    }
}

/* Each thread's bfloat16 copy of the activation rows, kept and grown across calls. */
static _Thread_local uint16_t *rows_bf16;
static _Thread_local int64_t rows_capacity;

__attribute__((target(BF16_TARGET))) int pg_bf16_rows_avx512(const Problem *p, int q4_1,
                                                             int64_t n0, int64_t n1) {
    const int64_t count = p->T * p->K;
    if (p->T < BF16_MIN_ROWS || p->T > BF16_MAX_ROWS || !p->xf) return 0;
    if (count > rows_capacity) {
        uint16_t *grown = realloc(rows_bf16, (size_t)count * sizeof(uint16_t));
        if (!grown) return 0; /* the caller takes the float tiles */
        rows_bf16 = grown, rows_capacity = count;
    }
    round_rows(p->xf, count, rows_bf16);
    if (q4_1) products(p, rows_bf16, 1, n0, n1);
    else products(p, rows_bf16, 0, n0, n1);
    return 1;
}
#else
int pg_cpu_has_avx512_bf16(void) { return 0; }
int pg_bf16_rows_avx512(const Problem *p, int q4_1, int64_t n0, int64_t n1) {
    (void)p; (void)q4_1; (void)n0; (void)n1;
    return 0;
}
#endif
