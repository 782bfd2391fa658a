/* What the AVX-512 products share (panels_avx512.c, tiles_bf16.c): a weight block dequantized
 * into two vectors of 16 floats. */
#ifndef PG_BLOCKS_AVX512_H
#define PG_BLOCKS_AVX512_H
#include "block_gemm.h"

#if PG_X86
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f")))
#define LANES 16

/* Block b of the weight row starting at block `row` as two vectors of 16 values: for Q4_1
 * d * q + m looked up by code (a block's 16 code bytes hold elements 0..15 in their low
 * nibbles, 16..31 in their high ones; a permute reads an index's low 4 bits, so the low
 * nibble needs no mask), for Q8_0 d * q. One rounding per value, as every other path. */
AVX512_INLINE void dequantize_block(const Problem *p, int q4_1, int64_t row, int64_t b,
                                    __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(p->d[row + b]));
    if (q4_1) {
        const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                              14, 15);
        const __m512 values = _mm512_fmadd_ps(d, codes16,
                                              _mm512_set1_ps(_cvtsh_ss(p->m[row + b])));
        const __m128i c = _mm_loadu_si128((const __m128i *)(p->codes + (row + b) * 16));
        const __m512i q = _mm512_cvtepu8_epi32(c);
        w[0] = _mm512_permutexvar_ps(q, values);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
    } else {
        const int8_t *c = (const int8_t *)p->codes + (row + b) * QK;
        for (int i = 0; i < 2; i++) {
            const __m128i q8 = _mm_loadu_si128((const __m128i *)(c + LANES * i));
            w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)));
        }
    }
}
#endif
#endif
