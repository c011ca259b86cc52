/* The glue of a Gated DeltaNet layer on the CPU (kernels/deltanet.py is the torch reference):
 *
 *   raymoe_dn_conv     causal depthwise conv + SiLU over T tokens of n sequences, with their states
 *   raymoe_dn_decode   one token of each of n sequences, from the input projections to the input of
 *                      the out projection: conv (state updated), q/k L2 norm, gates, the delta rule
 *                      on each head's state in place, and the gated RMSNorm with z
 *   raymoe_dn_heads, raymoe_dn_gated_norm   a prefill's q/k L2 norm and output norm
 *   raymoe_dn_chunked  the chunked delta rule of a prefill, one thread per head; its products by
 *                      a single-threaded sgemm (numpy's OpenBLAS) the caller passes
 *
 * Plain C that the compiler vectorises for the machine's CPU (-march=native); sums over a vector
 * run in VL independent lanes (vectorisable without reassociation), as torch's vectorised sums
 * do. Every output is computed by one thread in a fixed order, so results do not depend on the
 * thread count. Arithmetic follows the torch code's operation order (no fused multiply-adds:
 * built with -ffp-contract=off), so outputs agree with it to float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__SSE__)
#include <xmmintrin.h>
/* Denormals flushed to zero (FTZ, DAZ) in the calling thread until restored: decays multiply
 * values down into the denormal range (strong decays over a chunk), where each operation costs
 * ~100x (measured: a prefill's chunked form 4-8x slower). Values under 1.2e-38 become 0. */
static inline unsigned flush_denormals(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040);
    return saved;
}
static inline void restore_denormals(unsigned saved) { _mm_setcsr(saved); }
#else
static inline unsigned flush_denormals(void) { return 0; }
static inline void restore_denormals(unsigned saved) { (void)saved; }
#endif

#define VL 16            /* lanes of the partial sums */
#define CONV_ROWS 8         /* tokens per parallel work item of the conv */
#define CONV_CHANNELS 1024  /* channels of a token computed at once (in L1 across the taps' passes) */

/* exp(x) within ~1 ulp (Cephes' expf polynomial) in operations the compiler vectorises: libm's
 * expf is a call per element (measured 40 ms for the silu of a [512, 8192] prefill conv). */
static inline float exp_vec(float in) {
    const float x = in < -87.0f ? -87.0f : (in > 88.0f ? 88.0f : in);   /* 0 below (torch: denormals) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round(x / ln 2) */
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;              /* x - n ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return in < -87.0f ? 0.0f : p * scale.f;
}

static inline float silu(float x) { return x / (1.0f + exp_vec(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }   /* torch's threshold */

/* sum of a[i] * b[i] in VL lanes, the lanes then added in order */
static float dot(const float *a, const float *b, int64_t n) {
    float lanes[VL] = {0};
    int64_t i = 0;
    for (; i + VL <= n; i += VL)
        for (int l = 0; l < VL; l++) lanes[l] += a[i + l] * b[i + l];
    for (; i < n; i++) lanes[i % VL] += a[i] * b[i];
    float s = 0.0f;
    for (int l = 0; l < VL; l++) s += lanes[l];
    return s;
}

/* x * rsqrt(|x|^2 + 1e-6) * scale, as _l2norm and then the q scale (1 for k) */
static void l2norm_scaled(const float *x, int64_t n, float scale, float *out) {
    const float r = 1.0f / sqrtf(dot(x, x, n) + 1e-6f);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) out[i] *= scale;
}

/* out = rms_norm(y) * w * silu(z) = y * rsqrt(mean(y^2) + eps) * w * silu(z); out may be y */
static void gated_norm(const float *y, const float *z, const float *w, float eps, int64_t n, float *out) {
    const float r = 1.0f / sqrtf(dot(y, y, n) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = y[j] * r * w[j] * silu(z[j]);
}

/* Rows [t0, t1) and channels [c0, c1) of one sequence's conv: x row t at x + t * ldx, state [K-1, C]
 * (the previous inputs, oldest first), taps wt [K, C]; into y (row stride ldy). */
static void conv_rows(const float *x, int64_t ldx, const float *state, int64_t C, const float *wt, int64_t K,
                      int64_t t0, int64_t t1, int64_t c0, int64_t c1, float *y, int64_t ldy) {
    const int64_t H = K - 1;
    for (int64_t t = t0; t < t1; t++) {
        float *yt = y + t * ldy;
        /* (windows * weight).sum(-1): products added oldest first; input t + j - H < 0 reads the state */
        for (int64_t j = 0; j < K; j++) {
            const int64_t s = t + j - H;
            const float *in = s < 0 ? state + (H + s) * C : x + s * ldx, *wj = wt + j * C;
            if (j == H)         /* the last tap, with the SiLU */
                for (int64_t c = c0; c < c1; c++) yt[c] = silu((j ? yt[c] : 0.0f) + in[c] * wj[c]);
            else if (j == 0)
                for (int64_t c = c0; c < c1; c++) yt[c] = in[c] * wj[c];
            else
                for (int64_t c = c0; c < c1; c++) yt[c] += in[c] * wj[c];
        }
    }
}

/* Channels [c0, c1) of the new state after T inputs: the last K-1 rows of state ++ x. Rows read
 * from the old state come first, in order, so new_state may be state itself. */
static void conv_state(const float *x, int64_t ldx, int64_t T, const float *state, int64_t C, int64_t K,
                       int64_t c0, int64_t c1, float *new_state) {
    const int64_t H = K - 1;
    for (int64_t r = 0; r < H; r++) {
        const int64_t s = T + r - H;
        const float *in = s < 0 ? state + (H + s) * C : x + s * ldx;
        for (int64_t c = c0; c < c1; c++) new_state[r * C + c] = in[c];
    }
}

/* n sequences of T tokens: x [n, T, C] (strides ldn, ldx), states [n, K-1, C] contiguous, taps
 * wt [K, C], y [n, T, C] contiguous, new_states [n, K-1, C] contiguous (may be states). Parallel
 * over blocks of whole rows (rows far apart in memory would defeat the prefetcher). */
void raymoe_dn_conv(int64_t n, int64_t T, int64_t C, const float *x, int64_t ldn, int64_t ldx, const float *wt,
                    int64_t K, const float *states, float *y, float *new_states) {
    const int64_t blocks = (T + CONV_ROWS - 1) / CONV_ROWS, H = K - 1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n * blocks; u++) {
            const int64_t i = u / blocks, t0 = u % blocks * CONV_ROWS;
            const int64_t t1 = t0 + CONV_ROWS < T ? t0 + CONV_ROWS : T;
            for (int64_t c0 = 0; c0 < C; c0 += CONV_CHANNELS)
                conv_rows(x + i * ldn, ldx, states + i * H * C, C, wt, K, t0, t1, c0,
                          c0 + CONV_CHANNELS < C ? c0 + CONV_CHANNELS : C, y + i * T * C, C);
        }
        /* after every read of the old states (the barrier above), as new_states may be states */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            conv_state(x + i * ldn, ldx, T, states + i * H * C, C, K, 0, C, new_states + i * H * C);
    }
}

/* One token of each of n sequences. Row rows[i] of qkv [*, C] / z [*, Hv*dv] / beta_in, alpha_in
 * [*, Hv] (all with row stride ld) holds sequence i's projections; conv taps conv_wt [K, C]; the
 * log decay is ssm_a * softplus(alpha + dt_bias) (ssm_a = -exp(A_log)); conv_states [n, K-1, C] and
 * states [n, Hv, dk, dv] (contiguous) hold their caches, updated in place. Writes row rows[i] of out
 * (row stride ld_out): rms_norm(y) * norm_w * silu(z) per V head, y the delta rule's output.
 * C = 2 * nk * dk + Hv * dv; V head h reads K head h % nk. Returns 0, or -1 when out of memory. */
int raymoe_dn_decode(int64_t n, const int64_t *rows, const float *qkv, const float *z, const float *beta_in,
                     const float *alpha_in, int64_t ld, const float *conv_wt, int64_t K, float *conv_states, float *states,
                     const float *ssm_a, const float *dt_bias, const float *norm_w,
                     float eps, int64_t nk, int64_t nv, int64_t dk, int64_t dv, float *out, int64_t ld_out) {
    const int64_t key_dim = nk * dk, C = 2 * key_dim + nv * dv, units = 2 * nk + nv;
    const float scale = (float)(1.0 / sqrt((double)dk));
    float *mixed = malloc(sizeof(float) * n * C);     /* the conv's output: q (scaled), k normalised, v */
    if (!mixed) return -1;
    int failed = 0;
#pragma omp parallel
    {
        const unsigned csr = flush_denormals();
        /* conv per head's channels; then q and k L2-normalised per K head (x * rsqrt(|x|^2 + 1e-6)) */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n * units; u++) {
            const int64_t i = u / units, h = u % units;
            const int64_t c0 = h < 2 * nk ? h * dk : 2 * key_dim + (h - 2 * nk) * dv;
            const int64_t c1 = c0 + (h < 2 * nk ? dk : dv);
            float *m = mixed + i * C;
            const float *x = qkv + rows[i] * ld;
            float *cs = conv_states + i * (K - 1) * C;
            conv_rows(x, ld, cs, C, conv_wt, K, 0, 1, c0, c1, m, C);
            conv_state(x, ld, 1, cs, C, K, c0, c1, cs);
            if (h < 2 * nk) l2norm_scaled(m + c0, dk, h < nk ? scale : 1.0f, m + c0);
        }
        /* the delta rule and the gated norm per (sequence, V head) */
        float *buf = malloc(sizeof(float) * 3 * dv);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n * nv; u++) {
            if (!buf) continue;
            const int64_t i = u / nv, h = u % nv, kh = h % nk, row = rows[i];
            const float *m = mixed + i * C;
            const float *q = m + kh * dk, *k = m + key_dim + kh * dk, *v = m + 2 * key_dim + h * dv;
            const float beta = sigmoid(beta_in[row * ld + h]);
            const float decay = expf(ssm_a[h] * softplus(alpha_in[row * ld + h] + dt_bias[h]));
            float *S = states + (i * nv + h) * dk * dv;
            float *kS = buf, *qS = buf + dv, *delta = buf + 2 * dv;
            /* both reads of the old state in one pass: k^T S and q^T S */
            for (int64_t j = 0; j < dv; j++) kS[j] = qS[j] = 0.0f;
            for (int64_t r = 0; r < dk; r++) {
                const float *Sr = S + r * dv, kr = k[r], qr = q[r];
                for (int64_t j = 0; j < dv; j++) {
                    kS[j] += kr * Sr[j];
                    qS[j] += qr * Sr[j];
                }
            }
            const float kq = dot(k, q, dk);
            float *y = out + row * ld_out + h * dv;
            for (int64_t j = 0; j < dv; j++) {
                delta[j] = (v[j] - decay * kS[j]) * beta;
                y[j] = decay * qS[j] + delta[j] * kq;
            }
            /* S <- decay * S + k delta^T, in place */
            for (int64_t r = 0; r < dk; r++) {
                float *Sr = S + r * dv;
                const float kr = k[r];
                for (int64_t j = 0; j < dv; j++) Sr[j] = Sr[j] * decay + kr * delta[j];
            }
            gated_norm(y, z + row * ld + h * dv, norm_w, eps, dv, y);
        }
        free(buf);
        restore_denormals(csr);
    }
    free(mixed);
    return failed ? -1 : 0;
}

/* ---- the glue of a prefill ----------------------------------------------------------------- */

/* T tokens' conv outputs mixed [T, 2 * nk * dk + ...] (rows ld apart) -> q, k [T, nv, dk]: each K
 * head L2-normalised (q not scaled: the delta rule scales it) and repeated for its V heads
 * (V head h reads K head h % nk). */
void raymoe_dn_heads(int64_t T, const float *mixed, int64_t ld, int64_t nk, int64_t nv, int64_t dk, float *q,
                     float *k) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nk; h++) {
            float *qt = q + (t * nv + h) * dk, *kt = k + (t * nv + h) * dk;
            l2norm_scaled(mixed + t * ld + h * dk, dk, 1.0f, qt);
            l2norm_scaled(mixed + t * ld + (nk + h) * dk, dk, 1.0f, kt);
            for (int64_t r = h + nk; r < nv; r += nk)
                for (int64_t j = 0; j < dk; j++) {
                    qt[(r - h) * dk + j] = qt[j];
                    kt[(r - h) * dk + j] = kt[j];
                }
        }
}

/* out [T, nv * dv] = rms_norm(y) * w * silu(z) per head; y [T, nv * dv] contiguous, z rows ldz apart */
void raymoe_dn_gated_norm(int64_t T, int64_t nv, int64_t dv, const float *y, const float *z, int64_t ldz,
                          const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nv; h++)
            gated_norm(y + (t * nv + h) * dv, z + t * ldz + h * dv, w, eps, dv, out + (t * nv + h) * dv);
}

/* ---- the chunked delta rule (prefill) ------------------------------------------------------ */

typedef void (*cblas_sgemm_fn)(int order, int transa, int transb, int64_t m, int64_t n, int64_t k, float alpha,
                               const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                               int64_t ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Chunks of up to `chunk` tokens of one head, as kernels/deltanet.py's delta_rule_chunked computes
 * them for all heads at once (there: the formulas), here with one thread per head, so the
 * elementwise work stays in cache and threads meet once per call rather than once per operation.
 * q/k [T, *] rows ldq/ldk apart (this head's dk values at the row's start), v rows ldv apart,
 * g/beta rows ldg apart; S [dk, dv] updated in place; out rows ldo apart. */
static void chunked_head(cblas_sgemm_fn gemm, int64_t T, int64_t dk, int64_t dv, int64_t chunk, const float *q,
                         int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv, const float *g,
                         const float *bt, int64_t ldg, float *S, float *out, int64_t ldo, float *ws) {
    const float scale = (float)(1.0 / sqrt((double)dk));
    const int64_t L2 = chunk * chunk;
    float *kk = ws, *qk = kk + L2, *decay = qk + L2, *inv = decay + L2, *ab = inv + L2, *cum = ab + L2,
          *fac = cum + chunk, *u = fac + chunk, *w = u + chunk * dv, *qd = w + chunk * dk, *kd = qd + chunk * dk;
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t L = T - t0 < chunk ? T - t0 : chunk;
        const float *Q = q + t0 * ldq, *K = k + t0 * ldk, *V = v + t0 * ldv, *G = g + t0 * ldg,
                    *B = bt + t0 * ldg;
        double acc = 0.0;                                /* torch's cumsum adds float32 in double */
        for (int64_t i = 0; i < L; i++) cum[i] = (float)(acc += G[i * ldg]);
        gemm(ROW_MAJOR, NO_TRANS, TRANS, L, L, dk, 1.0f, K, ldk, K, ldk, 0.0f, kk, L);
        gemm(ROW_MAJOR, NO_TRANS, TRANS, L, L, dk, 1.0f, Q, ldq, K, ldk, 0.0f, qk, L);
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) {
                const float d = j <= i ? exp_vec(cum[i] - cum[j]) : 0.0f;
                decay[i * L + j] = d;
                qk[i * L + j] *= d * scale;              /* intra-chunk attention */
                kk[i * L + j] = j < i ? kk[i * L + j] * d * B[i * ldg] : 0.0f;
            }
        /* inv = (I + strictly_lower(kk))^-1, row by row (forward substitution) */
        for (int64_t i = 0; i < L; i++) {
            float *r = inv + i * L;
            for (int64_t j = 0; j < L; j++) r[j] = j == i ? 1.0f : 0.0f;
            for (int64_t m = 0; m < i; m++) {
                const float f = -kk[i * L + m];
                const float *rm = inv + m * L;
                for (int64_t j = 0; j <= m; j++) r[j] += f * rm[j];
            }
        }
        /* u = inv diag(beta) v,  w = inv diag(beta exp(cum)) k */
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) ab[i * L + j] = inv[i * L + j] * B[j * ldg];
        gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, L, dv, L, 1.0f, ab, L, V, ldv, 0.0f, u, dv);
        for (int64_t j = 0; j < L; j++) fac[j] = B[j * ldg] * exp_vec(cum[j]);
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) ab[i * L + j] = inv[i * L + j] * fac[j];
        gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, L, dk, L, 1.0f, ab, L, K, ldk, 0.0f, w, dk);
        /* q scaled by exp(cum) / sqrt(dk), k by the decay to the chunk's end */
        for (int64_t i = 0; i < L; i++) {
            const float fq = exp_vec(cum[i]) * scale, fk = exp_vec(cum[L - 1] - cum[i]);
            for (int64_t j = 0; j < dk; j++) {
                qd[i * dk + j] = Q[i * ldq + j] * fq;
                kd[i * dk + j] = K[i * ldk + j] * fk;
            }
        }
        /* v_new = u - w S (into u); out = q_dec S + intra v_new; S = exp(cum_last) S + k_dec^T v_new */
        gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, L, dv, dk, -1.0f, w, dk, S, dv, 1.0f, u, dv);
        float *O = out + t0 * ldo;
        gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, L, dv, dk, 1.0f, qd, dk, S, dv, 0.0f, O, ldo);
        gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, L, dv, L, 1.0f, qk, L, u, dv, 1.0f, O, ldo);
        gemm(ROW_MAJOR, TRANS, NO_TRANS, dk, dv, L, 1.0f, kd, dk, u, dv, exp_vec(cum[L - 1]), S, dv);
    }
}

/* The chunked delta rule over T tokens of H heads: q/k [T, H, dk] and v [T, H, dv] (rows ldq, ldk,
 * ldv apart, heads contiguous), g/beta [T, H] (rows ldg apart), states [H, dk, dv] updated in
 * place, out [T, H, dv] contiguous. q is scaled by 1/sqrt(dk) here. sgemm: a 64-bit-integer
 * cblas_sgemm on one thread. Returns 0, or -1 when out of memory. */
int raymoe_dn_chunked(void *sgemm, int64_t T, int64_t H, int64_t dk, int64_t dv, int64_t chunk, const float *q,
                      int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv, const float *g,
                      const float *beta, int64_t ldg, float *states, float *out) {
    const cblas_sgemm_fn gemm = (cblas_sgemm_fn)sgemm;
    const int64_t ws_floats = 5 * chunk * chunk + 2 * chunk + chunk * dv + 3 * chunk * dk;
    int failed = 0;
#pragma omp parallel
    {
        const unsigned csr = flush_denormals();
        float *ws = malloc(sizeof(float) * ws_floats);
        if (!ws) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < H; h++)
            if (ws)
                chunked_head(gemm, T, dk, dv, chunk, q + h * dk, ldq, k + h * dk, ldk, v + h * dv, ldv, g + h,
                             beta + h, ldg, states + h * dk * dv, out + h * dv, H * dv, ws);
        free(ws);
        restore_denormals(csr);
    }
    return failed ? -1 : 0;
}
