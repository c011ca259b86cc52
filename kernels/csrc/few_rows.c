/* y = x W^T for a few rows of x (decode steps, a few tokens per expert), reading W once.
 *
 * BLAS libraries tune for many rows: for 2-16 rows OpenBLAS re-reads the weight per row (as
 * matrix-vector products) or runs a matrix product far below its peak. Here each block of 4
 * weight rows is loaded once and multiplied into up to 4 rows of x at a time, so the weight
 * streams from memory once per call whatever the row count.
 *
 * Every output y[m, n] is one accumulator per lane over k in order, then a lane sum: the result
 * does not depend on the thread count or on the other rows in the call.
 *
 * Weights are float32, or int8 with one float scale per row (below).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* ---- many rows (and, without AVX2 or AVX-512, every row count): BLAS's matrix product, slices of the
 * weight's rows shared among OpenMP threads. Plain C: built for every CPU.
 * BLAS keeps its own threads; running them next to OpenMP's (torch's, this file's) makes each
 * side wait on or spin against the other. So BLAS runs single-threaded inside this library's
 * OpenMP threads, each on its own columns of y. The slices are SLICE columns wide whatever the
 * thread count: BLAS picks its kernel by the product's shape (OpenBLAS: a small-matrix kernel below
 * some size, which sums in another order), so slices sized by the thread count gave other last
 * bits at another thread count. Every output is summed by one BLAS call of the same shape.
 */
typedef void (*cblas_sgemm_fn)(int order, int transa, int transb, int64_t m, int64_t n, int64_t k, float alpha,
                               const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                               int64_t ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define SLICE 256   /* columns per BLAS call: whole 64-column panels, wide enough to amortise packing x */

/* sgemm: a 64-bit-integer cblas_sgemm (such as numpy's OpenBLAS), set to one thread by the caller. */
void raymoe_f32_gemm(void *sgemm, const float *x, int64_t m, int64_t ldx, const float *w, int64_t n, int64_t k,
                     float *y, int64_t ldy) {
    const cblas_sgemm_fn gemm = (cblas_sgemm_fn)sgemm;
    const int64_t slices = (n + SLICE - 1) / SLICE;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < slices; s++) {
        const int64_t n0 = s * SLICE, cols = n - n0 < SLICE ? n - n0 : SLICE;
        gemm(ROW_MAJOR, NO_TRANS, TRANS, m, cols, k, 1.0f, x, ldx, w + n0 * k, k, 0.0f, y + n0, ldy);
    }
}

/* What this build has: 2 with AVX-512 VNNI (float32 and int8 weights), 1 with AVX2 and FMA (float32 only),
 * 0 without either (BLAS and PyTorch do the products). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define FEW_ROWS 2
#elif defined(__AVX2__) && defined(__FMA__)
#define FEW_ROWS 1
#else
#define FEW_ROWS 0
#endif

int raymoe_few_rows_available(void) { return FEW_ROWS; }

#if FEW_ROWS >= 1
#include <immintrin.h>

#define NR 4 /* weight rows per block */
#define MR 4 /* activation rows per pass (AVX2's 16 registers spill a few accumulators: measured faster than MR 2) */

#if FEW_ROWS == 2
/* One block: rows [0, mr) of x times weight rows [0, nr) -> y, for compile-time mr and nr. */
static inline __attribute__((always_inline)) void block_f32(const float *x, int64_t ldx, int mr, const float *w,
                                                            int64_t k, int nr, float *y, int64_t ldy) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
        const __mmask16 mask = k - k0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - k0)) - 1);
        __m512 wv[NR];
        for (int j = 0; j < nr; j++) {
            /* the same place in the next block's row j, into L2: a fixed distance ahead in bytes lands in this
             * block's own next row when rows are that long (Qwen3.5's router: 8 KB rows; measured 8-17% faster
             * for the routers' shapes, 2 threads) */
            _mm_prefetch((const char *)(w + (NR + j) * k + k0), _MM_HINT_T2);
            wv[j] = _mm512_maskz_loadu_ps(mask, w + j * k + k0);
        }
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k0);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#else
/* The first n (< 8) floats at p, zeros after. */
static inline __m256 load_tail(const float *p, int64_t n) {
    static const int32_t first[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(first + 8 - n)));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The block as above with AVX2's 8 lanes (the same order of operations per lane). */
static inline __attribute__((always_inline)) void block_f32(const float *x, int64_t ldx, int mr, const float *w,
                                                            int64_t k, int nr, float *y, int64_t ldy) {
    __m256 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += 8) {
        const int64_t left = k - k0;
        __m256 wv[NR];
        for (int j = 0; j < nr; j++) {
            _mm_prefetch((const char *)(w + (NR + j) * k + k0), _MM_HINT_T2);
            wv[j] = left >= 8 ? _mm256_loadu_ps(w + j * k + k0) : load_tail(w + j * k + k0, left);
        }
        for (int i = 0; i < mr; i++) {
            const __m256 xv = left >= 8 ? _mm256_loadu_ps(x + i * ldx + k0) : load_tail(x + i * ldx + k0, left);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = sum8(acc[i][j]);
}
#endif

/* Dispatch to a block with compile-time mr and nr, so its accumulators live in registers. */
#define DISPATCH(CALL)                                                                             \
    switch (mr * 8 + nr) {                                                                         \
    case 1 * 8 + 1: CALL(1, 1); break;                                                             \
    case 1 * 8 + 2: CALL(1, 2); break;                                                             \
    case 1 * 8 + 3: CALL(1, 3); break;                                                             \
    case 1 * 8 + 4: CALL(1, 4); break;                                                             \
    case 2 * 8 + 1: CALL(2, 1); break;                                                             \
    case 2 * 8 + 2: CALL(2, 2); break;                                                             \
    case 2 * 8 + 3: CALL(2, 3); break;                                                             \
    case 2 * 8 + 4: CALL(2, 4); break;                                                             \
    case 3 * 8 + 1: CALL(3, 1); break;                                                             \
    case 3 * 8 + 2: CALL(3, 2); break;                                                             \
    case 3 * 8 + 3: CALL(3, 3); break;                                                             \
    case 3 * 8 + 4: CALL(3, 4); break;                                                             \
    case 4 * 8 + 1: CALL(4, 1); break;                                                             \
    case 4 * 8 + 2: CALL(4, 2); break;                                                             \
    case 4 * 8 + 3: CALL(4, 3); break;                                                             \
    default: CALL(4, 4); break;                                                                    \
    }

/* Groups of rows through their own weights, e.g. the tokens of each expert: for each group
 * (g, a, b) in groups[0 .. 3 count), rows a..b of x [., k] (row stride ldx) times weight g,
 * w + g * w_stride ([n, k], contiguous), -> rows a..b of y (row stride ldy). One parallel loop
 * over every (group, block of weight rows), so the threads stream all the groups' weights
 * without a join between groups. */
void raymoe_f32_grouped(const float *x, int64_t ldx, const float *w, int64_t w_stride, const int64_t *groups,
                        int64_t count, int64_t n, int64_t k, float *y, int64_t ldy) {
    const int64_t blocks = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < count * blocks; item++) {
        const int64_t *group = groups + 3 * (item / blocks);
        const int64_t n0 = item % blocks * NR;
        const int nr = n - n0 < NR ? (int)(n - n0) : NR;
        for (int64_t m0 = group[1]; m0 < group[2]; m0 += MR) {
            const int mr = group[2] - m0 < MR ? (int)(group[2] - m0) : MR;
            const float *xb = x + m0 * ldx, *wb = w + group[0] * w_stride + n0 * k;
            float *yb = y + m0 * ldy + n0;
#define CALL_F32(MR_, NR_) block_f32(xb, ldx, MR_, wb, k, NR_, yb, ldy)
            DISPATCH(CALL_F32)
        }
    }
}

#endif /* FEW_ROWS >= 1 */

#if FEW_ROWS == 2
/* The hardware prefetcher alone left int8 rows streaming at ~20 GB/s here; fetching this far
 * ahead reaches ~55 GB/s (measured 4-16 KB, over weights much larger than the caches). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif

/* ---- int8 weights ------------------------------------------------------------------------------
 * w [n, k] int8 in [-127, 127] with a float scale per row. Each row of x is quantised to int8 in
 * blocks of 32 with a float scale per block (as llama.cpp does for Q8_0 products), so a product is
 * int8 x int8 with int32 sums (AVX-512 VNNI's vpdpbusd, 64 products per instruction), scaled per
 * block. vpdpbusd takes unsigned x signed bytes: x is held as |q| and its signs move onto w.
 */
typedef struct {
    uint8_t *q;      /* [m][chunks * 64]: |x / d| rounded */
    uint64_t *neg;   /* [m][chunks]: bit i set where x[64 c + i] < 0 */
    float *d;        /* [m][chunks][16]: lanes 0-7 the scale of block 2c, lanes 8-15 of block 2c+1 */
    int64_t chunks;
} quantized_rows;

static void quantize_x(const float *x, int64_t m, int64_t ldx, int64_t k, quantized_rows *out) {
    const int64_t chunks = out->chunks;
#pragma omp parallel for schedule(static) if (m >= 8)
    for (int64_t i = 0; i < m; i++) {
        uint8_t *q = out->q + i * chunks * 64;
        uint32_t *neg = (uint32_t *)(out->neg + i * chunks);   /* two 32-bit halves per chunk */
        float *d = out->d + i * chunks * 16;
        for (int64_t b = 0; b < chunks * 2; b++) {
            const int64_t k0 = b * 32, n = k - k0 < 32 ? (k - k0 > 0 ? k - k0 : 0) : 32;
            const __mmask16 lo_mask = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
            const __mmask16 hi_mask = n >= 32 ? 0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
            const __m512 lo = _mm512_maskz_loadu_ps(lo_mask, x + i * ldx + k0);
            const __m512 hi = _mm512_maskz_loadu_ps(hi_mask, x + i * ldx + k0 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            /* rounded to nearest, ties to even (the default rounding mode) */
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(q + k0), _mm512_cvtepi32_epi8(_mm512_abs_epi32(qlo)));
            _mm_storeu_si128((__m128i *)(q + k0 + 16), _mm512_cvtepi32_epi8(_mm512_abs_epi32(qhi)));
            neg[b] = (uint32_t)_mm512_cmplt_epi32_mask(qlo, _mm512_setzero_si512()) |
                     (uint32_t)_mm512_cmplt_epi32_mask(qhi, _mm512_setzero_si512()) << 16;
            _mm256_storeu_ps(d + (b / 2) * 16 + (b % 2) * 8, _mm256_set1_ps(scale));
        }
    }
}

static inline __attribute__((always_inline)) void block_i8(const quantized_rows *xq, int mr, const int8_t *w,
                                                           const float *scale, int64_t k, int nr, float *y,
                                                           int64_t ldy) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t chunks = xq->chunks;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t k0 = c * 64;
        const __mmask64 mask = k - k0 >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - k0)) - 1);
        __m512i wv[NR];
        for (int j = 0; j < nr; j++) {
            _mm_prefetch((const char *)(w + j * k + k0) + PREFETCH_BYTES, _MM_HINT_T0);
            wv[j] = _mm512_maskz_loadu_epi8(mask, w + j * k + k0);
        }
        for (int i = 0; i < mr; i++) {
            const __m512i xv = _mm512_loadu_si512(xq->q + (i * chunks + c) * 64);
            const __mmask64 neg = xq->neg[i * chunks + c];
            const __m512 dv = _mm512_loadu_ps(xq->d + (i * chunks + c) * 16);
            for (int j = 0; j < nr; j++) {
                const __m512i ws = _mm512_mask_sub_epi8(wv[j], neg, _mm512_setzero_si512(), wv[j]);
                const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, ws);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]) * scale[j];
}

/* raymoe_f32_grouped with int8 weights: weight g is w + g * w_stride with scales scale + g * n.
 * Returns 0, or -1 when out of memory. */
int raymoe_i8_grouped(const float *x, int64_t m, int64_t ldx, const int8_t *w, const float *scale,
                      int64_t w_stride, const int64_t *groups, int64_t count, int64_t n, int64_t k, float *y,
                      int64_t ldy) {
    quantized_rows xq;
    xq.chunks = (k + 63) / 64;
    void *buffer = aligned_alloc(64, (size_t)(m * xq.chunks * (64 + 8 + 64)));
    if (!buffer) return -1;
    xq.q = buffer;
    xq.d = (float *)(xq.q + m * xq.chunks * 64);
    xq.neg = (uint64_t *)(xq.d + m * xq.chunks * 16);
    quantize_x(x, m, ldx, k, &xq);
    const int64_t blocks = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < count * blocks; item++) {
        const int64_t *group = groups + 3 * (item / blocks);
        const int64_t n0 = item % blocks * NR;
        const int nr = n - n0 < NR ? (int)(n - n0) : NR;
        for (int64_t m0 = group[1]; m0 < group[2]; m0 += MR) {
            const int mr = group[2] - m0 < MR ? (int)(group[2] - m0) : MR;
            quantized_rows rows = {xq.q + m0 * xq.chunks * 64, xq.neg + m0 * xq.chunks,
                                   xq.d + m0 * xq.chunks * 16, xq.chunks};
            const int8_t *wb = w + group[0] * w_stride + n0 * k;
            float *yb = y + m0 * ldy + n0;
#define CALL_I8(MR_, NR_) block_i8(&rows, MR_, wb, scale + group[0] * n + n0, k, NR_, yb, ldy)
            DISPATCH(CALL_I8)
        }
    }
    free(buffer);
    return 0;
}

#endif /* FEW_ROWS == 2 */
