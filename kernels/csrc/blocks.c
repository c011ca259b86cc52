/* Matrix products read straight from GGML quantised blocks (the bytes a GGUF file stores).
 *
 * y[i, r] = x[i] . w[r], with w[r] one weight row of blocks. Two ways to multiply:
 *   exact: the row is dequantised (bit for bit as gguf-py does) into a float buffer in cache and
 *          multiplied with float32 accumulation.
 *   fast:  as llama.cpp: each activation block is quantised to int8 (Q8_K: 256 values with sums
 *          per 16, for K-quants; Q8_0: 32 values otherwise), the weight row is unpacked to
 *          unsigned bytes u with w = dw * sc * (u - off) - dm * mn (per block / sub-block), and
 *          the products are integer dot products summed in int32, scaled per block in float.
 *
 * Every output is computed by one thread, one weight row at a time, in a fixed order: results
 * depend neither on the thread count nor on which other rows are in the call. Each weight row
 * is read from memory once per call, whatever the number of activation rows.
 *
 * Built with -march=native on the machine that runs it (and -ffp-contract=off, so the
 * dequantisation rounds exactly as gguf-py's numpy code): AVX-512 VNNI, AVX2 or portable C; and
 * where the compiler targets AMX (__AMX_TILE__, __AMX_INT8__), many-row products on AMX tiles
 * when raymoe_blocks_set_amx turns them on, with the same results as VNNI.
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* AVX-512 also needs VBMI (byte permutes): without it (Cascade Lake) the AVX2 code builds */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define ARCH 2
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define ARCH 1
#include <immintrin.h>
#else
#define ARCH 0
#endif

/* 2 = AVX-512 VNNI and VBMI, 1 = AVX2, 0 = portable C: which code paths this build uses. */
int raymoe_blocks_arch(void) { return ARCH; }

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
       Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39 };

#define QK 256            /* elements of a K-quant super-block */
#define NR 16             /* weight rows per parallel work item (the fast kernels run them in one call) */
#define TILE 64           /* weight rows dequantised at once for many-row products */
/* Far enough ahead in the weight stream that the lines arrive before use (few_rows.c measured
 * 4-16 KB best here; the hardware prefetcher alone is slower). Each line is prefetched twice:
 * PREFETCH_BYTES ahead into L2 only (prefetcht2), then NEAR_BYTES ahead into L1: measured here,
 * 5-15% faster from memory at one thread than one prefetcht0 per line 8 KB ahead (the far
 * requests hold no L1 fill buffer for the whole trip from memory). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#ifndef NEAR_BYTES
#define NEAR_BYTES 2048
#endif

/* Prefetches the lines from next up to PREFETCH_BYTES past end, as the stream reaches end: one
 * line at a time between the work (a burst of prefetches stalls on the line fill buffers). */
static inline const uint8_t *prefetch_ahead(const uint8_t *next, const uint8_t *end) {
    for (; next < end + PREFETCH_BYTES; next += 64) {
        __builtin_prefetch(next, 0, 1);
        __builtin_prefetch(next - (PREFETCH_BYTES - NEAR_BYTES), 0, 3);
    }
    return next;
}

static int block_elems(int t) {
    switch (t) {
    case F32: case F16: case BF16: return 1;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return QK;
    default: return 32;
    }
}

static int block_bytes(int t) {
    switch (t) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case MXFP4: return 17;
    default: return 0;
    }
}

static int is_k_quant(int t) { return block_elems(t) == QK; }
static int is_float(int t) { return block_elems(t) == 1; }
#if ARCH >= 1
static int has_offset_k(int t) { return t == Q3_K || t == Q6_K; }
static int has_min_k(int t) { return t == Q2_K || t == Q4_K || t == Q5_K; }
#endif

/* ---- scalars ------------------------------------------------------------------------------ */

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* IEEE half to float, exact (subnormals, infinities and NaN included). */
static inline float f16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return from_bits(sign | 0x7f800000u | man << 13);
    if (exp) return from_bits(sign | (exp + 112) << 23 | man << 13);
    if (!man) return from_bits(sign);
    uint32_t e = 113; /* subnormal: shift the leading one up to the implicit bit */
    while (!(man & 0x400u)) {
        man <<= 1;
        e--;
    }
    return from_bits(sign | e << 23 | (man & 0x3ffu) << 13);
}

/* e8m0 scale halved (MXFP4 values are stored doubled). */
static inline float e8m0_half(uint8_t e) { return from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Q3_K's 16 six-bit scales, 32 subtracted. */
static inline void q3_k_scales(const uint8_t *s, int *sc) {
    for (int j = 0; j < 16; j++) {
        const int lo = (s[j % 8] >> (4 * (j / 8))) & 15, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (lo | hi << 4) - 32;
    }
}

/* Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int *sc, int *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
        mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

/* Element e of a Q2_K/Q3_K super-block: 2 bits of qs byte 32 * (e / 128) + e % 32, pair (e / 32) % 4. */
static inline int two_bits(const uint8_t *qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3; }

/* Element e of a Q6_K super-block, 0..63. */
static inline int q6_value(const uint8_t *b, int e) {
    const int h = e / 128, i = e % 128;
    const int lo = (b[64 * h + i % 64] >> (4 * (i / 64))) & 15;
    const int hi = (b[128 + 32 * h + i % 32] >> (2 * (i / 32))) & 3;
    return lo | hi << 4;
}

/* Weight row r of weight g when a weight's n rows are two weights' rows one after the other (a
 * MoE's gate and up experts, read from the file apart): rows below n1 are raw + g * w_stride's,
 * the rest raw2 + g * w_stride2's. With raw2 NULL, n1 is n: one weight. */
typedef struct {
    const uint8_t *raw, *raw2;
    int64_t w_stride, w_stride2, n1, row_bytes;
} weight_rows;

static inline const uint8_t *weight_row(const weight_rows *w, int64_t g, int64_t r) {
    return r < w->n1 ? w->raw + g * w->w_stride + r * w->row_bytes
                     : w->raw2 + g * w->w_stride2 + (r - w->n1) * w->row_bytes;
}

/* ---- fast mode: activations quantised to int8 blocks -------------------------------------- */

typedef struct {
    int8_t *q;      /* [m][kq]: in the order the weight bytes unpack in (act_pos), zero padded */
    float *d;       /* [m][nb]: scale of each block (zero padded) */
    float *ds;      /* [m][nb]: d * sum of the block's q (the term of a weight's constant part) */
    int32_t *corr;  /* [m][nb]: -off * sum of the block's q (offset of the unsigned weight bytes) */
    int16_t *bsum;  /* [m][k / 16]: sum of q per 16 */
    /* 32-blocks on AVX-512, per lane of a group of blocks (group_blocks() of them to 16 lanes):
     * d, and corr and ds in each block's first lane only (the lanes are summed) */
    float *lane_d, *lane_ds;  /* [m][lanes] */
    int32_t *lane_corr;       /* [m][lanes] */
    int64_t nb;     /* blocks per row, rounded up to even (the VNNI path reads blocks in pairs) */
    int64_t kq;     /* row stride of q: k rounded up to whole groups of 128 */
    int64_t lanes;  /* lanes per row */
} quantized_x;

/* 32-blocks unpacked together into one pair of 64-byte registers: Q8_0's two blocks fill one,
 * the nibbles of four blocks of the other types fill two (low nibbles, then high). */
static int group_blocks(int t) { return t == Q8_0 ? 2 : 4; }

/* Where element e of an activation row goes in xq->q. On AVX-512, register z (0-3) of a K-quant
 * super-block holds elements 32z.. and 128 + 32z.. (how Q2_K/Q3_K's bit planes and Q6_K's high
 * bits lie), and a group of four 32-blocks holds each block's elements 0-15, then 16-31 (their
 * low and high nibbles): each 64 weight bytes then meet 64 consecutive activation bytes.
 * Elsewhere the natural order. */
static int64_t act_pos(int t, int64_t e) {
#if ARCH == 2
    if (is_k_quant(t)) return e / QK * QK + 64 * (e / 32 % 4) + 32 * (e % QK / 128) + e % 32;
    if (t != Q8_0) return e / 128 * 128 + 64 * (e % 32 / 16) + 16 * (e / 32 % 4) + e % 16;
#else
    (void)t;
#endif
    return e;
}

/* round to nearest, ties to even, for |v| < 2^22 (what the default rounding mode gives) */
static inline int round_even(float v) { return (int)((v + 12582912.0f) - 12582912.0f); }

/* max |v[i]| over n (a multiple of 16) values; NaN ignored. */
static inline float block_amax(const float *v, int n) {
#if ARCH >= 1
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), abs_mask), m); /* NaN: keeps m */
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = v[i] > amax ? v[i] : -v[i] > amax ? -v[i] : amax;
    return amax;
#endif
}

/* q[i] = round(v[i] * inv) within +-127 for 16 values (stored + 128 when biased); returns their
 * sum. cvtps rounds to nearest even as round_even does (NaN: INT_MIN either way, then -127). */
static inline int quantize16(const float *v, float inv, int biased, int8_t *q) {
#if ARCH >= 1
    const __m256 s = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256i r0 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), s)), lo), hi);
    const __m256i r1 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), s)), lo), hi);
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xd8); /* 16 int16 in order */
    __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    if (biased) b = _mm_xor_si128(b, _mm_set1_epi8((char)0x80));
    _mm_storeu_si128((__m128i *)q, b);
    __m256i t = _mm256_add_epi32(r0, r1);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1))));
#else
    int sum = 0;
    for (int i = 0; i < 16; i++) {
        int r = round_even(v[i] * inv);
        r = r > 127 ? 127 : r < -127 ? -127 : r;
        q[i] = (int8_t)(biased ? (uint8_t)(r + 128) : r);
        sum += r;
    }
    return sum;
#endif
}

/* Row x of k values to int8 blocks of qb: d = amax / 127, q = round(x / d), |x - d q| <= d / 2. */
/* natural: q in the natural order (the many-row kernels), stored as q + 128 (unsigned) when
 * natural is 2; else in act_pos's order (which keeps runs of 16 together). */
static void quantize_row(int t, const float *x, int64_t k, int qb, int off, quantized_x *xq, int64_t row,
                         int natural) {
    int8_t *q = xq->q + row * xq->kq;
    const int64_t nb = xq->nb, lanes = 16 / group_blocks(t);
    for (int64_t b = 0; b < nb; b++) {
        float *d = xq->d + row * nb + b, *ds = xq->ds + row * nb + b;
        int32_t *corr = xq->corr + row * nb + b;
        if (b * qb >= k) { /* padding */
            *d = *ds = 0.0f;
            *corr = 0;
            continue;
        }
        const float *v = x + b * qb;
        const float amax = block_amax(v, qb);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < qb; i += 16) {
            const int64_t e = b * qb + i;
            const int part = quantize16(v + i, inv, natural == 2, q + (natural ? e : act_pos(t, e)));
            xq->bsum[row * (k / 16) + e / 16] = (int16_t)part;
            sum += part;
        }
        *d = amax / 127.0f;
        *ds = *d * (float)sum;
        *corr = -off * sum;
        if (qb == 32 && xq->lane_d)
            for (int64_t l = 0; l < lanes; l++) {
                const int64_t at = row * xq->lanes + b * lanes + l;
                xq->lane_d[at] = *d;
                xq->lane_ds[at] = l ? 0.0f : *ds;
                xq->lane_corr[at] = l ? 0 : *corr;
            }
    }
}

#if ARCH == 2
/* quantize_row's natural orders, 16 values at a time: the same operations on each value (and
 * integer sums), so the same bytes and scales. */
static void quantize_row_natural(const float *x, int64_t k, int qb, int off, quantized_x *xq, int64_t row, int natural) {
    int8_t *q = xq->q + row * xq->kq;
    int16_t *bsum = xq->bsum + row * (k / 16);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512i lim = _mm512_set1_epi32(127), shift = _mm512_set1_epi32(natural == 2 ? 128 : 0);
    for (int64_t b = 0; b < xq->nb; b++) {
        float *d = xq->d + row * xq->nb + b, *ds = xq->ds + row * xq->nb + b;
        int32_t *corr = xq->corr + row * xq->nb + b;
        if (b * qb >= k) { /* padding */
            *d = *ds = 0.0f;
            *corr = 0;
            continue;
        }
        const float *v = x + b * qb;
        __m512 top = _mm512_setzero_ps();
        for (int i = 0; i < qb; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
        const float amax = _mm512_reduce_max_ps(top);
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        int sum = 0;
        for (int i = 0; i < qb; i += 16) {
            const __m512 f = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), inv), magic), magic);
            const __m512i r = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(f), _mm512_sub_epi32(_mm512_setzero_si512(), lim)), lim);
            _mm_storeu_si128((__m128i *)(q + b * qb + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(r, shift)));
            const int part = _mm512_reduce_add_epi32(r);
            bsum[(b * qb + i) / 16] = (int16_t)part;
            sum += part;
        }
        *d = amax / 127.0f;
        *ds = *d * (float)sum;
        *corr = -off * sum;
    }
}
#endif

/* -- 32-element types: a row unpacked to u (bytes), w = dw * (u - off) + dm per block -------- */

typedef struct {
    uint8_t *u;  /* [k + 64] */
    float *dw;   /* [nb] (zero padded) */
    float *dm;   /* [nb] */
} row_a;

static int offset_a(int t) {
    switch (t) {
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q8_0: return 128;
    case MXFP4: return 12;
    default: return 0;
    }
}

static int has_min_a(int t) { return t == Q4_1 || t == Q5_1; }

#if ARCH >= 1
/* The bytes of the main 32-block types with SSE, 0 where the type has no such path. */
static inline int unpack_block_a_simd(int t, const uint8_t *p, uint8_t *u, float *dw) {
    const __m128i m4 = _mm_set1_epi8(15);
    switch (t) {
    case Q8_0:
        *dw = f16(rd16(p));
        _mm256_storeu_si256((__m256i *)u, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)),
                                                           _mm256_set1_epi8((char)0x80)));
        return 1;
    case MXFP4: {
        const __m128i values = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + 1));
        *dw = e8m0_half(p[0]);
        _mm_storeu_si128((__m128i *)u, _mm_shuffle_epi8(values, _mm_and_si128(q, m4)));
        _mm_storeu_si128((__m128i *)(u + 16), _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
        return 1;
    }
    case Q4_0: {
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + 2));
        *dw = f16(rd16(p));
        _mm_storeu_si128((__m128i *)u, _mm_and_si128(q, m4));
        _mm_storeu_si128((__m128i *)(u + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m4));
        return 1;
    }
    }
    return 0;
}
#endif

/* One 32-block: its bytes u, scale dw and min dm. */
/* Not inlined: inlined into deq_row, its byte stores are reloaded as vectors before they retire
 * (store forwarding fails), 4x slower. */
__attribute__((noinline)) static void unpack_block_a(int t, const uint8_t *p, uint8_t *u, float *dw, float *dm) {
    *dm = 0.0f;
#if ARCH >= 1
    if (unpack_block_a_simd(t, p, u, dw)) return;
#endif
    switch (t) {
    case Q8_0:
        *dw = f16(rd16(p));
        for (int i = 0; i < 32; i++) u[i] = p[2 + i] ^ 0x80; /* w + 128 */
        break;
    case Q4_0: case Q4_1: {
        const uint8_t *qs = p + (t == Q4_0 ? 2 : 4);
        *dw = f16(rd16(p));
        if (t == Q4_1) *dm = f16(rd16(p + 2));
        for (int i = 0; i < 16; i++) {
            u[i] = qs[i] & 15;
            u[i + 16] = qs[i] >> 4;
        }
    } break;
    case Q5_0: case Q5_1: {
        const uint8_t *qs = p + (t == Q5_0 ? 6 : 8);
        const uint32_t qh = rd32(p + (t == Q5_0 ? 2 : 4));
        *dw = f16(rd16(p));
        if (t == Q5_1) *dm = f16(rd16(p + 2));
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
            u[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
        }
    } break;
    case MXFP4:
        *dw = e8m0_half(p[0]);
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)(MXFP4_VALUES[p[1 + i] & 15] + 12);
            u[i + 16] = (uint8_t)(MXFP4_VALUES[p[1 + i] >> 4] + 12);
        }
        break;
    }
}

static void unpack_row_a(int t, const uint8_t *raw, int64_t k, row_a *w) {
    const int bb = block_bytes(t);
    const uint8_t *ahead = raw + PREFETCH_BYTES;
    for (int64_t b = 0; b < k / 32; b++) {
        ahead = prefetch_ahead(ahead, raw + (b + 1) * bb);
        unpack_block_a(t, raw + b * bb, w->u + 32 * b, w->dw + b, w->dm + b);
    }
}

/* -- K-quants: a super-block unpacked to u, w = dw * sc * (u - off) - dm * mn per 16 ---------- */

typedef struct {
    uint8_t u[QK];
    int16_t scx[QK / 2];   /* sc of each pair of elements (lined up with maddubs' int16 lanes) */
    int16_t offsc[16];     /* -off * sc per 16 */
    int16_t mn[16];        /* min per 16 */
    float dw, dm;
    int32_t off;
    int16_t sc[16];        /* sc per 16 */
    uint8_t pad[20];       /* 640 bytes: whole cache lines */
} block_k;

static void finish_k(block_k *c, const int *sc, int off) {
    c->off = off;
    for (int s = 0; s < 16; s++) {
        c->sc[s] = (int16_t)sc[s];
        c->offsc[s] = (int16_t)(-off * sc[s]);
        for (int i = 0; i < 8; i++) c->scx[8 * s + i] = (int16_t)sc[s];
    }
}

#if ARCH >= 1
#if ARCH == 2
static const int16_t LANES[32] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                  16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
#endif

/* Q4_K/Q5_K's 12 bytes of 6-bit scales and mins at s as 16 bytes: scales 0-7, mins 0-7. With
 * x0-x2 the three 32-bit words at s: scales 0-3 = x0 & 63, 4-7 = (x2 & 15) | (x0 >> 6) << 4,
 * mins 0-3 = x1 & 63, 4-7 = (x2 >> 4) | (x1 >> 6) << 4, per byte; computed in a register
 * (assembling them in memory stalls on store forwarding, ~3x slower decode). */
static inline __m128i scale_min_bytes_k(const uint8_t *s) {
    const __m128i x = _mm_loadu_si128((const __m128i *)s); /* 16 bytes: inside the block */
    const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(x, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i high = _mm_srli_epi32(_mm_shuffle_epi32(x, _MM_SHUFFLE(1, 1, 0, 0)), 2);
    return _mm_or_si128(_mm_and_si128(low, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                        _mm_and_si128(high, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

/* Q3_K's sixteen 6-bit scales at s less 32, as int16. With x0-x2 the three 32-bit words at s:
 * scales 0-3 = (x0 & 15) | (x2 & 3) << 4, 4-7 from x1 and x2 >> 2, 8-11 from x0 >> 4 and x2 >> 4,
 * 12-15 from x1 >> 4 and x2 >> 6, per byte. */
static inline __m256i scales_q3_k(const uint8_t *s) {
    /* the 12 bytes only: the block ends 2 bytes after them, and a row's last block may end a buffer */
    const __m128i x = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)s), (int)rd32(s + 8), 2);
    const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 1, 0)), _mm_setr_epi32(0, 0, 4, 4));
    const __m128i high = _mm_srlv_epi32(_mm_shuffle_epi32(x, _MM_SHUFFLE(2, 2, 2, 2)), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i a = _mm_or_si128(_mm_and_si128(low, _mm_set1_epi8(15)), _mm_slli_epi32(_mm_and_si128(high, _mm_set1_epi8(3)), 4));
    return _mm256_sub_epi16(_mm256_cvtepu8_epi16(a), _mm256_set1_epi16(32));
}

/* finish_k from the 16 scales sc and mins mn as int16 lanes. */
static inline void finish_k_simd(block_k *c, __m256i sc, __m256i mn, int off) {
    c->off = off;
#if ARCH == 2
    const __m512i lanes = _mm512_loadu_si512(LANES), s = _mm512_castsi256_si512(sc);
    for (int j = 0; j < 4; j++) {
        const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(lanes, 3), _mm512_set1_epi16((short)(4 * j)));
        _mm512_store_si512(c->scx + 32 * j, _mm512_permutexvar_epi16(idx, s));
    }
#else /* AVX2 has no 16-bit permute: each scale broadcast to its 8 lanes */
    int16_t each[16];
    _mm256_storeu_si256((__m256i *)each, sc);
    for (int j = 0; j < 16; j++) _mm_storeu_si128((__m128i *)(c->scx + 8 * j), _mm_set1_epi16(each[j]));
#endif
    _mm256_storeu_si256((__m256i *)c->sc, sc);
    _mm256_storeu_si256((__m256i *)c->offsc, _mm256_mullo_epi16(sc, _mm256_set1_epi16((short)-off)));
    _mm256_storeu_si256((__m256i *)c->mn, mn);
}

/* u = the two bits of each byte of q at shift, plus 4 h (Q3_K) or the high nibble (Q6_K) */
static inline __m256i bits(__m256i q, int shift, __m256i mask) { return _mm256_and_si256(_mm256_srli_epi16(q, shift), mask); }

/* The main K-quants with AVX2 (and AVX-512's scale permutes); 0 where the type has no such path. */
static inline int unpack_block_k_simd(int t, const uint8_t *b, block_k *c) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    switch (t) {
    case Q4_K: {
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
            _mm256_storeu_si256((__m256i *)(c->u + 64 * j), _mm256_and_si256(q, m4));
            _mm256_storeu_si256((__m256i *)(c->u + 64 * j + 32), bits(q, 4, m4));
        }
        c->dw = f16(rd16(b));
        c->dm = f16(rd16(b + 2));
#if ARCH == 2
        const __m256i v = _mm256_cvtepu8_epi16(scale_min_bytes_k(b + 4));
        const __m256i half = _mm256_srli_epi16(_mm512_castsi512_si256(_mm512_loadu_si512(LANES)), 1);
        finish_k_simd(c, _mm256_permutexvar_epi16(half, v),
                      _mm256_permutexvar_epi16(_mm256_add_epi16(half, _mm256_set1_epi16(8)), v), 0);
#else /* each of the 8 scales and mins covers two 16s */
        const __m128i v = scale_min_bytes_k(b + 4);
        finish_k_simd(c, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v)), 0);
#endif
        return 1;
    }
    case Q6_K:
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i hq = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            uint8_t *u = c->u + 128 * h;
            _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(bits(hq, 0, m2), 4)));
            _mm256_storeu_si256((__m256i *)(u + 32), _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(bits(hq, 2, m2), 4)));
            _mm256_storeu_si256((__m256i *)(u + 64), _mm256_or_si256(bits(l0, 4, m4), _mm256_slli_epi16(bits(hq, 4, m2), 4)));
            _mm256_storeu_si256((__m256i *)(u + 96), _mm256_or_si256(bits(l1, 4, m4), _mm256_slli_epi16(bits(hq, 6, m2), 4)));
        }
        c->dw = f16(rd16(b + 208));
        c->dm = 0.0f;
        finish_k_simd(c, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))), _mm256_setzero_si256(), 32);
        return 1;
    case Q3_K: {
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
            for (int j = 0; j < 4; j++)
                _mm256_storeu_si256((__m256i *)(c->u + 128 * h + 32 * j),
                                   _mm256_or_si256(bits(q, 2 * j, m2), _mm256_slli_epi16(bits(hm, 4 * h + j, m1), 2)));
        }
        const __m256i sc = scales_q3_k(b + 96);
        c->dw = f16(rd16(b + 108));
        c->dm = 0.0f;
        finish_k_simd(c, sc, _mm256_setzero_si256(), 4);
        return 1;
    }
    }
    return 0;
}
#endif

static void unpack_block_k(int t, const uint8_t *b, block_k *c) {
    int sc[16];
#if ARCH >= 1
    if (unpack_block_k_simd(t, b, c)) return;
#endif
    switch (t) {
    case Q2_K:
        c->dw = f16(rd16(b + 80));
        c->dm = f16(rd16(b + 82));
        for (int e = 0; e < QK; e++) c->u[e] = (uint8_t)two_bits(b + 16, e);
        for (int s = 0; s < 16; s++) {
            sc[s] = b[s] & 15;
            c->mn[s] = b[s] >> 4;
        }
        finish_k(c, sc, 0);
        break;
    case Q3_K: /* q - 4 (1 - h) + 4 = q + 4 h */
        c->dw = f16(rd16(b + 108));
        c->dm = 0.0f;
        for (int e = 0; e < QK; e++) c->u[e] = (uint8_t)(two_bits(b + 32, e) + 4 * ((b[e % 32] >> (e / 32)) & 1));
        q3_k_scales(b + 96, sc);
        memset(c->mn, 0, sizeof c->mn);
        finish_k(c, sc, 4);
        break;
    case Q4_K: case Q5_K: {
        const uint8_t *qs = b + (t == Q4_K ? 16 : 48);
        int s8[8], m8[8];
        c->dw = f16(rd16(b));
        c->dm = f16(rd16(b + 2));
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 32; i++) c->u[32 * j + i] = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
        if (t == Q5_K)
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 32; i++) c->u[32 * j + i] |= ((b[16 + i] >> j) & 1) << 4;
        k_scale_min(b + 4, s8, m8);
        for (int s = 0; s < 16; s++) {
            sc[s] = s8[s / 2];
            c->mn[s] = (int16_t)m8[s / 2];
        }
        finish_k(c, sc, 0);
    } break;
    case Q6_K:
        c->dw = f16(rd16(b + 208));
        c->dm = 0.0f;
        for (int e = 0; e < QK; e++) c->u[e] = (uint8_t)q6_value(b, e);
        for (int s = 0; s < 16; s++) sc[s] = (int8_t)b[192 + s];
        memset(c->mn, 0, sizeof c->mn);
        finish_k(c, sc, 32);
        break;
    }
}

static void unpack_row_k(int t, const uint8_t *raw, int64_t k, block_k *c) {
    const int bb = block_bytes(t);
    const uint8_t *ahead = raw + PREFETCH_BYTES;
    for (int64_t b = 0; b < k / QK; b++) {
        ahead = prefetch_ahead(ahead, raw + (b + 1) * bb);
        unpack_block_k(t, raw + b * bb, c + b);
    }
}

/* ---- exact dequantisation, rounding as gguf-py: from the unpacked bytes ---------------------- */

/* w = (dw * sc) * (u - off) - dm * mn, per 16 (gguf-py's order of operations for every K-quant;
 * subtracting +0 where there are no mins changes nothing, -0 included). */
static void deq_block_k(const block_k *c, float *y) {
#if ARCH >= 1
    const __m256i off = _mm256_set1_epi32(c->off);
    for (int s = 0; s < 16; s++) {
        const __m256 dl = _mm256_set1_ps(c->dw * (float)c->scx[8 * s]), ml = _mm256_set1_ps(c->dm * (float)c->mn[s]);
        for (int i = 0; i < 16; i += 8) {
            const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c->u + 16 * s + i)));
            const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(u, off));
            _mm256_storeu_ps(y + 16 * s + i, _mm256_sub_ps(_mm256_mul_ps(dl, q), ml));
        }
    }
    return;
#endif
    for (int s = 0; s < 16; s++) {
        const float dl = c->dw * (float)c->scx[8 * s], ml = c->dm * (float)c->mn[s];
        for (int i = 0; i < 16; i++) y[16 * s + i] = dl * (float)(c->u[16 * s + i] - c->off) - ml;
    }
}

/* One row of k elements: raw blocks -> y. Warms the cache PREFETCH_BYTES ahead in the stream. */
static void deq_row(int t, const uint8_t *raw, int64_t k, float *y) {
    const int be = block_elems(t), bb = block_bytes(t);
    const uint8_t *ahead = prefetch_ahead(raw + PREFETCH_BYTES, raw + (is_float(t) ? k * bb : 0));
    switch (t) {
    case F32: memcpy(y, raw, (size_t)k * 4); return;
    case F16: {
        int64_t i = 0;
#if ARCH >= 1 && defined(__F16C__)
        for (; i + 8 <= k; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(raw + 2 * i))));
#endif
        for (; i < k; i++) y[i] = f16(rd16(raw + 2 * i));
        return;
    }
    case BF16:
        for (int64_t i = 0; i < k; i++) y[i] = from_bits((uint32_t)rd16(raw + 2 * i) << 16);
        return;
    }
    if (be == QK) {
        block_k c __attribute__((aligned(64)));
        for (int64_t b = 0; b < k / QK; b++) {
            ahead = prefetch_ahead(ahead, raw + (b + 1) * bb);
            unpack_block_k(t, raw + b * bb, &c);
            deq_block_k(&c, y + b * QK);
        }
        return;
    }
    const int off = offset_a(t);
    for (int64_t b = 0; b < k / 32; b++) {
        uint8_t u[32];
        float dw, dm;
        ahead = prefetch_ahead(ahead, raw + (b + 1) * bb);
        unpack_block_a(t, raw + b * bb, u, &dw, &dm);
        /* d * (q - off), then + m for the types with one (adding +0 would turn -0 into +0) */
#if ARCH >= 1
        for (int i = 0; i < 32; i += 8) {
            const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + i)));
            _mm256_storeu_ps(y + 32 * b + i, _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(off)))));
        }
#else
        for (int i = 0; i < 32; i++) y[32 * b + i] = dw * (float)(u[i] - off);
#endif
        if (has_min_a(t))
            for (int i = 0; i < 32; i++) y[32 * b + i] = y[32 * b + i] + dm;
    }
}

/* ---- dot products, one per code path ------------------------------------------------------ */
#if ARCH == 2

static float dot_f32(const float *x, const float *w, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(w + i + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), _mm512_loadu_ps(w + i + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), _mm512_loadu_ps(w + i + 48), a3);
    }
    for (; i < k; i += 16) {
        const __mmask16 mask = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + i), _mm512_maskz_loadu_ps(mask, w + i), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* ---- AVX-512 fast mode: weights unpacked in registers and dotted at once -------------------
 * Each weight row is read once, straight from its blocks; the unpacked bytes stay in registers
 * and meet up to four activation rows (their q lies in the order the bytes unpack in, act_pos).
 * Every row's arithmetic is the same whichever rows share the pass. */

#define INLINE static inline __attribute__((always_inline))

/* -- 32-blocks: a group of group_blocks(t) blocks to unsigned bytes u = w / dw + off --------- */

typedef struct {
    __m512i lo, hi;  /* u: Q8_0's two blocks in lo; else each block's elements 0-15, then 16-31 */
    __m512 d, m;     /* per int32 lane of the dot products: the block's scale and min (MXFP4: its
                      * scale doubled) */
} group_a;

/* The bytes of a group at p (g blocks of bb bytes, 64 < g bb <= 128): the first 64, and the last
 * 64 (overlapping, so both loads stay inside the row); a 68-byte group's last 4 broadcast instead
 * (measured 7% faster for MXFP4 at 2 threads: one load fewer that crosses a cache line). */
typedef struct { __m512i a, b; } group_bytes;

/* Whether a group's bytes past the first 64 come broadcast (Q8_0, MXFP4: 4 of them) rather than as
 * the group's last 64. */
static inline int tail_broadcast(int size) { return size == 68; }

INLINE group_bytes load_group(const uint8_t *p, int size) {
    if (tail_broadcast(size)) {
        uint32_t last;
        memcpy(&last, p + 64, 4);
        return (group_bytes){_mm512_loadu_si512(p), _mm512_set1_epi32((int)last)};
    }
    return (group_bytes){_mm512_loadu_si512(p), _mm512_loadu_si512(p + size - 64)};
}

/* Indices into a group_bytes pair (two-source byte permutes) of byte `at` of the group (a broadcast
 * tail: bytes 64-67 are b's lanes 0-3). */
static inline uint8_t pair_index(int at, int size) { return (uint8_t)(at < 64 || tail_broadcast(size) ? at : 64 + at - (size - 64)); }

typedef struct {
    __m512i bytes;  /* the quants: byte p from block p / per, byte off + p % per */
    __m512i high;   /* Q5_0/Q5_1: the byte of qh that holds the high bit of byte p's low nibble */
    __m512i high2;  /* ... of its high nibble */
    __m512i bit;    /* that bit */
    __m512i words;  /* the f16 scale (and min, 16 lanes on) of each int32 lane's block, as words */
    __m512i scale8; /* MXFP4: the e8m0 byte of each int32 lane's block (read into its third byte) */
} group_index;

/* The permutes that gather a group of type t's fields into lanes (built once per call). */
static group_index group_index_for(int t) {
    const int bb = block_bytes(t), g = group_blocks(t), size = g * bb, per = 64 / g, lanes = 16 / g;
    const int qs = t == Q8_0 ? 2 : t == MXFP4 ? 1 : t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8;
    const int qh = t == Q5_0 ? 2 : 4;
    uint8_t bytes[64], high[64], high2[64], bit[64], scale8[64];
    int16_t words[32];
    for (int p = 0; p < 64; p++) {
        const int blk = p / per, i = p % per;
        bytes[p] = pair_index(bb * blk + qs + i, size);
        high[p] = pair_index(bb * blk + qh + i / 8, size);
        high2[p] = pair_index(bb * blk + qh + 2 + i / 8, size);
        bit[p] = (uint8_t)(1 << (i % 8));
        scale8[p] = (uint8_t)(bb * (p / 4 / lanes));
    }
    for (int l = 0; l < 16; l++) {
        words[l] = (int16_t)(pair_index(bb * (l / lanes), size) / 2);
        words[16 + l] = (int16_t)(pair_index(bb * (l / lanes) + 2, size) / 2);
    }
    group_index ix;
    ix.bytes = _mm512_loadu_si512(bytes);
    ix.high = _mm512_loadu_si512(high);
    ix.high2 = _mm512_loadu_si512(high2);
    ix.bit = _mm512_loadu_si512(bit);
    ix.words = _mm512_loadu_si512(words);
    ix.scale8 = _mm512_loadu_si512(scale8);
    return ix;
}

INLINE group_a unpack_group(int t, const uint8_t *p, const group_index *ix) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const group_bytes v = load_group(p, group_blocks(t) * block_bytes(t));
    const __m512i q = _mm512_permutex2var_epi8(v.a, ix->bytes, v.b);
    group_a u;
    u.m = _mm512_setzero_ps();
    if (t == MXFP4) { /* signed values + 12, by table. vpermb reads an index's low 6 bits, so the 16 values
                       * repeated four times look up the low nibble as it is and the high one shifted down,
                       * with no masks (measured 6% faster than vpshufb on masked nibbles, 2 threads) */
        const __m512i values = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
        u.lo = _mm512_permutexvar_epi8(q, values);
        u.hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(q, 4), values);
        /* the scale doubled, 2^(e - 127), made as float bits: e into bits 23-30 (e = 0 gives 0 rather than
         * 2^-127, e = 255 inf rather than 2^128; both are outside what a quantiser writes). rows_a halves
         * the sum, so the result has the same bits as with 2^(e - 128) (scaling by 2 is exact) */
        const __m512i e = _mm512_maskz_permutexvar_epi8(0x4444444444444444ull, ix->scale8, v.a);
        u.d = _mm512_castsi512_ps(_mm512_slli_epi32(e, 7));
        return u;
    }
    if (t == Q8_0) { /* w + 128 */
        u.lo = _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
        u.hi = _mm512_setzero_si512();
    } else {
        u.lo = _mm512_and_si512(q, m4);
        u.hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    }
    if (t == Q5_0 || t == Q5_1) { /* the fifth bit, from qh */
        const __m512i sixteen = _mm512_set1_epi8(16);
        const __mmask64 lo = _mm512_test_epi8_mask(_mm512_permutex2var_epi8(v.a, ix->high, v.b), ix->bit);
        const __mmask64 hi = _mm512_test_epi8_mask(_mm512_permutex2var_epi8(v.a, ix->high2, v.b), ix->bit);
        u.lo = _mm512_mask_add_epi8(u.lo, lo, u.lo, sixteen);
        u.hi = _mm512_mask_add_epi8(u.hi, hi, u.hi, sixteen);
    }
    const __m512i words = _mm512_permutex2var_epi16(v.a, ix->words, v.b);
    u.d = _mm512_cvtph_ps(_mm512_castsi512_si256(words));
    if (has_min_a(t)) u.m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(words, 1));
    return u;
}

/* rows_a for Q8_0 and one activation row, one block per 256-bit half: the same lanes and operations
 * (so the same bits), without the permutes that gather two blocks' bytes and scales into one register
 * (measured 1.13-1.18x on one core; with more rows the permutes are shared and this is no faster). */
INLINE void row_q8_0(const uint8_t *w, int64_t k, const quantized_x *xq, int64_t row, float *y) {
    const int64_t groups = k / 64, lanes = row * xq->lanes;
    const int8_t *q = xq->q + row * xq->kq;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const uint8_t *ahead = w + PREFETCH_BYTES;
    uint8_t tail[68] __attribute__((aligned(64)));
    for (int64_t c = 0; c <= groups; c++) {
        const uint8_t *p = w + c * 68;
        if (c == groups) { /* an odd last block: the second is zero padded (its q are zero) */
            if (!(k / 32 % 2)) break;
            memset(tail, 0, sizeof tail);
            memcpy(tail, p, 34);
            p = tail;
        } else {
            ahead = prefetch_ahead(ahead, p + 68);
        }
        const int64_t lane = lanes + 16 * c;
        const __m256i u0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), flip);
        const __m256i u1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 36)), flip);
        const __m256i s0 = _mm256_dpbusd_epi32(_mm256_load_si256((const __m256i *)(xq->lane_corr + lane)), u0,
                                               _mm256_load_si256((const __m256i *)(q + 64 * c)));
        const __m256i s1 = _mm256_dpbusd_epi32(_mm256_load_si256((const __m256i *)(xq->lane_corr + lane + 8)), u1,
                                               _mm256_load_si256((const __m256i *)(q + 64 * c + 32)));
        const __m256 d0 = _mm256_set1_ps(f16(rd16(p))), d1 = _mm256_set1_ps(f16(rd16(p + 34)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, _mm256_load_ps(xq->lane_d + lane)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, _mm256_load_ps(xq->lane_d + lane + 8)), acc1);
    }
    const __m512d both = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(acc0)), _mm256_castps_pd(acc1), 1);
    *y = _mm512_reduce_add_ps(_mm512_castpd_ps(both));
}

/* y[i * ldy] = x[row + i] . w for i < nr: per group, dpbusd sums u * q per block in its lanes
 * (from -off * sum q, the offset), scaled per lane by dw * dx; the mins add dm * dx * sum q. */
INLINE void rows_a(int t, int nr, const uint8_t *w, int64_t k, const quantized_x *xq, int64_t row, float *y,
                   int64_t ldy, const group_index *ix) {
    if (t == Q8_0 && nr == 1) {
        row_q8_0(w, k, xq, row, y);
        return;
    }
    const int g = group_blocks(t), bb = block_bytes(t), size = g * bb, left = (int)(k / 32 % g);
    const int64_t groups = k / 32 / g;
    const group_index gx = *ix; /* in registers: the loop below calls nothing that could change it */
    const int32_t *corr[4];
    const float *ld[4], *lds[4];
    const int8_t *qr[4];
    __m512 acc[4];
    for (int i = 0; i < nr; i++) {
        acc[i] = _mm512_setzero_ps();
        corr[i] = xq->lane_corr + (row + i) * xq->lanes;
        ld[i] = xq->lane_d + (row + i) * xq->lanes;
        lds[i] = xq->lane_ds + (row + i) * xq->lanes;
        qr[i] = xq->q + (row + i) * xq->kq;
    }
    const uint8_t *ahead = w + PREFETCH_BYTES;
    uint8_t tail[128] __attribute__((aligned(64)));
    for (int64_t c = 0; c < groups + (left > 0); c++) {
        const uint8_t *p = w + c * size;
        if (c == groups) { /* the last blocks short of a group: zero padded (their q are zero) */
            memset(tail, 0, sizeof tail);
            memcpy(tail, p, (size_t)(left * bb));
            p = tail;
        } else {
            ahead = prefetch_ahead(ahead, p + size);
        }
        const group_a u = unpack_group(t, p, &gx);
        for (int i = 0; i < nr; i++) {
            const int8_t *q = qr[i] + 64 * (c * g / 2);
            __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(corr[i] + 16 * c), u.lo, _mm512_load_si512(q));
            if (g == 4) s = _mm512_dpbusd_epi32(s, u.hi, _mm512_load_si512(q + 64));
            const __m512 dx = _mm512_load_ps(ld[i] + 16 * c); /* dw dx, rounded once either way */
            const __m512 scale = _mm512_mul_ps(u.d, dx);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
            if (has_min_a(t)) acc[i] = _mm512_fmadd_ps(u.m, _mm512_load_ps(lds[i] + 16 * c), acc[i]);
        }
    }
    const float half = t == MXFP4 ? 0.5f : 1.0f; /* MXFP4's scales came doubled */
    for (int i = 0; i < nr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]) * half;
}

/* -- K-quants: a super-block to four registers of bytes u, w = dw sc (u - off) - dm mn per 16 -- */

typedef struct {
    __m512i u[4];    /* register z: elements 32z.. and 128 + 32z.. (act_pos) */
    __m512i sc[4];   /* the scale of each int16 lane of register z's pair products */
    __m256i offsc;   /* -off * sc per 16 */
    __m256i mn;      /* the min per 16 */
    float dw, dm;
} block_kr;

/* Register z's 128-bit lanes hold sub-blocks of 16 number 2z, 2z + 1, 8 + 2z, 9 + 2z. */
static const int16_t SPREAD[4][32] = {
#define SPREAD_ROW(z) {2 * z, 2 * z, 2 * z, 2 * z, 2 * z, 2 * z, 2 * z, 2 * z, 2 * z + 1, 2 * z + 1, 2 * z + 1, 2 * z + 1, \
    2 * z + 1, 2 * z + 1, 2 * z + 1, 2 * z + 1, 8 + 2 * z, 8 + 2 * z, 8 + 2 * z, 8 + 2 * z, 8 + 2 * z, 8 + 2 * z, \
    8 + 2 * z, 8 + 2 * z, 9 + 2 * z, 9 + 2 * z, 9 + 2 * z, 9 + 2 * z, 9 + 2 * z, 9 + 2 * z, 9 + 2 * z, 9 + 2 * z}
    SPREAD_ROW(0), SPREAD_ROW(1), SPREAD_ROW(2), SPREAD_ROW(3)
#undef SPREAD_ROW
};

/* The 16 scales (int16, per 16 elements) to the lanes of each register; the offset's term. */
INLINE void spread_scales(block_kr *c, __m256i sc, int off) {
    const __m512i s = _mm512_castsi256_si512(sc);
    for (int z = 0; z < 4; z++) c->sc[z] = _mm512_permutexvar_epi16(_mm512_loadu_si512(SPREAD[z]), s);
    c->offsc = _mm256_mullo_epi16(sc, _mm256_set1_epi16((short)-off));
}

/* Q4_K/Q5_K: the 128 nibble bytes at qs as registers: low nibbles of bytes 0-31 and 64-95, their
 * high nibbles, then the same of bytes 32-63 and 96-127. */
INLINE void nibbles_k(const uint8_t *qs, __m512i *u) {
    const __m512i l0 = _mm512_loadu_si512(qs), l1 = _mm512_loadu_si512(qs + 64), m4 = _mm512_set1_epi8(15);
    const __m512i a = _mm512_shuffle_i64x2(l0, l1, 0x44), b = _mm512_shuffle_i64x2(l0, l1, 0xee);
    u[0] = _mm512_and_si512(a, m4);
    u[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
    u[2] = _mm512_and_si512(b, m4);
    u[3] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
}

/* Adds `value` to u where the bit (e / 32) of byte e % 32 of the 32 bytes at h is set (Q3_K's
 * hmask, Q5_K's qh). */
INLINE void add_high_bits(const uint8_t *h, __m512i *u, int value) {
    const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)h));
    const __m512i first = _mm512_mask_blend_epi64(0xf0, _mm512_set1_epi8(1), _mm512_set1_epi8(16));
    for (int z = 0; z < 4; z++) {
        const __mmask64 set = _mm512_test_epi8_mask(hb, _mm512_slli_epi16(first, z));
        u[z] = _mm512_mask_add_epi8(u[z], set, u[z], _mm512_set1_epi8((char)value));
    }
}

#ifdef __GFNI__
/* Bit matrices for gf2p8affine (output bit i = the bits of byte 7 - i of the matrix taken from the input byte):
 * Q3_LOW[z] moves bits 2z, 2z + 1 of each byte to bits 0, 1; Q3_HIGH[z] moves bit z (bytes 0-31 of a
 * register) or bit z + 4 (bytes 32-63) to bit 2: register z of a Q3_K super-block's u, as add_high_bits. */
static const long long Q3_LOW[4] = {0x0102000000000000LL, 0x0408000000000000LL, 0x1020000000000000LL,
                                    (long long)0x4080000000000000ULL};
#define Q3_H(bit) (1LL << (bit)) << 40
#define Q3_HIGH_ROW(z) {Q3_H(z), Q3_H(z), Q3_H(z), Q3_H(z), Q3_H(z + 4), Q3_H(z + 4), Q3_H(z + 4), Q3_H(z + 4)}
static const long long Q3_HIGH[4][8] __attribute__((aligned(64))) = {Q3_HIGH_ROW(0), Q3_HIGH_ROW(1), Q3_HIGH_ROW(2),
                                                                    Q3_HIGH_ROW(3)};
#undef Q3_HIGH_ROW
#undef Q3_H
#endif

/* Q4_K/Q5_K's eight 6-bit scales and mins, as 16 int16 each per 16 elements. */
INLINE void scale_min_k(const uint8_t *s, block_kr *c) {
    const __m256i v = _mm256_cvtepu8_epi16(scale_min_bytes_k(s));
    const __m256i half = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    spread_scales(c, _mm256_permutexvar_epi16(half, v), 0);
    c->mn = _mm256_permutexvar_epi16(_mm256_add_epi16(half, _mm256_set1_epi16(8)), v);
}

INLINE void unpack_kr(int t, const uint8_t *b, block_kr *c) {
    const __m512i m2 = _mm512_set1_epi8(3);
    c->dw = c->dm = 0.0f;
    c->mn = _mm256_setzero_si256();
    switch (t) {
    case Q4_K: case Q5_K:
        c->dw = f16(rd16(b));
        c->dm = f16(rd16(b + 2));
        nibbles_k(b + (t == Q4_K ? 16 : 48), c->u);
        if (t == Q5_K) add_high_bits(b + 16, c->u, 16);
        scale_min_k(b + 4, c);
        break;
    case Q6_K: { /* low nibbles of ql 0-31 and 64-95, of 32-63 and 96-127, then their high ones */
        const __m512i l0 = _mm512_loadu_si512(b), l1 = _mm512_loadu_si512(b + 64), h = _mm512_loadu_si512(b + 128);
        const __m512i a = _mm512_shuffle_i64x2(l0, l1, 0x44), bq = _mm512_shuffle_i64x2(l0, l1, 0xee);
        const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
        const __m512i lo[4] = {a, bq, _mm512_srli_epi16(a, 4), _mm512_srli_epi16(bq, 4)};
        const __m512i hi[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};
        for (int z = 0; z < 4; z++) c->u[z] = _mm512_or_si512(_mm512_and_si512(lo[z], m4), _mm512_and_si512(hi[z], m30));
        c->dw = f16(rd16(b + 208));
        spread_scales(c, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))), 32);
        break;
    }
#ifdef __GFNI__
    case Q3_K: { /* u = q + 4 h (q - 4 (1 - h) + 4), each part's bits picked by one bit-matrix product
                  * (5-7% faster for one activation row than shifts and masked adds; the same bytes) */
        const __m512i q = _mm512_loadu_si512(b + 32);
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b));
        for (int z = 0; z < 4; z++)
            c->u[z] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(q, _mm512_set1_epi64(Q3_LOW[z]), 0),
                                      _mm512_gf2p8affine_epi64_epi8(h, _mm512_loadu_si512(Q3_HIGH[z]), 0));
        c->dw = f16(rd16(b + 108));
        spread_scales(c, scales_q3_k(b + 96), 4);
        break;
    }
    case Q2_K: {
#else
    case Q3_K: case Q2_K: { /* 2-bit planes of 64 bytes; Q3_K adds 4 h (q - 4 (1 - h) + 4) */
#endif
        const __m512i q = _mm512_loadu_si512(b + (t == Q3_K ? 32 : 16));
        for (int z = 0; z < 4; z++) c->u[z] = _mm512_and_si512(_mm512_srli_epi16(q, 2 * z), m2);
        if (t == Q2_K) {
            const __m128i s = _mm_loadu_si128((const __m128i *)b);
            c->dw = f16(rd16(b + 80));
            c->dm = f16(rd16(b + 82));
            spread_scales(c, _mm256_cvtepu8_epi16(_mm_and_si128(s, _mm_set1_epi8(15))), 0);
            c->mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(15)));
            break;
        }
        add_high_bits(b, c->u, 4);
        c->dw = f16(rd16(b + 108));
        spread_scales(c, scales_q3_k(b + 96), 4);
        break;
    }
    }
}


/* y[i * ldy] = x[row + i] . w for i < nr: per super-block, maddubs pairs u * q into int16 and
 * dpwssd scales them per 16 into int32 (from the offset's term -off sc bsum); the mins mn bsum
 * are scaled by dm apart. */
INLINE void rows_k(int t, int nr, const uint8_t *w, int64_t k, const quantized_x *xq, int64_t row, float *y,
                   int64_t ldy) {
    const int bb = block_bytes(t);
    __m512 acc[4];
    __m256 accm[4];
    for (int i = 0; i < nr; i++) {
        acc[i] = _mm512_setzero_ps();
        accm[i] = _mm256_setzero_ps();
    }
    const int8_t *qr[4];
    const int16_t *bsr[4];
    const float *dr[4];
    for (int i = 0; i < nr; i++) { /* each row's activations (locals: kept in registers through the loop) */
        qr[i] = xq->q + (row + i) * xq->kq;
        bsr[i] = xq->bsum + (row + i) * (k / 16);
        dr[i] = xq->d + (row + i) * xq->nb;
    }
    const uint8_t *ahead = w + PREFETCH_BYTES;
    for (int64_t b = 0; b < k / QK; b++) {
        ahead = prefetch_ahead(ahead, w + (b + 1) * bb);
        block_kr c;
        unpack_kr(t, w + b * bb, &c);
        const __m512 dw = _mm512_set1_ps(c.dw);
        for (int i = 0; i < nr; i++) {
            const int8_t *q = qr[i] + QK * b;
            const __m256i bsum = _mm256_loadu_si256((const __m256i *)(bsr[i] + 16 * b));
            __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512(); /* two chains, summed exactly */
            if (has_offset_k(t)) s = _mm512_zextsi256_si512(_mm256_madd_epi16(bsum, c.offsc));
            for (int z = 0; z < 4; z += 2) {
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(c.u[z], _mm512_loadu_si512(q + 64 * z)), c.sc[z]);
                s2 = _mm512_dpwssd_epi32(s2, _mm512_maddubs_epi16(c.u[z + 1], _mm512_loadu_si512(q + 64 * z + 64)),
                                         c.sc[z + 1]);
            }
            s = _mm512_add_epi32(s, s2);
            const __m512 dx = _mm512_set1_ps(dr[i][b]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[i]);
            if (has_min_k(t)) {
                const __m256 dmdx = _mm256_mul_ps(_mm256_set1_ps(c.dm), _mm512_castps512_ps256(dx));
                accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bsum, c.mn)), dmdx, accm[i]);
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        float sum = _mm512_reduce_add_ps(acc[i]);
        if (has_min_k(t)) {
            const __m128 m = _mm_add_ps(_mm256_castps256_ps128(accm[i]), _mm256_extractf128_ps(accm[i], 1));
            const __m128 m2 = _mm_add_ps(m, _mm_movehl_ps(m, m));
            sum -= _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
        }
        y[i * ldy] = sum;
    }
}

/* One function per (type, rows at once), so that both are constants inside; each runs nw weight rows
 * (ws bytes apart) into y[0 .. nw), one after another: the setup is paid once per call, not per row
 * (Qwen3.5's expert down rows are two super-blocks long). */
typedef void (*rows_fn)(const uint8_t *w, int64_t nw, int64_t ws, int64_t k, const quantized_x *xq, int64_t row,
                        float *y, int64_t ldy, const group_index *ix);

#define ROWS_A(T, N) static void rows_a_##T##_##N(const uint8_t *w, int64_t nw, int64_t ws, int64_t k, const quantized_x *xq, \
                                                   int64_t row, float *y, int64_t ldy, const group_index *ix) { \
    for (int64_t j = 0; j < nw; j++) rows_a(T, N, w + j * ws, k, xq, row, y + j, ldy, ix); }
#define ROWS_K(T, N) static void rows_k_##T##_##N(const uint8_t *w, int64_t nw, int64_t ws, int64_t k, const quantized_x *xq, \
                                                   int64_t row, float *y, int64_t ldy, const group_index *ix) { \
    (void)ix; for (int64_t j = 0; j < nw; j++) rows_k(T, N, w + j * ws, k, xq, row, y + j, ldy); }
#define FOUR(M, T) M(T, 1) M(T, 2) M(T, 3) M(T, 4)
FOUR(ROWS_A, Q8_0) FOUR(ROWS_A, MXFP4) FOUR(ROWS_A, Q4_0) FOUR(ROWS_A, Q4_1) FOUR(ROWS_A, Q5_0) FOUR(ROWS_A, Q5_1)
FOUR(ROWS_K, Q2_K) FOUR(ROWS_K, Q3_K) FOUR(ROWS_K, Q4_K) FOUR(ROWS_K, Q5_K) FOUR(ROWS_K, Q6_K)
#define TABLE(P, T) {P##_##T##_1, P##_##T##_2, P##_##T##_3, P##_##T##_4}

/* The kernel for type t and n rows (1-4) at once. */
static rows_fn rows_kernel(int t, int n) {
    static const rows_fn a[6][4] = {TABLE(rows_a, Q8_0), TABLE(rows_a, MXFP4), TABLE(rows_a, Q4_0),
                                    TABLE(rows_a, Q4_1), TABLE(rows_a, Q5_0), TABLE(rows_a, Q5_1)};
    static const rows_fn kq[5][4] = {TABLE(rows_k, Q2_K), TABLE(rows_k, Q3_K), TABLE(rows_k, Q4_K),
                                     TABLE(rows_k, Q5_K), TABLE(rows_k, Q6_K)};
    switch (t) {
    case Q8_0: return a[0][n - 1];
    case MXFP4: return a[1][n - 1];
    case Q4_0: return a[2][n - 1];
    case Q4_1: return a[3][n - 1];
    case Q5_0: return a[4][n - 1];
    case Q5_1: return a[5][n - 1];
    case Q2_K: return kq[0][n - 1];
    case Q3_K: return kq[1][n - 1];
    case Q4_K: return kq[2][n - 1];
    case Q5_K: return kq[3][n - 1];
    default: return kq[4][n - 1];
    }
}

/* Rows a..b of the activations times nw weight rows from w (ws bytes apart), into y[i * ldy + j]: four
 * activation rows at a time. */
static void rows_fast(int t, const uint8_t *w, int64_t nw, int64_t ws, int64_t k, const quantized_x *xq, int64_t a,
                      int64_t b, float *y, int64_t ldy, const group_index *ix) {
    for (int64_t i = a; i < b; i += 4)
        rows_kernel(t, b - i < 4 ? (int)(b - i) : 4)(w, nw, ws, k, xq, i, y + i * ldy, ldy, ix);
}

#elif ARCH == 1

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static float dot_f32(const float *x, const float *w, int64_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(w + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(w + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
    float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) sum += x[i] * w[i];
    return sum;
}

/* Per 32-block: signed weights u - off (all fit int8); maddubs takes |w| and q with w's sign,
 * whose pair sums stay under int16's limit (128 * 127 * 2). */
static float dot_a(int t, const row_a *w, const quantized_x *xq, int64_t row, int64_t k) {
    const int64_t nb = xq->nb;
    const int8_t *q = xq->q + row * xq->kq;
    const float *d = xq->d + row * nb;
    const __m256i off = _mm256_set1_epi8((char)offset_a(t)), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        const __m256i ws = _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)(w->u + 32 * b)), off);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(xv, ws));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(w->dw[b] * d[b]), acc);
    }
    float sum = hsum8(acc);
    if (has_min_a(t))
        for (int64_t b = 0; b < k / 32; b++) sum += w->dm[b] * xq->ds[row * nb + b];
    return sum;
}

static float dot_k(const block_k *w, const quantized_x *xq, int64_t row, int64_t k) {
    const int64_t nb = xq->nb;
    const int8_t *q = xq->q + row * xq->kq;
    const int16_t *bsum = xq->bsum + row * (k / 16);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / QK; b++, w++, q += QK, bsum += 16) {
        __m256i s0 = _mm256_setzero_si256(), s1 = s0;
        for (int c = 0; c < 8; c += 2) {
            const __m256i p0 = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(w->u + 32 * c)),
                                                    _mm256_loadu_si256((const __m256i *)(q + 32 * c)));
            const __m256i p1 = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(w->u + 32 * c + 32)),
                                                    _mm256_loadu_si256((const __m256i *)(q + 32 * c + 32)));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, _mm256_load_si256((const __m256i *)(w->scx + 16 * c))));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, _mm256_load_si256((const __m256i *)(w->scx + 16 * c + 16))));
        }
        const __m256i bs = _mm256_loadu_si256((const __m256i *)bsum);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(bs, _mm256_load_si256((const __m256i *)w->offsc)));
        const __m256i mins = _mm256_madd_epi16(bs, _mm256_load_si256((const __m256i *)w->mn));
        const float dx = xq->d[row * nb + b];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_set1_ps(w->dw * dx), acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(w->dm * dx), acc);
    }
    return hsum8(acc);
}

/* ---- AVX2 fast mode for K-quants: a super-block unpacked in registers, 32 elements at a time, and
 * dotted with up to four activation rows at once (the weight row read once per four). Each int32
 * lane sums the same integers, and each float operation is the same, as unpack_row_k then dot_k:
 * the same bits, without the round trip of the unpacked row through memory (measured: unpack_row_k
 * 48% and dot_k 22% of a full-size Qwen3.5 decode on a 2-core AVX2 EPYC). */

#define INLINE static inline __attribute__((always_inline))

/* Byte indices that broadcast, from a register holding 8 int16 scales in both halves, the scale of
 * sub-block 2c to the low 8 int16 lanes of chunk c (elements 32c..32c+31) and that of sub-block 2c + 1
 * to the high 8 (c taken mod 4: chunks 0-3 from scales 0-7, 4-7 from 8-15). */
static const uint8_t CHUNK_SCALE[4][32] = {
#define PAIR(i) 2 * (i), 2 * (i) + 1
#define EIGHT(i) PAIR(i), PAIR(i), PAIR(i), PAIR(i), PAIR(i), PAIR(i), PAIR(i), PAIR(i)
    {EIGHT(0), EIGHT(1)}, {EIGHT(2), EIGHT(3)}, {EIGHT(4), EIGHT(5)}, {EIGHT(6), EIGHT(7)}
#undef EIGHT
#undef PAIR
};

/* The bits of each byte of q that mask selects, after moving bit `from` to bit `to` (one shift and one
 * and: bits never cross into the other byte of a 16-bit lane for the positions used here). */
INLINE __m256i moved_bits(__m256i q, int from, int to, __m256i mask) {
    return _mm256_and_si256(from >= to ? _mm256_srli_epi16(q, from - to) : _mm256_slli_epi16(q, to - from), mask);
}

/* A super-block's per-16 scales, their offset term -off sc and mins (int16). */
typedef struct {
    __m256i sc, offsc, mn;
    float dw, dm;
} scales_k;

INLINE scales_k scales_for(int t, const uint8_t *b) {
    scales_k s;
    s.dm = 0.0f;
    s.mn = s.offsc = _mm256_setzero_si256();
    switch (t) {
    case Q4_K: case Q5_K: { /* each of the 8 scales and mins covers two 16s */
        const __m128i v = scale_min_bytes_k(b + 4);
        s.sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
        s.mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
        s.dw = f16(rd16(b));
        s.dm = f16(rd16(b + 2));
        break;
    }
    case Q6_K:
        s.sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        s.offsc = _mm256_mullo_epi16(s.sc, _mm256_set1_epi16(-32));
        s.dw = f16(rd16(b + 208));
        break;
    case Q3_K:
        s.sc = scales_q3_k(b + 96);
        s.offsc = _mm256_mullo_epi16(s.sc, _mm256_set1_epi16(-4));
        s.dw = f16(rd16(b + 108));
        break;
    default: { /* Q2_K: scale in the low nibble, min in the high */
        const __m128i v = _mm_loadu_si128((const __m128i *)b);
        s.sc = _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(15)));
        s.mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)));
        s.dw = f16(rd16(b + 80));
        s.dm = f16(rd16(b + 82));
    }
    }
    return s;
}

/* u of chunk 4h + j of super-block b (unpack_block_k's bytes 128h + 32j ..). */
INLINE __m256i chunk_k(int t, const uint8_t *b, int h, int j) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    switch (t) {
    case Q4_K: case Q5_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (t == Q4_K ? 16 : 48) + 64 * h + 32 * (j / 2)));
        const __m256i u = j % 2 ? bits(q, 4, m4) : _mm256_and_si256(q, m4);
        if (t == Q4_K) return u;
        return _mm256_or_si256(u, moved_bits(_mm256_loadu_si256((const __m256i *)(b + 16)), 4 * h + j, 4, _mm256_set1_epi8(16)));
    }
    case Q6_K: {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (j % 2)));
        const __m256i hq = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        return _mm256_or_si256(j < 2 ? _mm256_and_si256(l, m4) : bits(l, 4, m4), moved_bits(hq, 2 * j, 4, _mm256_set1_epi8(0x30)));
    }
    case Q3_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
        return _mm256_or_si256(bits(q, 2 * j, m2), moved_bits(_mm256_loadu_si256((const __m256i *)b), 4 * h + j, 2, _mm256_set1_epi8(4)));
    }
    default: /* Q2_K */
        return bits(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h)), 2 * j, m2);
    }
}

/* y[i * ldy] = x[row + i] . w for i < nr (dot_k's operations per row). */
INLINE void rows_k(int t, int nr, const uint8_t *w, int64_t k, const quantized_x *xq, int64_t row, float *y,
                   int64_t ldy) {
    const int bb = block_bytes(t);
    __m256 acc[4];
    const int8_t *qr[4];
    const int16_t *bsr[4];
    const float *dr[4];
    for (int i = 0; i < nr; i++) {
        acc[i] = _mm256_setzero_ps();
        qr[i] = xq->q + (row + i) * xq->kq;
        bsr[i] = xq->bsum + (row + i) * (k / 16);
        dr[i] = xq->d + (row + i) * xq->nb;
    }
    const uint8_t *ahead = w + PREFETCH_BYTES;
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = w + b * bb;
        ahead = prefetch_ahead(ahead, blk + bb);
        const scales_k s = scales_for(t, blk);
        const __m256i scale_half[2] = {_mm256_permute2x128_si256(s.sc, s.sc, 0x00), _mm256_permute2x128_si256(s.sc, s.sc, 0x11)};
        __m256i sum[4];
        for (int i = 0; i < nr; i++) sum[i] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j += 2) {
                const int c = 4 * h + j;
                const __m256i u0 = chunk_k(t, blk, h, j), u1 = chunk_k(t, blk, h, j + 1);
                const __m256i sc0 = _mm256_shuffle_epi8(scale_half[h], _mm256_loadu_si256((const __m256i *)CHUNK_SCALE[j]));
                const __m256i sc1 = _mm256_shuffle_epi8(scale_half[h], _mm256_loadu_si256((const __m256i *)CHUNK_SCALE[j + 1]));
                for (int i = 0; i < nr; i++) {
                    const int8_t *q = qr[i] + QK * b + 32 * c;
                    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)q)), sc0);
                    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(q + 32))), sc1);
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_add_epi32(p0, p1));
                }
            }
        for (int i = 0; i < nr; i++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(bsr[i] + 16 * b));
            if (has_offset_k(t)) sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(bs, s.offsc));
            const float dx = dr[i][b];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(s.dw * dx), acc[i]);
            if (has_min_k(t))
                acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, s.mn)), _mm256_set1_ps(s.dm * dx), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* One activation row times the nw (1-4) weight rows w[0..nw), into y[0..nw): each row's operations are
 * rows_k's with one activation row, in the same order (the same bits), with the rows side by side: the
 * work per row around its few super-blocks (a call, the setup, the final sum) is shared, and the rows'
 * independent chains overlap (decode's many short rows, e.g. Qwen3.5's experts' down of k = 512). */
INLINE void rows_kw(int t, int nw, const uint8_t *const *w, int64_t k, const quantized_x *xq, int64_t row, float *y) {
    const int bb = block_bytes(t);
    const int8_t *qr = xq->q + row * xq->kq;
    const int16_t *bsr = xq->bsum + row * (k / 16);
    const float *dr = xq->d + row * xq->nb;
    __m256 acc[4];
    for (int r = 0; r < nw; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t *ahead = w[0] + PREFETCH_BYTES; /* the rows as one stream (they lie one after another) */
    for (int64_t b = 0; b < k / QK; b++) {
        ahead = prefetch_ahead(ahead, w[0] + nw * (b + 1) * bb);
        const __m256i *xv = (const __m256i *)(qr + QK * b);
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(bsr + 16 * b));
        const float dx = dr[b];
        for (int r = 0; r < nw; r++) {
            const uint8_t *blk = w[r] + b * bb;
            const scales_k s = scales_for(t, blk);
            const __m256i scale_half[2] = {_mm256_permute2x128_si256(s.sc, s.sc, 0x00), _mm256_permute2x128_si256(s.sc, s.sc, 0x11)};
            __m256i sum = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j += 2) {
                    const int c = 4 * h + j;
                    const __m256i u0 = chunk_k(t, blk, h, j), u1 = chunk_k(t, blk, h, j + 1);
                    const __m256i sc0 = _mm256_shuffle_epi8(scale_half[h], _mm256_loadu_si256((const __m256i *)CHUNK_SCALE[j]));
                    const __m256i sc1 = _mm256_shuffle_epi8(scale_half[h], _mm256_loadu_si256((const __m256i *)CHUNK_SCALE[j + 1]));
                    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_loadu_si256(xv + c)), sc0);
                    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_loadu_si256(xv + c + 1)), sc1);
                    sum = _mm256_add_epi32(sum, _mm256_add_epi32(p0, p1));
                }
            if (has_offset_k(t)) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(bs, s.offsc));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(s.dw * dx), acc[r]);
            if (has_min_k(t))
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, s.mn)), _mm256_set1_ps(s.dm * dx), acc[r]);
        }
    }
    for (int r = 0; r < nw; r++) y[r] = hsum8(acc[r]);
}

/* rows_kw of type T for weight rows r0..r1 (see weight_rows) of group g, four at a time, then the 1-3 left. */
typedef void (*rows_w_fn)(const weight_rows *wr, int64_t g, int64_t r0, int64_t r1, int64_t k, const quantized_x *xq,
                          int64_t row, float *y);
#define ROWS_W(T) static void rows_kw_##T(const weight_rows *wr, int64_t g, int64_t r0, int64_t r1, int64_t k, \
                                          const quantized_x *xq, int64_t row, float *y) { \
    const uint8_t *w[4]; \
    for (int64_t r = r0; r < r1; r += 4) { \
        const int nw = r1 - r < 4 ? (int)(r1 - r) : 4; \
        for (int j = 0; j < nw; j++) w[j] = weight_row(wr, g, r + j); \
        if (nw == 4) rows_kw(T, 4, w, k, xq, row, y + r); \
        else if (nw == 3) rows_kw(T, 3, w, k, xq, row, y + r); \
        else if (nw == 2) rows_kw(T, 2, w, k, xq, row, y + r); \
        else rows_kw(T, 1, w, k, xq, row, y + r); } }

ROWS_W(Q2_K) ROWS_W(Q3_K) ROWS_W(Q4_K) ROWS_W(Q5_K) ROWS_W(Q6_K)

static rows_w_fn rows_w_kernel(int t) {
    switch (t) {
    case Q2_K: return rows_kw_Q2_K;
    case Q3_K: return rows_kw_Q3_K;
    case Q4_K: return rows_kw_Q4_K;
    case Q5_K: return rows_kw_Q5_K;
    default: return rows_kw_Q6_K;
    }
}

/* The same for Q8_0, MXFP4 and Q4_0's 32-blocks: each block's signed weights u - off (as unpack_row_a
 * then dot_a take them) made in a register and dotted with up to four rows (dot_a's operations per row). */
static int fused_a(int t) { return t == Q8_0 || t == MXFP4 || t == Q4_0; }

/* The 32 4-bit codes of 16 bytes: the low nibbles, then the high ones. */
INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i m4 = _mm_set1_epi8(15), q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

/* The signed values (twice E2M1's) of the MXFP4 block at p. */
INLINE __m256i mxfp4_values(const uint8_t *p) {
    const __m256i values = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm256_shuffle_epi8(values, nibbles32(p + 1));
}

INLINE __m256i signed_block_a(int t, const uint8_t *p, float *dw) {
    if (t == Q8_0) {
        *dw = f16(rd16(p));
        return _mm256_loadu_si256((const __m256i *)(p + 2));
    }
    if (t == MXFP4) {
        *dw = e8m0_half(p[0]);
        return mxfp4_values(p);
    }
    *dw = f16(rd16(p));
    return _mm256_sub_epi8(nibbles32(p + 2), _mm256_set1_epi8(8));
}

INLINE void rows_a(int t, int nr, const uint8_t *w, int64_t k, const quantized_x *xq, int64_t row, float *y,
                   int64_t ldy) {
    const int bb = block_bytes(t);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    const int8_t *qr[4];
    const float *dr[4];
    for (int i = 0; i < nr; i++) {
        acc[i] = _mm256_setzero_ps();
        qr[i] = xq->q + (row + i) * xq->kq;
        dr[i] = xq->d + (row + i) * xq->nb;
    }
    const uint8_t *ahead = w + PREFETCH_BYTES;
    for (int64_t b = 0; b < k / 32; b++) {
        ahead = prefetch_ahead(ahead, w + (b + 1) * bb);
        float dw;
        const __m256i ws = signed_block_a(t, w + b * bb, &dw), wabs = _mm256_abs_epi8(ws);
        for (int i = 0; i < nr; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(qr[i] + 32 * b));
            const __m256i p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, ws));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(dw * dr[i][b]), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* One function per type (a constant inside): activation rows a..b times weight row w, into y[i * ldy]. */
typedef void (*rows_fn_avx2)(const uint8_t *w, int64_t k, const quantized_x *xq, int64_t a, int64_t b, float *y,
                          int64_t ldy);
/* KIND (rows_k or rows_a) of type T over activation rows a..b, four at a time, then the 1-3 left. */
#define ROWS(KIND, T) static void KIND##_##T(const uint8_t *w, int64_t k, const quantized_x *xq, int64_t a, int64_t b, \
                                         float *y, int64_t ldy) { \
    int64_t i = a; \
    for (; i + 4 <= b; i += 4) KIND(T, 4, w, k, xq, i, y + i * ldy, ldy); \
    if (b - i == 3) KIND(T, 3, w, k, xq, i, y + i * ldy, ldy); \
    else if (b - i == 2) KIND(T, 2, w, k, xq, i, y + i * ldy, ldy); \
    else if (b - i == 1) KIND(T, 1, w, k, xq, i, y + i * ldy, ldy); }
ROWS(rows_k, Q2_K) ROWS(rows_k, Q3_K) ROWS(rows_k, Q4_K) ROWS(rows_k, Q5_K) ROWS(rows_k, Q6_K)
ROWS(rows_a, Q8_0) ROWS(rows_a, Q4_0)

/* The fused kernel for type t (a K-quant, Q8_0 or Q4_0; MXFP4 has mxfp4_rows), activation rows a..b times one
 * weight row. */
static rows_fn_avx2 rows_kernel(int t) {
    switch (t) {
    case Q8_0: return rows_a_Q8_0;
    case Q4_0: return rows_a_Q4_0;
    case Q2_K: return rows_k_Q2_K;
    case Q3_K: return rows_k_Q3_K;
    case Q4_K: return rows_k_Q4_K;
    case Q5_K: return rows_k_Q5_K;
    default: return rows_k_Q6_K;
    }
}

#else

static float dot_f32(const float *x, const float *w, int64_t k) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += x[i + l] * w[i + l];
    float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < k; i++) sum += x[i] * w[i];
    return sum;
}

static float dot_a(int t, const row_a *w, const quantized_x *xq, int64_t row, int64_t k) {
    const int64_t nb = xq->nb;
    const int8_t *q = xq->q + row * xq->kq;
    const int off = offset_a(t);
    float sum = 0.0f;
    for (int64_t b = 0; b < k / 32; b++) {
        int s = 0;
        for (int i = 0; i < 32; i++) s += (w->u[32 * b + i] - off) * q[32 * b + i];
        sum += w->dw[b] * xq->d[row * nb + b] * (float)s;
    }
    if (has_min_a(t))
        for (int64_t b = 0; b < k / 32; b++) sum += w->dm[b] * xq->ds[row * nb + b];
    return sum;
}

static float dot_k(const block_k *w, const quantized_x *xq, int64_t row, int64_t k) {
    const int64_t nb = xq->nb;
    const int8_t *q = xq->q + row * xq->kq;
    const int16_t *bsum = xq->bsum + row * (k / 16);
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK; b++, w++, q += QK, bsum += 16) {
        int s = 0, m = 0;
        for (int j = 0; j < 16; j++) {
            int p = 0;
            for (int i = 0; i < 16; i++) p += w->u[16 * j + i] * q[16 * j + i];
            s += w->scx[8 * j] * p + w->offsc[j] * bsum[j];
            m += w->mn[j] * bsum[j];
        }
        const float dx = xq->d[row * nb + b];
        sum += w->dw * dx * (float)s - w->dm * dx * (float)m;
    }
    return sum;
}

#endif

/* ---- entry points ------------------------------------------------------------------------- */

/* Dequantise n rows of k elements (raw row-major, row_bytes apart) to y [n, k]. */
void raymoe_blocks_dequantize(int t, const uint8_t *raw, int64_t n, int64_t k, float *y) {
    const int64_t row_bytes = k / block_elems(t) * block_bytes(t);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) deq_row(t, raw + r * row_bytes, k, y + r * k);
}

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* The activation quantisation buffers for m rows (NULL members when out of memory). */
static void *zalloc64(size_t bytes) {
    void *p = alloc64(bytes);
    if (p) memset(p, 0, (bytes + 63) / 64 * 64);
    return p;
}

/* The activation quantisation buffers for m rows of type t's blocks of qb (NULL members when out
 * of memory); q and the lane arrays zeroed, for their padding. */
static quantized_x alloc_x(int t, int64_t m, int64_t k, int qb, int natural) {
    quantized_x xq = {0};
    const int g = group_blocks(t);
    xq.nb = (k / qb + 1) / 2 * 2;
    xq.kq = (k + 127) / 128 * 128;
    xq.q = zalloc64((size_t)(m * xq.kq));
    xq.d = alloc64((size_t)(m * xq.nb) * sizeof(float));
    xq.ds = alloc64((size_t)(m * xq.nb) * sizeof(float));
    xq.corr = alloc64((size_t)(m * xq.nb) * sizeof(int32_t));
    xq.bsum = alloc64((size_t)(m * (k / 16)) * sizeof(int16_t) + 64);
    if (qb == 32 && !natural) {
        xq.lanes = (k / 32 + g - 1) / g * 16;
        xq.lane_d = zalloc64((size_t)(m * xq.lanes) * sizeof(float));
        xq.lane_ds = zalloc64((size_t)(m * xq.lanes) * sizeof(float));
        xq.lane_corr = zalloc64((size_t)(m * xq.lanes) * sizeof(int32_t));
    }
    return xq;
}

static int x_allocated(const quantized_x *xq) {
    return xq->q && xq->d && xq->ds && xq->corr && xq->bsum && (!xq->lanes || (xq->lane_d && xq->lane_ds && xq->lane_corr));
}

static void free_x(quantized_x *xq) {
    free(xq->q);
    free(xq->d);
    free(xq->ds);
    free(xq->corr);
    free(xq->bsum);
    free(xq->lane_d);
    free(xq->lane_ds);
    free(xq->lane_corr);
}

#if ARCH == 1
/* MXFP4 at one activation row, eight weight rows at once. One row at a time (rows_a) is bound by its
 * work per 17-byte block, not by memory (measured on a 2-core AVX2 EPYC: 7.8 GB/s at one thread where
 * Q8_0 streams 11.9). Here a block's integer sums for eight rows are added across their lanes into one
 * vector (exact: integers), so that the eight rows' scales, the conversion to float and the
 * multiply-add with the row's accumulator lane are one vector operation each, not eight. Every row
 * of every matrix goes through this function, alone or with others (rows past the last are copies
 * of it, their results dropped): a row's bits do not depend on its neighbours. The weights are looked up
 * as value + 12 (unsigned, as maddubs wants them: no abs and sign per row) and the block's -12 sum(q)
 * is added once for the eight rows; a row's nibbles come from one broadcast load and one shift. */
INLINE __m256i lane_sums8(const __m256i *p) {
    /* per 128-bit lane: rows 0-3's sums, then rows 4-7's (unpacks and adds; hadd is several uops) */
    __m256i s[4];
    for (int j = 0; j < 4; j++) {
        const __m256i a = p[2 * j], b = p[2 * j + 1];
        s[j] = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    }
    const __m256i lo = _mm256_add_epi32(_mm256_unpacklo_epi64(s[0], s[1]), _mm256_unpackhi_epi64(s[0], s[1]));
    const __m256i hi = _mm256_add_epi32(_mm256_unpacklo_epi64(s[2], s[3]), _mm256_unpackhi_epi64(s[2], s[3]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* The 32 4-bit codes of the 16 bytes at qs, low nibbles then high: one broadcast load, one shift. */
INLINE __m256i nibbles32_wide(const uint8_t *qs) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

static void mxfp4_rows8(const uint8_t *const *w, int count, const uint8_t *next, int64_t k, const int8_t *q,
                        const float *dq, const int32_t *corr, float *y) {
    /* the values + 12 (unsigned, as maddubs takes them); the block's -12 * sum(q) added back once for all rows */
    const __m256i values = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0, o = 0; b < k / 32; b++, o += 17) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const uint8_t *ahead = next + 8 * o;
        __builtin_prefetch(ahead, 0, 3);
        __builtin_prefetch(ahead + 64, 0, 3);
        __builtin_prefetch(ahead + 135, 0, 3);
        __m256i p[8];
        for (int j = 0; j < 8; j++)
            p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi8(values, nibbles32_wide(w[j] + o + 1)), xv), ones);
        /* e8m0_half of the eight scales */
        const __m256i e = _mm256_setr_epi32(w[0][o], w[1][o], w[2][o], w[3][o], w[4][o], w[5][o], w[6][o], w[7][o]);
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256 dw = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        const __m256i sums = _mm256_add_epi32(lane_sums8(p), _mm256_set1_epi32(corr[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_set1_ps(dq[b])), acc);
    }
    if (count == 8) {
        _mm256_storeu_ps(y, acc);
    } else {
        float all[8];
        _mm256_storeu_ps(all, acc);
        memcpy(y, all, (size_t)count * sizeof(float));
    }
}

/* Weight rows r0..r1 (see weight_rows) of group g times activation rows a..b, eight rows at a time. */
static void mxfp4_rows(const weight_rows *wr, int64_t g, int64_t r0, int64_t r1, int64_t k, const quantized_x *xq,
                       int64_t a, int64_t b, float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r += 8) {
        const int count = r1 - r < 8 ? (int)(r1 - r) : 8;
        const uint8_t *w[8];
        for (int j = 0; j < 8; j++) w[j] = weight_row(wr, g, r + (j < count ? j : count - 1));
        for (int64_t i = a; i < b; i++)
            mxfp4_rows8(w, count, w[7] + wr->row_bytes, k, xq->q + i * xq->kq, xq->d + i * xq->nb, xq->corr + i * xq->nb,
                        y + i * ldy + r);
    }
}
#endif

/* A parallel loop's items shared out as schedule(static) does, one contiguous run per thread, each thread walking
 * its own run forward; a thread done with its run takes items from the end of another's. So a thread the OS stops
 * (another process woke on its core) no longer holds up the loop's end while the others wait at the barrier
 * (measured on 2 cores: decode steps 1-1.5% faster, in process and in a Ray actor). Runs stay contiguous, so the
 * weight streams do too (interleaved dynamic claims broke them: slower). Each item is still computed whole by one
 * thread, so the bits do not change. */
typedef struct {
    _Atomic uint64_t span; /* next item (low 32 bits) and end of the run (high 32 bits) */
    char pad[56];          /* one cache line each */
} item_run;

/* Room for one run per thread of a loop of n items (NULL when out of memory, or past 32 bits of items). */
static item_run *item_runs_new(int64_t n) {
    return n <= UINT32_MAX ? alloc64((size_t)omp_get_max_threads() * sizeof(item_run)) : NULL;
}

/* Inside the parallel region, every thread: sets its run of the n items, then waits for the others' to be set. */
static void item_runs_start(item_run *runs, int64_t n) {
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num(), q = n / nt, r = n % nt;
    const int64_t lo = me * q + (me < r ? me : r), hi = lo + q + (me < r);
    atomic_store_explicit(&runs[me].span, (uint64_t)lo | (uint64_t)hi << 32, memory_order_relaxed);
#pragma omp barrier
}

/* The next item of run `run`: its front when it is this thread's own run, else its back. -1 when none is left. */
static inline int64_t item_claim(item_run *run, int own) {
    uint64_t s = atomic_load_explicit(&run->span, memory_order_relaxed);
    for (;;) {
        const uint64_t next = s & 0xffffffffu, end = s >> 32;
        if (next >= end) return -1;
        const uint64_t claimed = own ? s + 1 : s - ((uint64_t)1 << 32);
        if (atomic_compare_exchange_weak_explicit(&run->span, &s, claimed, memory_order_relaxed, memory_order_relaxed))
            return own ? (int64_t)next : (int64_t)end - 1;
    }
}

/* The next item for this thread: from its own run, then from the others' (-1 when the loop is done). */
static inline int64_t item_next(item_run *runs) {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    for (int i = 0; i < nt; i++) {
        const int64_t item = item_claim(&runs[(me + i) % nt], i == 0);
        if (item >= 0) return item;
    }
    return -1;
}

/* For each group (g, a, b) in groups[0 .. 3 count): rows a..b of y = rows a..b of x times the
 * transpose of weight g ([n rows of k], row after row: see weight_rows). x is [m, k] with row
 * stride ldx, y has row stride ldy. quantize: the fast (int8 activations) mode, ignored for
 * float weights. One parallel loop over every (group, NR weight rows). Returns 0, or -1 when
 * out of memory. */
int raymoe_blocks_grouped(int t, int quantize, const float *x, int64_t m, int64_t ldx, const uint8_t *raw,
                          int64_t w_stride, const uint8_t *raw2, int64_t w_stride2, int64_t n1,
                          const int64_t *groups, int64_t count, int64_t n, int64_t k, float *y, int64_t ldy) {
    const int mode = is_float(t) || !quantize ? 0 : is_k_quant(t) ? 2 : 1;
    const int64_t row_bytes = k / block_elems(t) * block_bytes(t), blocks = (n + NR - 1) / NR;
    const weight_rows wr = {raw, raw2, w_stride, w_stride2, raw2 ? n1 : n, row_bytes};
    quantized_x xq = {0};
    if (mode) {
        xq = alloc_x(t, m, k, mode == 2 ? QK : 32, 0);
        if (!x_allocated(&xq)) {
            free_x(&xq);
            return -1;
        }
    }
    item_run *runs = item_runs_new(count * blocks);
    if (!runs) {
        free_x(&xq);
        return -1;
    }
    int failed = 0;
#if ARCH == 2
    const group_index ix = group_index_for(mode == 1 ? t : Q8_0);
    const int buffered = mode == 0; /* the fast modes unpack in registers */
#elif ARCH == 1
    const int fused = mode == 2 || (mode == 1 && fused_a(t)), buffered = !fused; /* fused: unpacked in registers */
    const rows_fn_avx2 rows_t = fused && t != MXFP4 ? rows_kernel(t) : NULL;
    /* K-quants at one activation row with short weight rows: four rows side by side (longer rows lose there:
     * their four streams lie far apart) */
    const rows_w_fn rows_w = mode == 2 && k <= 4 * QK ? rows_w_kernel(t) : NULL;
#else
    const int buffered = 1;
#endif
#pragma omp parallel
    {
        /* this thread's unpacked weight row: floats, 32-block bytes and scales, or super-blocks */
        void *buffer = !buffered ? NULL
                     : mode == 0 ? alloc64((size_t)k * sizeof(float))
                     : mode == 1 ? alloc64((size_t)(k + 64) + 2 * (size_t)xq.nb * sizeof(float))
                                 : alloc64((size_t)(k / QK) * sizeof(block_k));
        row_a wa = {0};
        if (buffer && mode == 1) {
            wa.u = buffer;
            wa.dw = (float *)(wa.u + k + 64);
            wa.dm = wa.dw + xq.nb;
            memset(wa.u, 0, (size_t)(k + 64) + 2 * (size_t)xq.nb * sizeof(float));
        }
        if (mode) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++)
                quantize_row(t, x + i * ldx, k, mode == 2 ? QK : 32, mode == 1 ? offset_a(t) : 0, &xq, i, 0);
        }
        item_runs_start(runs, count * blocks);
        for (int64_t item; (item = item_next(runs)) >= 0;) {
            if (buffered && !buffer) {
                failed = 1;
                continue;
            }
            const int64_t *group = groups + 3 * (item / blocks);
            const int64_t r0 = item % blocks * NR, r1 = r0 + NR < n ? r0 + NR : n;
#if ARCH == 2
            if (mode) { /* the item's rows in runs that lie in one weight (raw, then raw2) */
                for (int64_t r = r0, end; r < r1; r = end) {
                    end = r < wr.n1 && r1 > wr.n1 ? wr.n1 : r1;
                    rows_fast(t, weight_row(&wr, group[0], r), end - r, row_bytes, k, &xq, group[1], group[2], y + r,
                              ldy, &ix);
                }
                continue;
            }
#elif ARCH == 1
            if (fused && t == MXFP4) {
                mxfp4_rows(&wr, group[0], r0, r1, k, &xq, group[1], group[2], y, ldy);
                continue;
            }
            if (rows_w && group[2] - group[1] == 1) {
                rows_w(&wr, group[0], r0, r1, k, &xq, group[1], y + group[1] * ldy);
                continue;
            }
            if (fused) {
                for (int64_t r = r0; r < r1; r++)
                    rows_t(weight_row(&wr, group[0], r), k, &xq, group[1], group[2], y + r, ldy);
                continue;
            }
#endif
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *w = weight_row(&wr, group[0], r);
                if (mode == 0) {
                    const float *wf = (const float *)w;
                    if (t != F32) {
                        deq_row(t, w, k, buffer);
                        wf = buffer;
                    } else {
                        prefetch_ahead(w + PREFETCH_BYTES, w + row_bytes);
                    }
                    for (int64_t i = group[1]; i < group[2]; i++) y[i * ldy + r] = dot_f32(x + i * ldx, wf, k);
                    continue;
                }
#if ARCH != 2
                if (mode == 1) {
                    unpack_row_a(t, w, k, &wa);
                    for (int64_t i = group[1]; i < group[2]; i++) y[i * ldy + r] = dot_a(t, &wa, &xq, i, k);
                } else {
                    unpack_row_k(t, w, k, buffer);
                    for (int64_t i = group[1]; i < group[2]; i++) y[i * ldy + r] = dot_k(buffer, &xq, i, k);
                }
#endif
            }
        }
        free(buffer);
    }
    free(runs);
    free_x(&xq);
    return failed ? -1 : 0;
}

typedef void (*cblas_sgemm_fn)(int order, int transa, int transb, int64_t m, int64_t n, int64_t k, float alpha,
                               const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                               int64_t ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* y [m, n] = x [m, k] times the transpose of raw ([n rows of k]), for many rows of x: TILE
 * weight rows at a time are dequantised into this thread's buffer (in cache) and multiplied by
 * sgemm (a 64-bit-integer cblas_sgemm set to one thread, such as numpy's OpenBLAS), or by
 * dot products when sgemm is NULL. Tiles are fixed by n, so a result does not depend on the
 * thread count. Returns 0, or -1 when out of memory. */
int raymoe_blocks_many_rows(void *sgemm, int t, const float *x, int64_t m, int64_t ldx, const uint8_t *raw,
                            int64_t n, int64_t k, float *y, int64_t ldy) {
    const cblas_sgemm_fn gemm = (cblas_sgemm_fn)sgemm;
    const int64_t row_bytes = k / block_elems(t) * block_bytes(t), tiles = (n + TILE - 1) / TILE;
    int failed = 0;
#pragma omp parallel
    {
        float *buffer = alloc64((size_t)(TILE * k) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (!buffer) {
                failed = 1;
                continue;
            }
            const int64_t r0 = tile * TILE, nr = n - r0 < TILE ? n - r0 : TILE;
            for (int64_t r = 0; r < nr; r++) deq_row(t, raw + (r0 + r) * row_bytes, k, buffer + r * k);
            if (gemm)
                gemm(ROW_MAJOR, NO_TRANS, TRANS, m, nr, k, 1.0f, x, ldx, buffer, k, 0.0f, y + r0, ldy);
            else
                for (int64_t i = 0; i < m; i++)
                    for (int64_t r = 0; r < nr; r++) y[i * ldy + r0 + r] = dot_f32(x + i * ldx, buffer + r * k, k);
        }
        free(buffer);
    }
    return failed ? -1 : 0;
}

/* ---- fast mode, many rows (prefill): integer products over a tile of unpacked weight rows ------
 *
 * Each thread unpacks MANY_TILE weight rows into cache (row_a: bytes u and per-block scales;
 * block_k: super-blocks), once per call, and multiplies them with every activation row of the
 * group, quantised as the few-row path does but in the natural order. On AVX-512 a register
 * tile of activation rows x weight rows shares each load; every output keeps its own
 * accumulators in a fixed order, so it depends neither on the tiling nor on the thread count. */

#define MANY_TILE 16

/* A tile row of a 32-block type without mins, transposed for tile_at (AVX-512): blocks go 16 to a
 * chunk of eight 64-byte registers, block l's bytes 4 r .. 4 r + 3 in register r, lane l. Then lane l
 * of the registers' dpbusd products sums block l alone, with no horizontal sums. */
typedef struct tile_row_t {
    int8_t *s;      /* [chunks * 512]: the signed weights u - off (zero past the row's blocks) */
    int32_t *corr;  /* [chunks * 16]: -128 times the sum of each block's signed weights (zero past them) */
} tile_row_t;

static int transposed_on = 1; /* set by raymoe_blocks_set_transposed */

/* Whether AVX-512 many-row products (without AMX) take the transposed tiles (tile_kt, tile_at: on,
 * the default) or the register tiles (tile_k, tile_a): the same bits, and tests compare them.
 * Returns the setting before. */
int raymoe_blocks_set_transposed(int on) {
    const int was = transposed_on;
    transposed_on = on;
    return was;
}

/* A thread's tile of 32-block weight rows transposed for tile_at, and the activations likewise. */
typedef struct {
    const tile_row_t *rows;         /* [MANY_TILE] */
    const float *wv;                /* [MANY_TILE / 4][blocks][16] */
    int64_t blocks;
    const uint8_t *qt;              /* [m][ldq] */
    int64_t ldq;
} transposed_a;

/* A tile row of a 32-block type: row_a, plus on AVX-512 the signed weights u - off and, per int32
 * lane of a 64-byte register (8 lanes per block), -128 times the sum of the block's signed weights
 * (first lane only): the VNNI kernel's activations come as q + 128. */
typedef struct {
    row_a a;
    int8_t *s;        /* [kq] */
    int32_t *wcorr;   /* [lanes] */
} tile_row_a;

#if ARCH == 2

/* Sums of the lanes of pairs of int32 vectors: lanes 0-7 = pairs of a's lanes, 8-15 = pairs of b's.
 * Three rounds over eight vectors leave each one's two halves (lanes 0-7, 8-15) summed in two
 * adjacent lanes; four rounds over sixteen leave each one's sum in one lane. Integers: exact,
 * whatever the order. */
static inline __m512i sum_pairs(__m512i a, __m512i b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
}

/* Two floats at a and two at b as one vector: a0 a1 b0 b1. */
static inline __m128 two_pairs(const float *a, const float *b) {
    return _mm_castsi128_ps(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}

/* y[i * ldy + j] = x[row + i] . w[j], i < RM, j < RN, for 32-block weights. Per block the integer
 * sum S = q . (u - off) is exact (dpbusd sums (q + 128) s per lane from -128 sum s; the lanes are
 * summed in integers), then acc = fma(S, dx dw, acc) and, with mins, acc = fma(dm, ds, acc), block
 * after block: the AMX kernel does exactly this, so both give the same bits. */
INLINE void tile_a(int RM, int RN, int mins, const tile_row_a *w, int64_t k, const quantized_x *xq, int64_t row,
                   float *y, int64_t ldy) {
    const __m512i twice = _mm512_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
    const float zero[2] = {0.0f, 0.0f};
    /* accumulators: lane 2 (4 (i % 2) + j) of acc[i / 2] (odd lanes unused) */
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t blocks = k / 32;
    for (int64_t c = 0; c < (blocks + 1) / 2; c++) {
        __m512i v[16];
        for (int p = 0; p < 16; p++) v[p] = _mm512_setzero_si512();
        for (int i = 0; i < RM; i++) {
            const __m512i q = _mm512_load_si512(xq->q + (row + i) * xq->kq + 64 * c);
            for (int j = 0; j < RN; j++)
                v[4 * i + j] = _mm512_dpbusd_epi32(_mm512_load_si512(w[j].wcorr + 16 * c), q, _mm512_load_si512(w[j].s + 64 * c));
        }
        for (int p = 0; p < 8; p++) v[p] = sum_pairs(v[2 * p], v[2 * p + 1]);
        for (int p = 0; p < 4; p++) v[p] = sum_pairs(v[2 * p], v[2 * p + 1]);
        __m512 s[2];
        for (int h = 0; h < 2; h++) s[h] = _mm512_cvtepi32_ps(sum_pairs(v[2 * h], v[2 * h + 1]));
        /* per lane 2 (4 i + j) + block: dx of row i and dw of row j (and ds, dm) */
        const float *pw[4], *pm[4];
        for (int j = 0; j < 4; j++) {
            pw[j] = j < RN ? w[j].a.dw + 2 * c : zero;
            pm[j] = j < RN ? w[j].a.dm + 2 * c : zero;
        }
        const __m512 dw = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set_m128(two_pairs(pw[2], pw[3]), two_pairs(pw[0], pw[1]))),
                                             _mm256_set_m128(two_pairs(pw[2], pw[3]), two_pairs(pw[0], pw[1])), 1);
        const __m512 dm = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set_m128(two_pairs(pm[2], pm[3]), two_pairs(pm[0], pm[1]))),
                                             _mm256_set_m128(two_pairs(pm[2], pm[3]), two_pairs(pm[0], pm[1])), 1);
        const int last = 2 * c + 1 >= blocks; /* an odd number of blocks: no second block */
        for (int h = 0; h < (RM + 1) / 2; h++) {
            const float *r0 = xq->d + (row + 2 * h) * xq->nb + 2 * c;
            const float *r1 = 2 * h + 1 < RM ? xq->d + (row + 2 * h + 1) * xq->nb + 2 * c : zero;
            const __m512 dx = _mm512_permutexvar_ps(twice, _mm512_castps128_ps512(two_pairs(r0, r1)));
            const __m512 scale = _mm512_mul_ps(dx, dw);
            __m512 ds = _mm512_setzero_ps();
            if (mins) {
                const float *s0 = xq->ds + (row + 2 * h) * xq->nb + 2 * c;
                const float *s1 = 2 * h + 1 < RM ? xq->ds + (row + 2 * h + 1) * xq->nb + 2 * c : zero;
                ds = _mm512_permutexvar_ps(twice, _mm512_castps128_ps512(two_pairs(s0, s1)));
            }
            acc[h] = _mm512_fmadd_ps(s[h], scale, acc[h]);
            if (mins) acc[h] = _mm512_fmadd_ps(dm, ds, acc[h]);
            if (!last) {
                acc[h] = _mm512_fmadd_ps(_mm512_movehdup_ps(s[h]), _mm512_movehdup_ps(scale), acc[h]);
                if (mins) acc[h] = _mm512_fmadd_ps(_mm512_movehdup_ps(dm), _mm512_movehdup_ps(ds), acc[h]);
            }
        }
    }
    float out[32] __attribute__((aligned(64)));
    _mm512_store_ps(out, acc[0]);
    _mm512_store_ps(out + 16, acc[1]);
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) y[i * ldy + j] = out[16 * (i / 2) + 2 * (4 * (i % 2) + j)];
}

/* The same for K-quants: per super-block, maddubs pairs u * q into int16 and dpwssd scales them
 * per 16 into int32, plus the offset's term -off sc bsum; the lanes summed in integers give S =
 * sum q sc (u - off) exactly, and the mins' M = sum bsum mn. Then acc = fma(S, dw dx, acc) and
 * accm = fma(M, dm dx, accm), super-block after super-block, and y = acc - accm: as the AMX
 * kernel. kind: 1 = an offset (Q3_K, Q6_K), 2 = mins. */
INLINE void tile_k(int RM, int RN, int kind, block_k *const *w, int64_t k, const quantized_x *xq, int64_t row,
                   float *y, int64_t ldy) {
    const __m512i lane_i = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3);
    const __m512i lane_j = _mm512_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
    /* lane 2 i + j: acc of (i, j); lane 8 + 2 i + j: accm */
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / QK; b++) {
        __m512i s[4][2];
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < RN; j++) s[i][j] = _mm512_setzero_si512();
        for (int z = 0; z < 4; z++) {
            __m512i q[4];
            for (int i = 0; i < RM; i++) q[i] = _mm512_load_si512(xq->q + (row + i) * xq->kq + QK * b + 64 * z);
            for (int j = 0; j < RN; j++) {
                const __m512i u = _mm512_load_si512(w[j][b].u + 64 * z);
                const __m512i sc = _mm512_load_si512(w[j][b].scx + 32 * z);
                for (int i = 0; i < RM; i++) s[i][j] = _mm512_dpwssd_epi32(s[i][j], _mm512_maddubs_epi16(u, q[i]), sc);
            }
        }
        __m512i v[16];
        for (int p = 0; p < 16; p++) v[p] = _mm512_setzero_si512();
        float dx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int i = 0; i < RM; i++) {
            const __m256i bsum = _mm256_loadu_si256((const __m256i *)(xq->bsum + (row + i) * (k / 16) + 16 * b));
            dx[i] = xq->d[(row + i) * xq->nb + b];
            for (int j = 0; j < RN; j++) {
                const block_k *c = &w[j][b];
                v[2 * i + j] = s[i][j];
                if (kind == 1)
                    v[2 * i + j] = _mm512_add_epi32(s[i][j], _mm512_zextsi256_si512(_mm256_madd_epi16(bsum, _mm256_load_si256((const __m256i *)c->offsc))));
                if (kind == 2)
                    v[8 + 2 * i + j] = _mm512_zextsi256_si512(_mm256_madd_epi16(bsum, _mm256_load_si256((const __m256i *)c->mn)));
            }
        }
        for (int p = 0; p < 8; p++) v[p] = sum_pairs(v[2 * p], v[2 * p + 1]);
        for (int p = 0; p < 4; p++) v[p] = sum_pairs(v[2 * p], v[2 * p + 1]);
        for (int p = 0; p < 2; p++) v[p] = sum_pairs(v[2 * p], v[2 * p + 1]);
        const __m512 sum = _mm512_cvtepi32_ps(sum_pairs(v[0], v[1]));
        /* lane 2 i + j: dw_j dx_i; lane 8 + 2 i + j: dm_j dx_i */
        const float w0 = w[0][b].dw, w1 = RN > 1 ? w[1][b].dw : 0.0f, m0 = w[0][b].dm, m1 = RN > 1 ? w[1][b].dm : 0.0f;
        const __m512 wv = _mm512_permutexvar_ps(lane_j, _mm512_castps128_ps512(_mm_setr_ps(w0, w1, m0, m1)));
        const __m512 xv = _mm512_permutexvar_ps(lane_i, _mm512_castps128_ps512(_mm_loadu_ps(dx)));
        acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(wv, xv), acc);
    }
    float out[16] __attribute__((aligned(64)));
    _mm512_store_ps(out, acc);
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) y[i * ldy + j] = kind == 2 ? out[2 * i + j] - out[8 + 2 * i + j] : out[2 * i + j];
}

/* A K-quant super-block's 256 bytes (of u, or of activations) transposed as a 16 x 4 matrix of 4-byte
 * groups: group z of 16-element part l goes to register z, lane l. Then lane l of every register holds
 * part l, which has one scale, so dpbusd sums a lane over the four registers before one multiply
 * by the scale. */
static inline void transpose_k(uint8_t *p) {
    __m512i r[4], t[4];
    for (int h = 0; h < 4; h++) r[h] = _mm512_loadu_si512(p + 64 * h);
    for (int z = 0; z < 4; z++) {
        /* lanes 4h..4h+3 from r[h]'s z, 4 + z, 8 + z, 12 + z */
        const __m512i lo = _mm512_setr_epi32(z, 4 + z, 8 + z, 12 + z, 16 + z, 20 + z, 24 + z, 28 + z,
                                             0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i hi = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                             z, 4 + z, 8 + z, 12 + z, 16 + z, 20 + z, 24 + z, 28 + z);
        t[z] = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(r[0], lo, r[1]),
                                       _mm512_permutex2var_epi32(r[2], hi, r[3]));
    }
    for (int z = 0; z < 4; z++) _mm512_storeu_si512(p + 64 * z, t[z]);
}

/* y[i * ldy + j] = x[row + i] . w[j], i < RM, j < RN, for K-quant weights and activations whose
 * super-blocks are transposed (transpose_k). Per super-block and pair (i, j) the integer sum S =
 * sum q sc (u - off) is exact: lane l of dpbusd's four products sums part l's u q, times part l's
 * scale; the offsets' (or the mins') terms, two weight rows to a product, are summed apart; the 16
 * pairs' sums fill one register (lane 4 i + j). Then acc = fma(S, dw dx, acc) and accm = fma(M, dm
 * dx, accm), super-block after super-block, and y = acc - accm: what tile_k and the AMX kernel do,
 * so all give the same bits. kind: 1 = an offset (Q3_K, Q6_K), 2 = mins. */
INLINE void tile_kt(int RM, int RN, int kind, block_k *const *w, int64_t k, const quantized_x *xq, int64_t row,
                    float *y, int64_t ldy) {
    const __m512i lane_i = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i lane_j = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / QK; b++) {
        __m512i s[16];
        for (int p = 0; p < 16; p++) s[p] = _mm512_setzero_si512();
        for (int z = 0; z < 4; z++) {
            __m512i u[4];
            for (int j = 0; j < RN; j++) u[j] = _mm512_load_si512(w[j][b].u + 64 * z);
            for (int i = 0; i < RM; i++) {
                const __m512i q = _mm512_load_si512(xq->q + (row + i) * xq->kq + QK * b + 64 * z);
                for (int j = 0; j < RN; j++) s[4 * i + j] = _mm512_dpbusd_epi32(s[4 * i + j], u[j], q);
            }
        }
        for (int j = 0; j < RN; j++) {
            const __m512i sc = _mm512_cvtepi16_epi32(_mm256_load_si256((const __m256i *)w[j][b].sc));
            for (int i = 0; i < RM; i++) s[4 * i + j] = _mm512_mullo_epi32(s[4 * i + j], sc);
        }
        /* per i, two weight rows to a product: lanes 0-7 the first's terms, 8-15 the second's */
        __m512i o[8];
        float dx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int i = 0; i < 4; i++) {
            o[2 * i] = o[2 * i + 1] = _mm512_setzero_si512();
            if (i >= RM) continue;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(xq->bsum + (row + i) * (k / 16) + 16 * b));
            const __m512i bsum = _mm512_inserti64x4(_mm512_castsi256_si512(bs), bs, 1);
            dx[i] = xq->d[(row + i) * xq->nb + b];
            for (int h = 0; 2 * h < RN; h++) {
                const int16_t *t0 = kind == 1 ? w[2 * h][b].offsc : w[2 * h][b].mn;
                const __m256i t1 = 2 * h + 1 < RN ? _mm256_load_si256((const __m256i *)(kind == 1 ? w[2 * h + 1][b].offsc : w[2 * h + 1][b].mn))
                                                  : _mm256_setzero_si256();
                o[2 * i + h] = _mm512_madd_epi16(bsum, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)t0)), t1, 1));
            }
        }
        for (int p = 0; p < 8; p++) s[p] = sum_pairs(s[2 * p], s[2 * p + 1]);
        for (int p = 0; p < 4; p++) s[p] = sum_pairs(s[2 * p], s[2 * p + 1]);
        for (int p = 0; p < 4; p++) o[p] = sum_pairs(o[2 * p], o[2 * p + 1]);
        for (int p = 0; p < 2; p++) {
            s[p] = sum_pairs(s[2 * p], s[2 * p + 1]);
            o[p] = sum_pairs(o[2 * p], o[2 * p + 1]);
        }
        __m512i sum = sum_pairs(s[0], s[1]);
        const __m512i terms = sum_pairs(o[0], o[1]);
        if (kind == 1) sum = _mm512_add_epi32(sum, terms);
        float dw[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < RN; j++) {
            dw[j] = w[j][b].dw;
            dm[j] = w[j][b].dm;
        }
        const __m512 xv = _mm512_permutexvar_ps(lane_i, _mm512_castps128_ps512(_mm_loadu_ps(dx)));
        const __m512 wv = _mm512_permutexvar_ps(lane_j, _mm512_castps128_ps512(_mm_loadu_ps(dw)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(wv, xv), acc);
        if (kind == 2) {
            const __m512 mv = _mm512_permutexvar_ps(lane_j, _mm512_castps128_ps512(_mm_loadu_ps(dm)));
            accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(terms), _mm512_mul_ps(mv, xv), accm);
        }
    }
    float out[16] __attribute__((aligned(64))), outm[16] __attribute__((aligned(64)));
    _mm512_store_ps(out, acc);
    _mm512_store_ps(outm, accm);
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) y[i * ldy + j] = kind == 2 ? out[4 * i + j] - outm[4 * i + j] : out[4 * i + j];
}

/* 16 blocks of 32 bytes at p (fewer at the end: count) as a transposed chunk at out (512 bytes). */
static inline void transpose_blocks(const uint8_t *p, int count, uint8_t *out) {
    for (int l = 0; l < count; l++)
        for (int r = 0; r < 8; r++) memcpy(out + 64 * r + 4 * l, p + 32 * l + 4 * r, 4);
}

/* The 16 x 16 matrix of rows v[0..15] transposed in place. */
static inline void transpose16(__m512 *v) {
    __m512 a[16], b[16];
    for (int p = 0; p < 8; p++) {
        a[2 * p] = _mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]);
        a[2 * p + 1] = _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]);
    }
    for (int p = 0; p < 4; p++)
        for (int h = 0; h < 2; h++) {
            b[4 * p + h] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[4 * p + h]), _mm512_castps_pd(a[4 * p + 2 + h])));
            b[4 * p + 2 + h] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[4 * p + h]), _mm512_castps_pd(a[4 * p + 2 + h])));
        }
    /* b[4 p + q] holds, per 128-bit part x, elements 4 x .. 4 x + 3 of column q of rows 4 p .. 4 p + 3
     * (q = 0, 2, 1, 3 for b's order 0, 1, 2, 3) */
    for (int q = 0; q < 4; q++) {
        const int at = q == 1 ? 2 : q == 2 ? 1 : q;
        const __m512 r01a = _mm512_shuffle_f32x4(b[at], b[4 + at], 0x44), r01b = _mm512_shuffle_f32x4(b[at], b[4 + at], 0xee);
        const __m512 r23a = _mm512_shuffle_f32x4(b[8 + at], b[12 + at], 0x44), r23b = _mm512_shuffle_f32x4(b[8 + at], b[12 + at], 0xee);
        v[q] = _mm512_shuffle_f32x4(r01a, r23a, 0x88);
        v[4 + q] = _mm512_shuffle_f32x4(r01a, r23a, 0xdd);
        v[8 + q] = _mm512_shuffle_f32x4(r01b, r23b, 0x88);
        v[12 + q] = _mm512_shuffle_f32x4(r01b, r23b, 0xdd);
    }
}

/* y[i * ldy + j] = x[row + i] . w[j], i < RM, j < RN, for 32-block weights without mins, both
 * transposed (tile_row_t; qt: the activations q + 128, [rows][ldq]). Per chunk, lane l of pair (i,
 * j)'s dpbusd sums is block l's exact integer sum S; the 16 pairs' sums, transposed, give one
 * register per block, and acc = fma(S, dx dw, acc) block after block: tile_a's operations in its
 * order, so the same bits. wv: [blocks][16], dw of row j at 16 b + 4 i + j. */
INLINE void tile_at(int RM, int RN, const tile_row_t *w, const float *wv, int64_t blocks, const uint8_t *qt,
                    int64_t ldq, const float *d, int64_t ldd, int64_t row, float *y, int64_t ldy) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 16, 16, 16, 16, 0, 0, 0, 0, 16, 16, 16, 16);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; 16 * c < blocks; c++) {
        __m512i s[16];
        for (int p = 0; p < 16; p++) s[p] = _mm512_setzero_si512();
        for (int j = 0; j < RN; j++) {
            const __m512i corr = _mm512_load_si512(w[j].corr + 16 * c);
            for (int i = 0; i < RM; i++) s[4 * i + j] = corr;
        }
        for (int r = 0; r < 8; r++) {
            __m512i u[4];
            for (int j = 0; j < RN; j++) u[j] = _mm512_load_si512(w[j].s + 512 * c + 64 * r);
            for (int i = 0; i < RM; i++) {
                const __m512i q = _mm512_load_si512(qt + (row + i) * ldq + 512 * c + 64 * r);
                for (int j = 0; j < RN; j++) s[4 * i + j] = _mm512_dpbusd_epi32(s[4 * i + j], q, u[j]);
            }
        }
        __m512 f[16];
        for (int p = 0; p < 16; p++) f[p] = _mm512_cvtepi32_ps(s[p]);
        transpose16(f);
        const int count = blocks - 16 * c < 16 ? (int)(blocks - 16 * c) : 16;
        const __mmask16 valid = (__mmask16)((1u << count) - 1);
        __m512 dx[4];
        for (int i = 0; i < 4; i++)
            dx[i] = i < RM ? _mm512_maskz_loadu_ps(valid, d + (row + i) * ldd + 16 * c) : _mm512_setzero_ps();
        for (int l = 0; l < count; l++) {
            const __m512i at = _mm512_add_epi32(spread, _mm512_set1_epi32(l));
            const __m512 x = _mm512_mask_blend_ps(0xff00, _mm512_permutex2var_ps(dx[0], at, dx[1]),
                                                  _mm512_permutex2var_ps(dx[2], at, dx[3]));
            acc = _mm512_fmadd_ps(f[l], _mm512_mul_ps(x, _mm512_load_ps(wv + 16 * (16 * c + l))), acc);
        }
    }
    float out[16] __attribute__((aligned(64)));
    _mm512_store_ps(out, acc);
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) y[i * ldy + j] = out[4 * i + j];
}

typedef void (*tile_at_fn)(const tile_row_t *w, const float *wv, int64_t blocks, const uint8_t *qt, int64_t ldq,
                           const float *d, int64_t ldd, int64_t row, float *y, int64_t ldy);
#define TILE_AT(M, N, X) static void tile_at_##M##_##N##_##X(const tile_row_t *w, const float *wv, int64_t blocks, \
    const uint8_t *qt, int64_t ldq, const float *d, int64_t ldd, int64_t row, float *y, int64_t ldy) { \
    tile_at(M, N, w, wv, blocks, qt, ldq, d, ldd, row, y, ldy); }

typedef void (*tile_a_fn)(const tile_row_a *w, int64_t k, const quantized_x *xq, int64_t row, float *y, int64_t ldy);
typedef void (*tile_k_fn)(block_k *const *w, int64_t k, const quantized_x *xq, int64_t row, float *y, int64_t ldy);

#define TILE_A(M, N, X) static void tile_a_##M##_##N##_##X(const tile_row_a *w, int64_t k, const quantized_x *xq, \
    int64_t row, float *y, int64_t ldy) { tile_a(M, N, X, w, k, xq, row, y, ldy); }
#define TILE_K(M, N, X) static void tile_k_##M##_##N##_##X(block_k *const *w, int64_t k, const quantized_x *xq, \
    int64_t row, float *y, int64_t ldy) { tile_k(M, N, X, w, k, xq, row, y, ldy); }
#define ROWS4(F, N, X) F(1, N, X) F(2, N, X) F(3, N, X) F(4, N, X)
ROWS4(TILE_A, 1, 0) ROWS4(TILE_A, 2, 0) ROWS4(TILE_A, 3, 0) ROWS4(TILE_A, 4, 0)
ROWS4(TILE_A, 1, 1) ROWS4(TILE_A, 2, 1) ROWS4(TILE_A, 3, 1) ROWS4(TILE_A, 4, 1)
ROWS4(TILE_K, 1, 1) ROWS4(TILE_K, 2, 1) ROWS4(TILE_K, 1, 2) ROWS4(TILE_K, 2, 2)
#define TILE_KT(M, N, X) static void tile_kt_##M##_##N##_##X(block_k *const *w, int64_t k, const quantized_x *xq, \
    int64_t row, float *y, int64_t ldy) { tile_kt(M, N, X, w, k, xq, row, y, ldy); }
ROWS4(TILE_AT, 1, 0) ROWS4(TILE_AT, 2, 0) ROWS4(TILE_AT, 3, 0) ROWS4(TILE_AT, 4, 0)
ROWS4(TILE_KT, 1, 1) ROWS4(TILE_KT, 2, 1) ROWS4(TILE_KT, 3, 1) ROWS4(TILE_KT, 4, 1)
ROWS4(TILE_KT, 1, 2) ROWS4(TILE_KT, 2, 2) ROWS4(TILE_KT, 3, 2) ROWS4(TILE_KT, 4, 2)
#define COL4(P, N, X) {P##_1_##N##_##X, P##_2_##N##_##X, P##_3_##N##_##X, P##_4_##N##_##X}

/* Rows a..b of the activations times the nr tile rows, into y (column 0 = the tile's first row).
 * transposed: K-quant super-blocks come transposed (transpose_k), for tile_kt; else for tile_k. ta32:
 * 32-block rows and activations transposed 16 blocks to a chunk, for tile_at; else tile_a. */
static void many_fast(int t, const tile_row_a *wa, block_k *const *wk, int nr, int64_t k, const quantized_x *xq,
                      int64_t a, int64_t b, float *y, int64_t ldy, int transposed, const transposed_a *ta32) {
    if (ta32) {
        static const tile_at_fn tat[4][4] = {COL4(tile_at, 1, 0), COL4(tile_at, 2, 0), COL4(tile_at, 3, 0), COL4(tile_at, 4, 0)};
        for (int64_t i = a; i < b; i += 4) {
            const int rm = b - i < 4 ? (int)(b - i) : 4;
            for (int j = 0; j < nr; j += 4)
                tat[(nr - j < 4 ? nr - j : 4) - 1][rm - 1](ta32->rows + j, ta32->wv + (j / 4) * ta32->blocks * 16, ta32->blocks,
                                                          ta32->qt, ta32->ldq, xq->d, xq->nb, i, y + i * ldy + j, ldy);
        }
        return;
    }
    static const tile_a_fn ta[2][4][4] = {{COL4(tile_a, 1, 0), COL4(tile_a, 2, 0), COL4(tile_a, 3, 0), COL4(tile_a, 4, 0)},
                                          {COL4(tile_a, 1, 1), COL4(tile_a, 2, 1), COL4(tile_a, 3, 1), COL4(tile_a, 4, 1)}};
    static const tile_k_fn tk[2][2][4] = {{COL4(tile_k, 1, 1), COL4(tile_k, 2, 1)}, {COL4(tile_k, 1, 2), COL4(tile_k, 2, 2)}};
    static const tile_k_fn tkt[2][4][4] = {{COL4(tile_kt, 1, 1), COL4(tile_kt, 2, 1), COL4(tile_kt, 3, 1), COL4(tile_kt, 4, 1)},
                                           {COL4(tile_kt, 1, 2), COL4(tile_kt, 2, 2), COL4(tile_kt, 3, 2), COL4(tile_kt, 4, 2)}};
    for (int64_t i = a; i < b; i += 4) {
        const int rm = b - i < 4 ? (int)(b - i) : 4;
        for (int j = 0; j < nr;) {
            const int rn = is_k_quant(t) && !transposed ? 2 : 4, cols = nr - j < rn ? nr - j : rn;
            if (is_k_quant(t) && transposed)
                tkt[has_min_k(t)][cols - 1][rm - 1](wk + j, k, xq, i, y + i * ldy + j, ldy);
            else if (is_k_quant(t))
                tk[has_min_k(t)][cols - 1][rm - 1](wk + j, k, xq, i, y + i * ldy + j, ldy);
            else
                ta[has_min_a(t)][cols - 1][rm - 1](wa + j, k, xq, i, y + i * ldy + j, ldy);
            j += cols;
        }
    }
}

#else

static void many_fast(int t, const tile_row_a *wa, block_k *const *wk, int nr, int64_t k, const quantized_x *xq,
                      int64_t a, int64_t b, float *y, int64_t ldy, int transposed, const transposed_a *ta32) {
    (void)transposed;
    (void)ta32;
    for (int64_t i = a; i < b; i++)
        for (int j = 0; j < nr; j++)
            y[i * ldy + j] = is_k_quant(t) ? dot_k(wk[j], xq, i, k) : dot_a(t, &wa[j].a, xq, i, k);
}

#endif

/* Weight row w unpacked into tile row j: 32-blocks into wa[j], super-blocks into wk[j]. */
static void unpack_tile_row(int t, const uint8_t *w, int64_t k, tile_row_a *wa, block_k **wk, int j) {
    if (is_k_quant(t)) {
        unpack_row_k(t, w, k, wk[j]);
        return;
    }
    unpack_row_a(t, w, k, &wa[j].a);
#if ARCH == 2
    const int off = offset_a(t);
    for (int64_t b = 0; b < k / 32; b++) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(wa[j].a.u + 32 * b));
        const __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256()); /* four partial sums of u */
        const int sum = (int)(_mm256_extract_epi64(sad, 0) + _mm256_extract_epi64(sad, 1) + _mm256_extract_epi64(sad, 2) +
                              _mm256_extract_epi64(sad, 3)) - 32 * off;
        _mm256_storeu_si256((__m256i *)(wa[j].s + 32 * b), _mm256_sub_epi8(u, _mm256_set1_epi8((char)off)));
        wa[j].wcorr[8 * b] = -128 * sum;
    }
#endif
}

/* ---- AMX: the same many-row products on int8 tiles ---------------------------------------------
 *
 * With AMX (Sapphire Rapids on), TDPBSSD multiplies a tile of 16 weight rows x K signed bytes by
 * a tile of K x 16 activation rows (K / 4 rows of 16 x 4 bytes) into 16 x 16 int32, many times
 * faster than VNNI registers. The weights' scales change every sub-block (16 or 32 elements), so
 * each sub-block is one TDPBSSD (K = its size) into a fresh tile, scaled by the rows' integer
 * scales and summed in int32 registers: per super-block (per 32-block) the integer sums are
 * exactly those of the VNNI kernels, and the float scaling after them is the same operations,
 * so the results are the same bits. The mins' integer sums take TDPBSSD over whole 64-element
 * chunks against bytes holding each element's sub-block min. Weights are (u - off) as signed
 * bytes (they fit: |u - off| <= 128 and AMX sums in int32); activations are the signed q, packed
 * per group in blocks of 16 rows in the tile layout (zero past the group's rows). */

#if ARCH == 2 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static int amx_on; /* set by raymoe_blocks_set_amx */

/* Linux lets a process use the tile registers after asking once (for all its threads). */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0) {
        unsigned long features = 0;
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 &&
                syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &features) == 0 && (features >> 18 & 1);
    }
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles: 0-3 products (16 x 16 int32) in turn, 4 and 5 weights (16 x K bytes), 6 and 7
 * activations (K / 4 x 64 bytes), in turn; with mins, 2 sums the mins and 3 holds min bytes
 * (16 x K), leaving two products in turn. Several products in flight hide each one's latency
 * (load, multiply, store, reload). */
static void amx_configure(int kb, int mins) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = (uint16_t)(i == 4 || i == 5 || (mins && i == 3) ? kb : 64);
        c.rows[i] = (uint8_t)(i >= 6 ? kb / 4 : 16);
    }
    _tile_loadconfig(&c);
}

/* One product of K = kb into tile C from weights w (row stride rs) and packed activations x,
 * stored at out. */
#define AMX_PRODUCT(C, A, B, w, rs, x, out) do { _tile_zero(C); _tile_loadd(A, w, rs); _tile_loadd(B, x, 64); \
                                               _tile_dpbssd(C, A, B); _tile_stored(C, out, 64); } while (0)

/* Groups of fewer rows stay with VNNI: the tile's preparation outweighs the faster products
 * (measured: Q3_K experts, 16 rows about even). */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 32
#endif
static int amx_group(const int64_t *group) { return group[2] - group[1] >= AMX_MIN_ROWS; }

/* Sub-block size: the run of elements sharing one integer scale. */
static int amx_sub(int t) { return t == Q4_K || t == Q5_K || !is_k_quant(t) ? 32 : 16; }

/* A tile's extra arrays: per block (32-blocks) or super-block, per tile row j: dw, dm; K-quants:
 * the integer scale of each 16 and the bytes holding each element's min. */
typedef struct {
    float *dw, *dm;   /* [blocks][16] */
    int32_t *sc;      /* [k / QK][16][16 sub-blocks of 16] */
    int8_t *mins;     /* [16][k] */
} amx_tile;

static size_t amx_tile_bytes(int64_t k) {
    return 2 * (size_t)(k / 32) * 64 + (size_t)(k / QK) * 1024 + 16 * (size_t)k + 64;
}

static amx_tile amx_tile_at(uint8_t *p, int64_t k) {
    amx_tile a;
    a.dw = (float *)p;
    a.dm = a.dw + (k / 32) * 16;
    a.sc = (int32_t *)(a.dm + (k / 32) * 16);
    a.mins = (int8_t *)(a.sc + (k / QK) * 256);
    return a;
}

/* Tile row j, already unpacked by unpack_tile_row, made ready: K-quants' u less off in place,
 * scales and mins across the tile's rows. */
static void amx_tile_row(int t, int64_t k, const tile_row_a *wa, block_k *const *wk, const amx_tile *a, int j) {
    if (!is_k_quant(t)) {
        for (int64_t b = 0; b < k / 32; b++) {
            a->dw[16 * b + j] = wa[j].a.dw[b];
            a->dm[16 * b + j] = wa[j].a.dm[b];
        }
        return;
    }
    for (int64_t b = 0; b < k / QK; b++) {
        block_k *c = &wk[j][b];
        a->dw[16 * b + j] = c->dw;
        a->dm[16 * b + j] = c->dm;
        /* the scale of each 16 (every eighth of scx) as int32 */
        const __m512i every8 = _mm512_setr_epi32(0x00080000, 0x00180010, 0x00280020, 0x00380030, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(c->scx), every8, _mm512_load_si512(c->scx + 32));
        const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(c->scx + 64), every8, _mm512_load_si512(c->scx + 96));
        _mm512_store_si512(a->sc + 256 * b + 16 * j,
                           _mm512_cvtepi16_epi32(_mm256_setr_m128i(_mm512_castsi512_si128(lo), _mm512_castsi512_si128(hi))));
        if (c->off) {
            const __m512i off = _mm512_set1_epi8((char)c->off);
            for (int z = 0; z < 4; z++)
                _mm512_store_si512(c->u + 64 * z, _mm512_sub_epi8(_mm512_load_si512(c->u + 64 * z), off));
        }
        if (!has_min_k(t)) continue;
        /* bytes 4z .. 4z + 3 of the mins, each over its 16 elements */
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0x01010101, 0x01010101, 0x01010101, 0x01010101,
                                                 0x02020202, 0x02020202, 0x02020202, 0x02020202,
                                                 0x03030303, 0x03030303, 0x03030303, 0x03030303);
        const __m128i mn = _mm256_cvtepi16_epi8(_mm256_load_si256((const __m256i *)c->mn));
        const __m512i words = _mm512_broadcast_i32x4(mn);
        for (int z = 0; z < 4; z++) {
            const __m512i four = _mm512_permutexvar_epi32(_mm512_set1_epi32(z), words);
            _mm512_storeu_si512(a->mins + (int64_t)j * k + QK * b + 64 * z, _mm512_shuffle_epi8(four, spread));
        }
    }
}

/* Packed activations of up to 16 rows: q [k / 4][16][4] (signed; flip: from q + 128), and per
 * block the rows' d and ds [blocks][16]. */
static size_t amx_pack_bytes(int64_t k, int qb) { return 16 * (size_t)k + 2 * (size_t)(k / qb) * 64; }

static void amx_pack(const quantized_x *xq, int64_t k, int qb, int flip, int64_t row, int rows, uint8_t *p) {
    int32_t *q = (int32_t *)p;
    const int32_t x = flip ? (int32_t)0x80808080u : 0;
    float *d = (float *)(p + 16 * k), *ds = d + (k / qb) * 16;
    memset(p, 0, amx_pack_bytes(k, qb));
    for (int m = 0; m < rows; m++) {
        const int32_t *src = (const int32_t *)(xq->q + (row + m) * xq->kq);
        for (int64_t w = 0; w < k / 4; w++) q[16 * w + m] = src[w] ^ x;
        for (int64_t b = 0; b < k / qb; b++) {
            d[16 * b + m] = xq->d[(row + m) * xq->nb + b];
            ds[16 * b + m] = xq->ds[(row + m) * xq->nb + b];
        }
    }
}

/* y[m * ldy + j] for m < rows, j < nr: the tile (rows wk[0].., row stride rs) times packed
 * activations p, K-quants. */
static void amx_k(int t, const block_k *w0, int64_t rs, const amx_tile *a, int64_t k, const uint8_t *p, int rows,
                  int nr, float *y, int64_t ldy) {
    const int kb = amx_sub(t), subs = QK / kb, mins = has_min_k(t);
    const float *d = (const float *)(p + 16 * k);
    int32_t prod[4][256] __attribute__((aligned(64))), msum[256] __attribute__((aligned(64)));
    __m512 acc[16], accm[16];
    for (int n = 0; n < 16; n++) acc[n] = accm[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *wb = (const uint8_t *)(w0 + b), *xb = p + 16 * QK * b;
        const int8_t *mb = a->mins + QK * b;
        __m512i s[16];
        for (int n = 0; n < 16; n++) s[n] = _mm512_setzero_si512();
        if (mins) _tile_zero(2);
        for (int i = 0; i < subs; i += mins ? 2 : 4) {
            AMX_PRODUCT(0, 4, 6, wb + kb * i, rs, xb + 16 * kb * i, prod[0]);
            if (mins) {
                _tile_loadd(3, mb + kb * i, k);
                _tile_dpbssd(2, 3, 6);
            }
            AMX_PRODUCT(1, 5, 7, wb + kb * (i + 1), rs, xb + 16 * kb * (i + 1), prod[1]);
            if (mins) {
                _tile_loadd(3, mb + kb * (i + 1), k);
                _tile_dpbssd(2, 3, 7);
            } else {
                AMX_PRODUCT(2, 4, 6, wb + kb * (i + 2), rs, xb + 16 * kb * (i + 2), prod[2]);
                AMX_PRODUCT(3, 5, 7, wb + kb * (i + 3), rs, xb + 16 * kb * (i + 3), prod[3]);
            }
            for (int h = 0; h < (mins ? 2 : 4); h++) {
                const int32_t *sc = a->sc + 256 * b + (i + h) * kb / 16;
#pragma GCC unroll 16
                for (int n = 0; n < 16; n++)
                    s[n] = _mm512_add_epi32(s[n], _mm512_mullo_epi32(_mm512_load_si512(prod[h] + 16 * n), _mm512_set1_epi32(sc[16 * n])));
            }
        }
        if (mins) _tile_stored(2, msum, 64);
        const __m512 dx = _mm512_load_ps(d + 16 * b);
#pragma GCC unroll 16
        for (int n = 0; n < 16; n++) {
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[n]), _mm512_mul_ps(_mm512_set1_ps(a->dw[16 * b + n]), dx), acc[n]);
            if (mins)
                accm[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(msum + 16 * n)),
                                          _mm512_mul_ps(_mm512_set1_ps(a->dm[16 * b + n]), dx), accm[n]);
        }
    }
    float out[256] __attribute__((aligned(64)));
    for (int n = 0; n < 16; n++) _mm512_store_ps(out + 16 * n, mins ? _mm512_sub_ps(acc[n], accm[n]) : acc[n]);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nr; j++) y[m * ldy + j] = out[16 * j + m];
}

/* The same for 32-blocks: tile rows wa[0].s.. (row stride rs). */
static void amx_a(int t, const int8_t *w0, int64_t rs, const amx_tile *a, int64_t k, const uint8_t *p, int rows,
                  int nr, float *y, int64_t ldy) {
    const int mins = has_min_a(t);
    const float *d = (const float *)(p + 16 * k), *ds = d + (k / 32) * 16;
    int32_t prod[4][256] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        const int8_t *w = w0 + 32 * b;
        const uint8_t *x = p + 16 * 32 * b;
        switch (b & 3) {
        case 0: AMX_PRODUCT(0, 4, 6, w, rs, x, prod[0]); break;
        case 1: AMX_PRODUCT(1, 5, 7, w, rs, x, prod[1]); break;
        case 2: AMX_PRODUCT(2, 4, 6, w, rs, x, prod[2]); break;
        default: AMX_PRODUCT(3, 5, 7, w, rs, x, prod[3]); break;
        }
        const int32_t *c = prod[b & 3];
        const __m512 dx = _mm512_load_ps(d + 16 * b), dsx = _mm512_load_ps(ds + 16 * b);
#pragma GCC unroll 16
        for (int n = 0; n < 16; n++) {
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * n)),
                                     _mm512_mul_ps(dx, _mm512_set1_ps(a->dw[16 * b + n])), acc[n]);
            if (mins) acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(a->dm[16 * b + n]), dsx, acc[n]);
        }
    }
    float out[256] __attribute__((aligned(64)));
    for (int n = 0; n < 16; n++) _mm512_store_ps(out + 16 * n, acc[n]);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nr; j++) y[m * ldy + j] = out[16 * j + m];
}
#endif

/* The fewest rows of a group that go to AMX (tests straddle it). */
int raymoe_blocks_amx_min_rows(void) {
#ifdef HAVE_AMX
    return AMX_MIN_ROWS;
#else
    return 0;
#endif
}

/* Whether the many-row products use AMX: on asks for it (granted where this build and the CPU
 * and kernel allow it). Returns whether they do now. */
int raymoe_blocks_set_amx(int on) {
#ifdef HAVE_AMX
    amx_on = on && amx_permitted();
    return amx_on;
#else
    (void)on;
    return 0;
#endif
}

/* raymoe_blocks_grouped's fast mode for groups of many rows (quantised weight types only):
 * each (group, MANY_TILE weight rows) is one parallel work item. With AMX on (and a type with a
 * sub-block of 32 or 16), the activations are also packed per group in blocks of 16 rows and
 * each item multiplies by tiles. Returns 0, or -1 when out of memory. */
int raymoe_blocks_grouped_many(int t, const float *x, int64_t m, int64_t ldx, const uint8_t *raw, int64_t w_stride,
                               const uint8_t *raw2, int64_t w_stride2, int64_t n1, const int64_t *groups,
                               int64_t count, int64_t n, int64_t k, float *y, int64_t ldy) {
    if (is_float(t)) return -2;
    const int kq = is_k_quant(t), qb = kq ? QK : 32;
    const int64_t row_bytes = k / block_elems(t) * block_bytes(t), tiles = (n + MANY_TILE - 1) / MANY_TILE;
    const weight_rows wr = {raw, raw2, w_stride, w_stride2, raw2 ? n1 : n, row_bytes};
#ifdef HAVE_AMX
    const int amx = amx_on;
#else
    const int amx = 0;
#endif
    /* AVX-512's 32-block kernel takes q + 128 (dpbusd multiplies unsigned by signed bytes) */
    const int natural = ARCH == 2 && !kq ? 2 : 1;
    /* AVX-512 without AMX: K-quant super-blocks transposed, for tile_kt */
    const int transposed = ARCH == 2 && kq && !amx && transposed_on;
    /* and 32-block types without mins: blocks transposed 16 to a chunk, for tile_at */
    const int64_t blocks = k / 32, chunks = (blocks + 15) / 16, ldq = 512 * chunks;
    const int transposed32 = ARCH == 2 && !kq && !amx && !has_min_a(t) && transposed_on;
    quantized_x xq = alloc_x(t, m, k, qb, 1);
    uint8_t *qt = transposed32 ? alloc64((size_t)(m * ldq)) : NULL;
    /* AMX: the first packed block of each group, and room for them all */
    int64_t *first = amx ? malloc((size_t)(count + 1) * sizeof(int64_t)) : NULL;
    uint8_t *packed = NULL;
#ifdef HAVE_AMX
    const size_t pack_size = amx_pack_bytes(k, qb);
    if (first) {
        first[0] = 0;
        for (int64_t g = 0; g < count; g++) first[g + 1] = first[g] + (amx_group(groups + 3 * g) ? (groups[3 * g + 2] - groups[3 * g + 1] + 15) / 16 : 0);
        packed = alloc64((size_t)first[count] * pack_size + 64);
    }
#endif
    item_run *runs = item_runs_new(count * tiles);
    if (!x_allocated(&xq) || (amx && !packed) || (transposed32 && !qt) || !runs) {
        free_x(&xq);
        free(qt);
        free(first);
        free(packed);
        free(runs);
        return -1;
    }
    /* one tile row: 32-blocks: u and s [kq] (zero past k), wcorr [lanes], dw and dm
     * [nb]; K-quants: k / QK super-blocks */
    const int64_t lanes = 8 * xq.nb; /* a multiple of 16: 64-byte arrays */
    const size_t row_size = kq ? (size_t)(k / QK) * sizeof(block_k)
                               : 2 * (size_t)xq.kq + (size_t)lanes * 4 + 2 * (size_t)xq.nb * sizeof(float);
    const size_t row_stride = (row_size + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel
    {
        size_t extra = 0;
#ifdef HAVE_AMX
        if (amx) {
            extra = amx_tile_bytes(k);
            amx_configure(amx_sub(t), kq && has_min_k(t));
        }
#endif
        uint8_t *buffer = zalloc64(MANY_TILE * row_stride + extra);
        /* the transposed rows: each row's weights and corrections, then wv; zero past the blocks */
        const size_t t_row = (size_t)chunks * (512 + 64);
        uint8_t *tbuffer = transposed32 ? zalloc64(MANY_TILE * t_row + (size_t)(MANY_TILE / 4) * blocks * 64) : NULL;
        tile_row_t trows[MANY_TILE];
        transposed_a ta32 = {trows, tbuffer ? (const float *)(tbuffer + MANY_TILE * t_row) : NULL, blocks, qt, ldq};
        for (int j = 0; tbuffer && j < MANY_TILE; j++) {
            trows[j].s = (int8_t *)(tbuffer + j * t_row);
            trows[j].corr = (int32_t *)(tbuffer + j * t_row + 512 * chunks);
        }
        if (transposed32 && !tbuffer) {
            free(buffer);
            buffer = NULL;
        }
        tile_row_a wa[MANY_TILE];
        block_k *wk[MANY_TILE];
        for (int j = 0; buffer && j < MANY_TILE; j++) {
            uint8_t *p = buffer + j * row_stride;
            wk[j] = (block_k *)p;
            wa[j].a.u = p;
            wa[j].s = (int8_t *)(p + xq.kq);
            wa[j].wcorr = (int32_t *)(p + 2 * xq.kq);
            wa[j].a.dw = (float *)(wa[j].wcorr + lanes);
            wa[j].a.dm = wa[j].a.dw + xq.nb;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
#if ARCH == 2
            quantize_row_natural(x + i * ldx, k, qb, kq ? 0 : offset_a(t), &xq, i, natural);
            for (int64_t b = 0; transposed && b < k / QK; b++) transpose_k((uint8_t *)xq.q + i * xq.kq + QK * b);
            for (int64_t c = 0; transposed32 && c < chunks; c++)
                transpose_blocks((const uint8_t *)xq.q + i * xq.kq + 512 * c, blocks - 16 * c < 16 ? (int)(blocks - 16 * c) : 16,
                                 qt + i * ldq + 512 * c);
#else
            quantize_row(t, x + i * ldx, k, qb, kq ? 0 : offset_a(t), &xq, i, natural);
#endif
        }
#ifdef HAVE_AMX
        if (amx) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < count; g++)
                for (int64_t r = groups[3 * g + 1], at = first[g]; amx_group(groups + 3 * g) && r < groups[3 * g + 2]; r += 16, at++)
                    amx_pack(&xq, k, qb, natural == 2, r, (int)(groups[3 * g + 2] - r < 16 ? groups[3 * g + 2] - r : 16),
                             packed + at * pack_size);
        }
#endif
        item_runs_start(runs, count * tiles);
        for (int64_t item; (item = item_next(runs)) >= 0;) {
            if (!buffer) {
                failed = 1;
                continue;
            }
            const int64_t *group = groups + 3 * (item / tiles);
            const int64_t r0 = item % tiles * MANY_TILE;
            const int nr = (int)(n - r0 < MANY_TILE ? n - r0 : MANY_TILE);
            for (int j = 0; j < nr; j++) {
                unpack_tile_row(t, weight_row(&wr, group[0], r0 + j), k, wa, wk, j);
#if ARCH == 2
                for (int64_t b = 0; transposed && b < k / QK; b++) transpose_k(wk[j][b].u);
                if (transposed32) {
                    for (int64_t c = 0; c < chunks; c++)
                        transpose_blocks((const uint8_t *)wa[j].s + 512 * c, blocks - 16 * c < 16 ? (int)(blocks - 16 * c) : 16,
                                         (uint8_t *)trows[j].s + 512 * c);
                    float *wv = (float *)ta32.wv + (j / 4) * blocks * 16;
                    for (int64_t b = 0; b < blocks; b++) {
                        trows[j].corr[b] = wa[j].wcorr[8 * b];
                        for (int i = 0; i < 4; i++) wv[16 * b + 4 * i + j % 4] = wa[j].a.dw[b];
                    }
                }
#endif
            }
#ifdef HAVE_AMX
            if (amx && amx_group(group)) {
                const amx_tile at = amx_tile_at(buffer + MANY_TILE * row_stride, k);
                for (int j = 0; j < nr; j++) amx_tile_row(t, k, wa, wk, &at, j);
                int64_t pb = first[item / tiles];
                for (int64_t r = group[1]; r < group[2]; r += 16, pb++) {
                    const int rows = (int)(group[2] - r < 16 ? group[2] - r : 16);
                    if (kq)
                        amx_k(t, wk[0], (int64_t)row_stride, &at, k, packed + pb * pack_size, rows, nr, y + r * ldy + r0, ldy);
                    else
                        amx_a(t, wa[0].s, (int64_t)row_stride, &at, k, packed + pb * pack_size, rows, nr, y + r * ldy + r0, ldy);
                }
                continue;
            }
#endif
            many_fast(t, wa, wk, nr, k, &xq, group[1], group[2], y + r0, ldy, transposed, transposed32 ? &ta32 : NULL);
        }
#ifdef HAVE_AMX
        if (amx) _tile_release();
#endif
        free(buffer);
        free(tbuffer);
    }
    free_x(&xq);
    free(qt);
    free(first);
    free(packed);
    free(runs);
    return failed ? -1 : 0;
}

/* ---- the end of a MoE layer ----------------------------------------------------------------------- */

/* out[t] = sum over j of w[t, j] * rows[t k + j] (j in order, each product rounded before it is added),
 * then, where gate is given, plus sigmoid(gate[t ldg]) * shared[t] (sigmoid as 1 / (1 + exp(-g))). rows
 * [T k, h], shared and out [T, h], contiguous. One element at a time in a fixed order: the result does not
 * depend on T, on the thread count or on the build's vector width. */
void raymoe_moe_combine(int64_t tokens, int64_t k, int64_t h, const float *rows, const float *w, const float *gate,
                        int64_t ldg, const float *shared, float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        float *y = out + t * h;
        const float *r = rows + t * k * h, *wt = w + t * k;
        for (int64_t i = 0; i < h; i++) y[i] = wt[0] * r[i];
        for (int64_t j = 1; j < k; j++)
            for (int64_t i = 0; i < h; i++) y[i] += wt[j] * r[j * h + i];
        if (gate) {
            const float s = 1.0f / (1.0f + expf(-gate[t * ldg])), *d = shared + t * h;
            for (int64_t i = 0; i < h; i++) y[i] += s * d[i];
        }
    }
}

/* ---- a MoE layer's activations ---------------------------------------------------------------------- */

/* exp(d) as torch's vectorised CPU kernels compute it (SLEEF's expf, 1-ulp variant, with fused
 * multiply-adds): the range reduction d = q ln2 + s in two parts, a degree-6 polynomial in s, then 2^q
 * applied in two halves. torch's SiLU and sigmoid over whole vectors use this exp, so the activations
 * below give their bits; the caller checks with raymoe_moe_activation that they do on this host. */
static inline float pow2i(int q) {
    const uint32_t bits = (uint32_t)(q + 0x7f) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float vector_expf(float d) {
    const float qf = rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    const float qc = qf < -200.0f ? -200.0f : qf > 200.0f ? 200.0f : qf;   /* beyond: overridden below */
    const int q = (int)qc;
    float s = fmaf((float)q, -0.693145751953125f, d);
    s = fmaf((float)q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
    u = d < -104.0f ? 0.0f : u;
    return 100.0f < d ? INFINITY : u;
}

/* out[j, i] for the k rows of gate_up [k, 2 ff] ([gate | up] halves): kind 0, silu(gate) * up with silu(g) =
 * g / (1 + exp(-g)); kind 1, gpt-oss's (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha g)) with
 * g = min(gate, limit) and sigmoid(v) = 1 / (1 + exp(-v)). Each operation rounds as torch's does. exp is
 * vector_expf with vector_exp set (a constant where this is inlined: the loops vectorise), else the C
 * library's expf (torch without vector kernels). */
static inline __attribute__((always_inline)) void activation_rows(int vector_exp, int kind, float alpha, float limit,
                                                                  const float *gate_up, int64_t k, int64_t ff,
                                                                  float *out) {
    for (int64_t j = 0; j < k; j++) {
        const float *g = gate_up + j * 2 * ff, *u = g + ff;
        float *y = out + j * ff;
        if (kind == 0)
            for (int64_t i = 0; i < ff; i++)
                y[i] = g[i] / (1.0f + (vector_exp ? vector_expf(-g[i]) : expf(-g[i]))) * u[i];
        else
            for (int64_t i = 0; i < ff; i++) {
                const float gi = g[i] > limit ? limit : g[i];     /* NaN stays NaN, as torch's clamp */
                const float ui = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
                const float v = -(gi * alpha);
                y[i] = (ui + 1.0f) * (gi * (1.0f / (1.0f + (vector_exp ? vector_expf(v) : expf(v)))));
            }
    }
}

/* activation_rows with exp_kind 1 (vector_expf) or 0 (expf). Exported too: the caller compares it with torch's
 * own, which decides whether this host's torch computes the same bits. */
void raymoe_moe_activation(int kind, int exp_kind, float alpha, float limit, const float *gate_up, int64_t k,
                           int64_t ff, float *out) {
    if (exp_kind)
        activation_rows(1, kind, alpha, limit, gate_up, k, ff, out);
    else
        activation_rows(0, kind, alpha, limit, gate_up, k, ff, out);
}

/* ---- a MoE layer's decode for one token -------------------------------------------------------------- */

/* One of a MoE layer's weights for raymoe_moe_token: a stack of experts (or one matrix) of GGML blocks. */
typedef struct {
    int type, quantize;             /* the GGML type; the fast (int8 activations) mode */
    const uint8_t *raw, *raw2;      /* raw2: a second weight whose rows follow raw's (up after gate), or NULL */
    int64_t stride, stride2, n1;    /* bytes from one expert to the next; raw's rows */
    const float *bias;              /* [E, rows] float32, or NULL */
} moe_weight;

/* Rows a..b of y ([rows, n]) = rows a..b of x ([rows, k], row stride ldx; 0: one row for every group's rows)
 * times the transpose of expert e of wt, plus that expert's bias row, for each group (e, a, b): the call and the
 * addition the separate ops make for these rows. Returns 0, or -1 when out of memory. */
static int expert_groups(const moe_weight *wt, const float *x, int64_t ldx, int64_t rows, const int64_t *groups,
                         int64_t count, int64_t n, int64_t k, float *y) {
    if (raymoe_blocks_grouped(wt->type, wt->quantize, x, rows, ldx, wt->raw, wt->stride, wt->raw2, wt->stride2,
                              wt->n1, groups, count, n, k, y, n))
        return -1;
    for (int64_t g = 0; wt->bias && g < count; g++)
        for (int64_t j = groups[3 * g + 1]; j < groups[3 * g + 2]; j++)
            for (int64_t i = 0; i < n; i++) y[j * n + i] += wt->bias[groups[3 * g] * n + i];
    return 0;
}

/* Row j of y ([slots, n]) = row j of x ([slots, k], row stride ldx; 0: one row for every slot) times the
 * transpose of expert experts[j] of wt, plus that expert's bias row. Returns 0, or -1 when out of memory (or
 * slots is not 1 to 64). */
static int expert_slots(const moe_weight *wt, const float *x, int64_t ldx, int64_t slots, const int64_t *experts,
                        int64_t n, int64_t k, float *y) {
    int64_t groups[3 * 64];
    if (slots < 1 || slots > 64) return -1;
    for (int64_t j = 0; j < slots; j++) {
        groups[3 * j] = experts[j];
        groups[3 * j + 1] = j;
        groups[3 * j + 2] = j + 1;
    }
    return expert_groups(wt, x, ldx, slots, groups, slots, n, k, y);
}

/* One token's MoE layer after its router, in one call: for each slot j, expert experts[j]'s gate/up product of
 * x [h], raymoe_moe_activation (act, exp_kind, alpha, limit), its down product; the shared expert's activation of
 * shared_gate_up [2 sff] (the router's product computed it) and down product, when given; then
 * raymoe_moe_combine with the routing weights w [k] and the shared expert's gate. The same calls and
 * additions as the separate ops for these slots: the same bits. k: 1 to 64. scratch: k (3 ff + h) + sff + h
 * floats. Returns 0, or -1 when out of memory (or k is out of range). */
int raymoe_moe_token(const float *x, int64_t h, int64_t k, const int64_t *experts, const float *w,
                     const moe_weight *gate_up, int64_t ff, const moe_weight *down, int act, int exp_kind, float alpha,
                     float limit, const float *shared_gate_up, int64_t sff, const moe_weight *shared_down,
                     const float *gate, float *scratch, float *out) {
    float *hidden = scratch, *activated = hidden + k * 2 * ff, *rows = activated + k * ff, *shared_act = rows + k * h,
          *shared = shared_act + sff;
    if (expert_slots(gate_up, x, 0, k, experts, 2 * ff, h, hidden)) return -1;
    raymoe_moe_activation(act, exp_kind, alpha, limit, hidden, k, ff, activated);
    if (expert_slots(down, activated, ff, k, experts, h, ff, rows)) return -1;
    if (shared_gate_up) {
        const int64_t first = 0;
        raymoe_moe_activation(act, exp_kind, alpha, limit, shared_gate_up, 1, sff, shared_act);
        if (expert_slots(shared_down, shared_act, 0, 1, &first, h, sff, shared)) return -1;
    }
    raymoe_moe_combine(1, k, h, rows, w, shared_gate_up ? gate : NULL, 1, shared, out);
    return 0;
}

/* ---- a decode token's layer in two calls: its mixer (DeltaNet, attention), its feed-forward ---------- */

/* torch's float32 reduction of n values over `lanes` vector lanes (ATen's vec::reduce_all): lane l takes values
 * l, l + lanes, ... in turn, then the lanes are halved pairwise (lane l with l + lanes / 2, ...); fewer values
 * than lanes are taken one after another. is_max: the maximum (NaN wins, as vec::maximum), else the sum. */
static float reduce_lanes(const float *x, int64_t n, int lanes, int is_max) {
#define REDUCE(a, b) (is_max ? (((a) > (b) || (a) != (a)) ? (a) : (b)) : (a) + (b))
    float acc[16];
    if (n < lanes) {
        float a = x[0];
        for (int64_t i = 1; i < n; i++) a = REDUCE(a, x[i]);
        return a;
    }
    for (int l = 0; l < lanes; l++) acc[l] = x[l];
    int64_t d = lanes;
    for (; d + lanes <= n; d += lanes)
        for (int l = 0; l < lanes; l++) acc[l] = REDUCE(acc[l], x[d + l]);
    for (int l = 0; d + l < n; l++) acc[l] = REDUCE(acc[l], x[d + l]);
    for (int s = lanes / 2; s > 0; s /= 2)
        for (int l = 0; l < s; l++) acc[l] = REDUCE(acc[l], acc[l + s]);
    return acc[0];
#undef REDUCE
}

/* torch.softmax of n float32 values on the CPU (ATen's _vec_softmax_lastdim): exp(x - max) by vector_expf,
 * each times 1 / their sum. */
static void torch_softmax(const float *x, int64_t n, int lanes, float *y) {
    const float mx = reduce_lanes(x, n, lanes, 1);
    for (int64_t i = 0; i < n; i++) y[i] = vector_expf(x[i] - mx);
    const float r = 1.0f / reduce_lanes(y, n, lanes, 0);
    for (int64_t i = 0; i < n; i++) y[i] = y[i] * r;
}

/* ids[0..k) of the k largest of x[0..n) in descending order (the lower index first among equals), their values
 * in top. Returns 1 where two of the k + 1 largest are equal or one is NaN: which of them torch.topk takes first
 * is up to its std::nth_element, which this does not reproduce; 0 otherwise. */
static int top_k(const float *x, int64_t n, int64_t k, float *top, int64_t *ids) {
    uint8_t taken[1024] = {0};
    for (int64_t j = 0; j <= k && j < n; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++)
            if (!taken[i] && (best < 0 || x[i] > x[best] || x[i] != x[i])) best = i;
        if (x[best] != x[best] || (j > 0 && x[best] == top[j - 1])) return 1;
        if (j == k) break;          /* the first one left out: only compared */
        taken[best] = 1;
        ids[j] = best;
        top[j] = x[best];
    }
    return 0;
}

/* A token's routing from its router logits [n] (n <= 1024, k <= 64), as kernels/moe.py's torch_route computes
 * it with torch's kernels of `lanes` float lanes: kind 0 softmax, top k, the k divided by their sum (Qwen);
 * kind 1 the same without the division; kind 2 top k of the logits, softmax over them (gpt-oss). Returns 1 where
 * top_k finds ties (w and ids are then not torch's), else 0. */
static int route_token(int kind, int lanes, const float *logits, int64_t n, int64_t k, float *w, int64_t *ids) {
    float buf[1024];
    if (kind == 2) {
        if (top_k(logits, n, k, buf, ids)) return 1;
        torch_softmax(buf, k, lanes, w);
        return 0;
    }
    torch_softmax(logits, n, lanes, buf);
    if (top_k(buf, n, k, w, ids)) return 1;
    if (kind == 0) {
        float sum = w[0];       /* torch.sum of a few values: one after another */
        for (int64_t j = 1; j < k; j++) sum += w[j];
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / sum;
    }
    return 0;
}

/* route_token for each of `rows` rows of logits [rows, n] into w, ids [rows, k]: exported so that the caller can
 * compare it with torch's own routing on this host. Returns -1 for sizes out of range, 1 where a row's scores tie
 * (route_token), else 0. */
int raymoe_route(int kind, int lanes, const float *logits, int64_t rows, int64_t n, int64_t k, float *w,
                 int64_t *ids) {
    if (n < 1 || n > 1024 || k < 1 || k > 64 || k > n || (lanes != 8 && lanes != 16)) return -1;
    int ties = 0;
    for (int64_t r = 0; r < rows; r++) ties |= route_token(kind, lanes, logits + r * n, n, k, w + r * k, ids + r * k);
    return ties;
}

typedef void (*rms_norm_fn)(const float *x, int64_t m, int64_t k, const float *w, float eps, float *y);
typedef void (*f32_rows_fn)(const float *x, int64_t ldx, const float *w, int64_t w_stride, const int64_t *groups,
                            int64_t count, int64_t n, int64_t k, float *y, int64_t ldy);
typedef int (*dn_decode_fn)(int64_t n, const int64_t *rows, const float *qkv, const float *z, const float *beta,
                            const float *alpha, int64_t ld, const float *taps, int64_t K, float *conv_states,
                            float *states, const float *a, const float *dt_bias, const float *norm, float eps,
                            int64_t nk, int64_t nv, int64_t dk, int64_t dv, float *out, int64_t ld_out);

/* A weight of a decode step's products: float32 rows [n, k] (few_rows.c's raymoe_f32_grouped) or GGML blocks. */
typedef struct {
    int blocks, type, quantize;     /* blocks: GGML blocks of `type` (raymoe_blocks_grouped), else float32 */
    const void *w;
    int64_t n, stride;              /* rows; bytes from one row to the next (blocks) */
} row_weight;

/* The most rows (sequences) a layer call takes: the few-row kernels compute each of that many rows by itself
 * (kernels/weights.py's rows_computed_alone). A feed-forward takes at most 64 slots (rows times its k). */
#define TOKEN_ROWS 8

/* y [rows, width] = x [rows, k] times the weights' rows, each weight into the columns after the one before: the
 * calls that a decode step's products of these rows make (the same arguments, so the same bits). Returns 0, or
 * -1 when out of memory. */
static int row_products(f32_rows_fn f32_rows, const row_weight *weights, int64_t count, const float *x,
                        int64_t rows, int64_t k, float *y, int64_t width) {
    const int64_t all_rows[3] = {0, 0, rows};
    int64_t column = 0;
    for (int64_t i = 0; i < count; i++) {
        const row_weight *p = &weights[i];
        if (!p->blocks)
            f32_rows(x, k, (const float *)p->w, 0, all_rows, 1, p->n, k, y + column, width);
        else if (raymoe_blocks_grouped(p->type, p->quantize, x, rows, k, (const uint8_t *)p->w, p->stride, NULL, 0,
                                       p->n, all_rows, 1, p->n, k, y + column, width))
            return -1;
        column += p->n;
    }
    return 0;
}

/* out [rows, h] = x + part [rows, h] */
static void residual(const float *x, const float *part, int64_t rows, int64_t h, float *out) {
    for (int64_t i = 0; i < rows * h; i++) out[i] = x[i] + part[i];
}

/* A layer's feed-forward for a decode step's tokens: the post-attention RMSNorm, the router's product (its
 * columns: the logits, then with a shared expert its gate and its gate/up), the routing, the experts. The
 * functions of the other libraries come as pointers: the same calls as the separate ops make. */
typedef struct {
    rms_norm_fn rms_norm;
    f32_rows_fn f32_rows;
    const float *norm;
    float eps, alpha, limit;
    int route, lanes, act, exp_kind;
    int64_t h, parts, width, experts, k, ff, sff;
    row_weight part[4];             /* the router's product */
    const float *bias;              /* the router's bias [width], or NULL */
    moe_weight gate_up, down, shared;
} token_ffn;

/* The floats of raymoe_token_ffn's scratch for `rows` tokens. */
int64_t raymoe_token_ffn_scratch(const token_ffn *f, int64_t rows) {
    const int64_t slots = rows * f->k, h = f->h;
    return 2 * slots + slots + rows * (h + f->width) + slots * (h + 3 * f->ff + 2 * h) + rows * (f->sff + 2 * h) +
           f->k * (3 * f->ff + h) + f->sff + h;
}

/* The MoE of `rows` tokens after their router, as the separate ops compute it (kernels/moe.py): the slots
 * (token t's j-th expert: slot t k + j) sorted stably by expert, so that an expert's rows share one pass over
 * its weights; the gate/up products, the activation, the down products; the shared expert's activation of its
 * gate/up (the router's columns after the gate) and down product; raymoe_moe_combine. Each row of these
 * products is computed by itself (rows <= TOKEN_ROWS): the bits of one token alone. */
static int moe_rows(const token_ffn *f, int64_t rows, const float *xn, const float *y, const int64_t *ids,
                    const float *w, float *scratch, float *out) {
    const int64_t h = f->h, k = f->k, ff = f->ff, sff = f->sff, slots = rows * k;
    int64_t order[64], groups[3 * 64], count = 0;      /* slots <= 64: raymoe_token_ffn checks */
    float *tokens = scratch, *hidden = tokens + slots * h, *activated = hidden + slots * 2 * ff,
          *sorted = activated + slots * ff, *slot_rows = sorted + slots * h, *shared_act = slot_rows + slots * h,
          *shared = shared_act + rows * sff;
    for (int64_t s = 0; s < slots; s++) {           /* insertion sort: stable */
        int64_t i = s;
        for (; i > 0 && ids[order[i - 1]] > ids[s]; i--) order[i] = order[i - 1];
        order[i] = s;
    }
    for (int64_t i = 0; i < slots; i++) {
        if (i == 0 || ids[order[i]] != ids[order[i - 1]]) {
            groups[3 * count] = ids[order[i]];
            groups[3 * count + 1] = i;
            count++;
        }
        groups[3 * count - 1] = i + 1;
        memcpy(tokens + i * h, xn + order[i] / k * h, sizeof(float) * (size_t)h);
    }
    if (expert_groups(&f->gate_up, tokens, h, slots, groups, count, 2 * ff, h, hidden)) return -1;
    raymoe_moe_activation(f->act, f->exp_kind, f->alpha, f->limit, hidden, slots, ff, activated);
    if (expert_groups(&f->down, activated, ff, slots, groups, count, h, ff, sorted)) return -1;
    for (int64_t i = 0; i < slots; i++)
        memcpy(slot_rows + order[i] * h, sorted + i * h, sizeof(float) * (size_t)h);
    if (sff) {
        const int64_t all_rows[3] = {0, 0, rows};
        for (int64_t t = 0; t < rows; t++)
            raymoe_moe_activation(f->act, f->exp_kind, f->alpha, f->limit, y + t * f->width + f->experts + 1, 1, sff,
                                  shared_act + t * sff);
        if (expert_groups(&f->shared, shared_act, sff, rows, all_rows, 1, h, sff, shared)) return -1;
    }
    raymoe_moe_combine(rows, k, h, slot_rows, w, sff ? y + f->experts : NULL, f->width, shared, out);
    return 0;
}

/* out [rows, h] = x + the feed-forward of x [rows, h] (a decode step's tokens, rows 1 to TOKEN_ROWS, rows k <=
 * 64): Block.decode's `h + ffn(rms_norm(h))` in one call, with the bits of the separate calls. One token takes
 * raymoe_moe_token, as the separate ops do. scratch: raymoe_token_ffn_scratch floats. Returns 0; 1 where a
 * token's router scores tie (route_token), out untouched; -1 when out of memory (or rows is out of range). */
int raymoe_token_ffn(const token_ffn *f, int64_t rows, const float *x, float *scratch, float *out) {
    const int64_t h = f->h, k = f->k, slots = rows * k;
    if (rows < 1 || rows > TOKEN_ROWS || slots > 64) return -1;
    int64_t *ids = (int64_t *)scratch;
    float *w = scratch + 2 * slots, *xn = w + slots, *y = xn + rows * h, *moe = y + rows * f->width,
          *moe_scratch = moe + rows * h;
    f->rms_norm(x, rows, h, f->norm, f->eps, xn);
    if (row_products(f->f32_rows, f->part, f->parts, xn, rows, h, y, f->width)) return -1;
    for (int64_t t = 0; f->bias && t < rows; t++)
        for (int64_t i = 0; i < f->width; i++) y[t * f->width + i] += f->bias[i];
    for (int64_t t = 0; t < rows; t++)
        if (route_token(f->route, f->lanes, y + t * f->width, f->experts, k, w + t * k, ids + t * k))
            return 1;       /* tied scores: the caller routes these tokens with torch (nothing written to out) */
    if (rows > 1) {
        if (moe_rows(f, rows, xn, y, ids, w, moe_scratch, moe)) return -1;
    } else if (raymoe_moe_token(xn, h, k, ids, w, &f->gate_up, f->ff, &f->down, f->act, f->exp_kind, f->alpha,
                                f->limit, f->sff ? y + f->experts + 1 : NULL, f->sff, f->sff ? &f->shared : NULL,
                                f->sff ? y + f->experts : NULL, moe_scratch, moe)) {
        return -1;
    }
    residual(x, moe, rows, h, out);
    return 0;
}

/* A Gated DeltaNet layer's mixer for a decode step's tokens: the input RMSNorm, the input projections ([qkv | z |
 * beta | alpha] columns), deltanet.c's raymoe_dn_decode (its pointer: that library's call), the out projection. */
typedef struct {
    rms_norm_fn rms_norm;
    f32_rows_fn f32_rows;
    dn_decode_fn dn_decode;
    const float *norm, *taps, *a, *dt_bias, *dn_norm;
    float eps, dn_eps;
    int64_t h, parts, width, K, nk, nv, dk, dv;
    row_weight part[4], out;        /* the input projections; the out projection [h, nv dv] */
} token_deltanet;

/* The floats of raymoe_token_deltanet's scratch for `rows` tokens. */
int64_t raymoe_token_deltanet_scratch(const token_deltanet *d, int64_t rows) {
    return rows * (2 * d->h + d->width + d->nv * d->dv);
}

/* out [rows, h] = x + the DeltaNet mixer of x [rows, h] (one token of each of rows sequences, 1 to TOKEN_ROWS),
 * their caches conv_states [rows, K-1, C] and states [rows, nv, dk, dv] updated in place: Block.decode's `x +
 * mixer(rms_norm(x))` in one call, with the bits of the separate calls. scratch: raymoe_token_deltanet_scratch
 * floats. Returns 0, or -1 when out of memory (or rows is out of range). */
int raymoe_token_deltanet(const token_deltanet *d, int64_t rows, const float *x, float *conv_states, float *states,
                          float *scratch, float *out) {
    const int64_t h = d->h, key_dim = d->nk * d->dk, values = d->nv * d->dv, conv_dim = 2 * key_dim + values;
    int64_t index[TOKEN_ROWS];
    if (rows < 1 || rows > TOKEN_ROWS) return -1;
    for (int64_t i = 0; i < rows; i++) index[i] = i;
    float *xn = scratch, *y = xn + rows * h, *o = y + rows * d->width, *mix = o + rows * values;
    d->rms_norm(x, rows, h, d->norm, d->eps, xn);
    if (row_products(d->f32_rows, d->part, d->parts, xn, rows, h, y, d->width)) return -1;
    if (d->dn_decode(rows, index, y, y + conv_dim, y + conv_dim + values, y + conv_dim + values + d->nv, d->width,
                     d->taps, d->K, conv_states, states, d->a, d->dt_bias, d->dn_norm, d->dn_eps, d->nk, d->nv, d->dk,
                     d->dv, o, values))
        return -1;
    if (row_products(d->f32_rows, &d->out, 1, o, rows, values, mix, h)) return -1;
    residual(x, mix, rows, h, out);
    return 0;
}

typedef void (*rope_fn)(const float *x, int64_t tokens, int64_t heads, int64_t k, const float *cos, const float *sin,
                        int64_t rd, float *y);
typedef int (*attention_fn)(const float *q, int64_t tq, int64_t hq, int64_t d, const float *k, const float *v,
                            int64_t tk, int64_t hkv, int64_t dv, const int64_t *q_pos, const int64_t *k_pos,
                            float scale, int64_t window, const float *sinks, float *out);

/* y[i] = x[i] * sigmoid(g[i]) for n values, sigmoid(g) = 1 / (1 + exp(-g)) with vector_expf: `x * torch.sigmoid(g)`
 * with torch's vector kernels (the caller checks that on this host with raymoe_gate_rows). */
static inline void gate_rows(const float *x, const float *g, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * (1.0f / (1.0f + vector_expf(-g[i])));
}

void raymoe_gate_rows(const float *x, const float *g, int64_t n, float *y) { gate_rows(x, g, n, y); }

/* An attention layer's mixer for a decode step's tokens: the input RMSNorm, the q/k/v product (with Qwen's output
 * gate each q head is followed by its gate head), per-head RMSNorm of q and k (Qwen), RoPE, each cache's new row,
 * attention.c's kernel (its pointer) for each sequence, the gate, the out product. */
typedef struct {
    rms_norm_fn rms_norm;
    f32_rows_fn f32_rows;
    rope_fn rope;
    attention_fn attention;
    const float *norm, *q_norm, *k_norm, *qkv_bias, *o_bias, *sinks;     /* the last five may be NULL */
    float eps, qk_eps, scale;
    int gate;
    int64_t h, heads, kv_heads, d, window, parts, width;
    row_weight part[4], out;        /* the q/k/v product; the out product [h, heads d] */
} token_attention;

/* The floats of raymoe_token_attention's scratch for `rows` tokens. */
int64_t raymoe_token_attention_scratch(const token_attention *a, int64_t rows) {
    return rows * (2 * a->h + a->width + 5 * a->heads * a->d + a->kv_heads * a->d);
}

/* out [rows, h] = x + the attention mixer of x [rows, h] (one token of each of rows sequences, 1 to TOKEN_ROWS,
 * token t at positions[t]): Block.decode's `x + mixer(rms_norm(x))` in one call, with the bits of the separate
 * calls. cos, sin [rows, rd]: the tokens' RoPE tables; keys[t], values[t] [lengths[t], kv_heads, d] and k_pos[t]
 * [lengths[t]]: sequence t's cache with the row its token writes (the last) reserved. scratch:
 * raymoe_token_attention_scratch floats. Returns 0, or -1 when out of memory (or rows is out of range). */
int raymoe_token_attention(const token_attention *a, int64_t rows, const float *x, const float *cos, const float *sin,
                           int64_t rd, const int64_t *positions, float *const *keys, float *const *values,
                           int64_t *const *k_pos, const int64_t *lengths, float *scratch, float *out) {
    const int64_t h = a->h, d = a->d, qd = a->heads * d, kvd = a->kv_heads * d, step = a->gate ? 2 * d : d;
    if (rows < 1 || rows > TOKEN_ROWS) return -1;
    float *xn = scratch, *y = xn + rows * h, *q = y + rows * a->width, *qn = q + rows * qd, *qr = qn + rows * qd,
          *o = qr + rows * qd, *g = o + rows * qd, *kn = g + rows * qd, *mix = kn + rows * kvd;
    a->rms_norm(x, rows, h, a->norm, a->eps, xn);
    if (row_products(a->f32_rows, a->part, a->parts, xn, rows, h, y, a->width)) return -1;
    for (int64_t t = 0; a->qkv_bias && t < rows; t++)
        for (int64_t i = 0; i < a->width; i++) y[t * a->width + i] += a->qkv_bias[i];
    for (int64_t t = 0; t < rows; t++) {
        const float *yt = y + t * a->width, *k = yt + a->heads * step, *v = k + kvd;
        float *qt = q + t * qd, *gt = g + t * qd;
        for (int64_t head = 0; head < a->heads; head++) {
            memcpy(qt + head * d, yt + head * step, sizeof(float) * (size_t)d);
            if (a->gate) memcpy(gt + head * d, yt + head * step + d, sizeof(float) * (size_t)d);
        }
        if (a->q_norm) {
            a->rms_norm(qt, a->heads, d, a->q_norm, a->qk_eps, qn + t * qd);
            a->rms_norm(k, a->kv_heads, d, a->k_norm, a->qk_eps, kn + t * kvd);
            qt = qn + t * qd;
            k = kn + t * kvd;
        }
        const int64_t last = lengths[t] - 1;
        a->rope(qt, 1, a->heads, d, cos + t * rd, sin + t * rd, rd, qr + t * qd);
        a->rope(k, 1, a->kv_heads, d, cos + t * rd, sin + t * rd, rd, keys[t] + last * kvd);
        memcpy(values[t] + last * kvd, v, sizeof(float) * (size_t)kvd);
        k_pos[t][last] = positions[t];
        if (a->attention(qr + t * qd, 1, a->heads, d, keys[t], values[t], lengths[t], a->kv_heads, d, positions + t,
                         k_pos[t], a->scale, a->window, a->sinks, o + t * qd))
            return -1;
    }
    if (a->gate) gate_rows(o, g, rows * qd, o);
    if (row_products(a->f32_rows, &a->out, 1, o, rows, qd, mix, h)) return -1;
    for (int64_t t = 0; a->o_bias && t < rows; t++)
        for (int64_t i = 0; i < h; i++) mix[t * h + i] += a->o_bias[i];
    residual(x, mix, rows, h, out);
    return 0;
}
