/* Greedy sampling's argmax over logit rows: out[t] = the first index of row t's largest value,
 * as torch.argmax (a NaN counts as larger than any number: the first NaN wins). torch's CPU
 * argmax walks a row one element at a time (~100 us for a 49152-token vocabulary here); this
 * takes the row's maximum eight lanes at a time, then finds its first index. */
#include <math.h>
#include <stdint.h>

#include "block_gemm.h"

/* The first index of row[0..n) equal to `best`, or of its first NaN when `nan`. */
static int64_t first_index(const float *row, int64_t n, float best, int nan) {
    for (int64_t i = 0; i < n; i++)
        if (nan ? isnan(row[i]) : row[i] == best) return i;
    return 0;
}

static int64_t argmax_scalar(const float *row, int64_t n) {
    float best = row[0];
    for (int64_t i = 0; i < n; i++) {
        if (isnan(row[i])) return i;
        if (row[i] > best) best = row[i];
    }
    return first_index(row, n, best, 0);
}

#if PG_X86
AVX2 static int64_t argmax_avx2(const float *row, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(row + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    int nan = !_mm256_testz_ps(unordered, unordered);
    for (; i < n; i++) {
        nan |= isnan(row[i]);
        best = row[i] > best ? row[i] : best;
    }
    return first_index(row, n, best, nan);
}
#endif

int pg_argmax_rows(const float *x, int64_t T, int64_t n, int64_t *out, int avx2) {
    if (T < 0 || n <= 0) return PG_BAD_SHAPE;
    if (pg_cpu_lacks(avx2)) return PG_NO_AVX2;
    for (int64_t t = 0; t < T; t++) {
#if PG_X86
        if (avx2) {
            out[t] = argmax_avx2(x + t * n, n);
            continue;
        }
#endif
        out[t] = argmax_scalar(x + t * n, n);
    }
    return PG_OK;
}
