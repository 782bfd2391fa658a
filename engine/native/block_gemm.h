/* What block_gemm.c shares with the other native sources (decode_step.c). */
#ifndef PG_BLOCK_GEMM_H
#define PG_BLOCK_GEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PG_X86 1
/* AVX2 code is compiled per function and chosen at run time (pg_cpu_has_avx2). */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))
#else
#define PG_X86 0
#endif

#define QK 32     /* inputs per weight block */
#define TILE_N 4  /* weight rows that share one activation block */
#define TILE_F 8  /* activation rows that share one dequantized weight block (float tiles) */
/* From this many activation rows on, products dequantize each weight block to floats and
 * multiply the float activations (one dequantization serves every row); below it, the rows'
 * int16 codes (one integer block product per row, cheaper for a single row). */
#define FLOAT_TILE_ROWS 2

enum { PG_OK = 0, PG_BAD_SHAPE = 1, PG_NO_MEMORY = 2, PG_NO_AVX2 = 3, PG_NEED_WORKSPACE = 4 };

/* One product y[T, N] = x[T, K] @ W[N, K]^T with x already quantized (pg_quantize_row). */
typedef struct {
    const uint8_t *codes; /* [N, nb, 16] (Q4_1) or [N, nb, 32] (Q8_0) */
    const uint16_t *d;    /* [N, nb] fp16 */
    const uint16_t *m;    /* [N, nb] fp16, Q4_1 only */
    int64_t N, K, nb, T;
    const int16_t *xq; /* [T, K] */
    const float *xd;  /* [T, nb] */
    const float *xs;  /* [T, nb] */
    const float *xf;  /* [T, K] float activations: set (and xq unset) for float tiles */
    float *y;         /* [T, N] */
} Problem;

/* Float products of weight rows n0..n1 (p->xf set) in AVX-512: fused tiles up to 8 activation
 * rows, panels past it (panels_avx512.c). */
void pg_float_rows_avx512(const Problem *p, int q4_1, int64_t n0, int64_t n1);

int pg_cpu_has_avx2(void);
/* AVX-512F besides AVX2 (panels_avx512.c). The `avx2` argument of the entry points is a level:
 * 0 the portable code, 1 AVX2, PG_AVX512 (2) AVX2 and AVX-512 float panels, PG_AVX512_BF16 (3)
 * below. */
int pg_cpu_has_avx512(void);
#define PG_AVX512 2
/* Level PG_AVX512_BF16 (3): PG_AVX512, and products of BF16_MIN_ROWS..BF16_MAX_ROWS activation
 * rows in BF16 dot products (tiles_bf16.c: activations and weights rounded to bfloat16). */
#define PG_AVX512_BF16 3
#define BF16_MIN_ROWS 5
#define BF16_MAX_ROWS 8
/* AVX-512 BW and BF16 besides AVX-512F (tiles_bf16.c). */
int pg_cpu_has_avx512_bf16(void);
int pg_bf16_min_rows(void);
int pg_bf16_max_rows(void);
/* Products of weight rows n0..n1 (p->xf set, BF16_MIN_ROWS <= T <= BF16_MAX_ROWS) in BF16 dot
 * products; 0 when it does not take them (other T, no memory for the rounded rows). */
int pg_bf16_rows_avx512(const Problem *p, int q4_1, int64_t n0, int64_t n1);
static inline int pg_cpu_lacks(int avx2) {
    return (avx2 && !pg_cpu_has_avx2()) || (avx2 >= PG_AVX512 && !pg_cpu_has_avx512()) ||
           (avx2 >= PG_AVX512_BF16 && !pg_cpu_has_avx512_bf16());
}

/* IEEE half <-> float, portable (any CPU). */
static inline float pg_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        float sub = (float)mantissa * (1.0f / 16777216.0f); /* mantissa * 2^-24, exact */
        memcpy(&bits, &sub, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* f rounded to the nearest half (ties to even), as torch's .to(torch.float16): overflow gives
 * infinity, NaN stays NaN, values under the smallest subnormal's half give signed zero. */
static inline uint16_t pg_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds past 65504 */
    if (a < 0x38800000u) { /* under 2^-14: a subnormal half (units of 2^-24) or zero */
        if (a < 0x33000000u) return (uint16_t)sign; /* under 2^-25 */
        uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(a >> 23);
        uint32_t q = mant >> shift, rest = mant & ((1u << shift) - 1u), tie = 1u << (shift - 1);
        q += rest > tie || (rest == tie && (q & 1u));
        return (uint16_t)(sign | q);
    }
    uint32_t h = ((a >> 23) - 112u) << 10 | (a & 0x7fffffu) >> 13, rest = a & 0x1fffu;
    h += rest > 0x1000u || (rest == 0x1000u && (h & 1u)); /* a carry may raise the exponent */
    return (uint16_t)(sign | h);
}

/* out[i] = the half nearest x[i] (pg_float_to_half), for n values; F16C when `avx2`. */
void pg_halves_from_floats(const float *x, int64_t n, uint16_t *out, int avx2);
/* argmax.c: out[t] = the first index of row t's maximum (a NaN wins, as torch.argmax). */
int pg_argmax_rows(const float *x, int64_t T, int64_t n, int64_t *out, int avx2);

static inline int pg_float_tiles(int64_t T) { return T >= FLOAT_TILE_ROWS; }

/* One row of x [K] -> int16 codes [K], block scales and scaled code sums [K/32]. */
void pg_quantize_row(const float *x, int64_t nb, int16_t *q, float *xd, float *xs, int avx2);

/* Output rows n0..n1 of one product (q4_1: Q4_1 else Q8_0 weights); scratch holds
 * 2 * TILE_N * nb floats. */
void pg_product_rows(const Problem *p, int q4_1, int64_t n0, int64_t n1, float *scratch,
                     int avx2);

/* Thread `tid` of `nthreads`' share of N output rows: whole runs of TILE_N rows, so that
 * only the last share ends in single-row tiles. */
typedef struct {
    int64_t n0, n1;
} RowRange;

static inline RowRange pg_row_share(int64_t N, int tid, int nthreads) {
    int64_t groups = (N + TILE_N - 1) / TILE_N;
    int64_t per = (groups + nthreads - 1) / nthreads * TILE_N;
    int64_t n0 = tid * per, n1 = n0 + per;
    RowRange r = {n0 < N ? n0 : N, n1 < N ? n1 : N};
    return r;
}

#if PG_X86
/* The sum of a vector's eight lanes. */
AVX2_INLINE float pg_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
