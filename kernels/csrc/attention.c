/* Grouped-query attention of a few query rows (decode) over a sequence's cached keys and values.
 *
 * out[i, h] = sum_j p_j v[j, h / group], p = softmax over the visible keys j (k_pos[j] <= q_pos[i]
 * and, with a window, k_pos[j] > q_pos[i] - window) of scale * q[i, h] . k[j, h / group], plus
 * one sink logit per head when sinks is given (it takes part in the softmax, then is dropped).
 *
 * One call replaces the dozen tensor operations a decode step's attention takes in torch. Each
 * (row, head) pair is computed by one thread, in a fixed order: results do not depend on the
 * thread count. Sums run in 16 lanes the compiler vectorises without reassociating anything.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 16

static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* q [tq, hq, d], k [tk, hkv, d], v [tk, hkv, dv], out [tq, hq, dv], all contiguous float32.
 * window <= 0: none. sinks: [hq] or NULL. Returns 0, or 1 when a buffer cannot be allocated. */
int raymoe_attention_rows(const float *q, int64_t tq, int64_t hq, int64_t d, const float *k, const float *v,
                          int64_t tk, int64_t hkv, int64_t dv, const int64_t *q_pos, const int64_t *k_pos,
                          float scale, int64_t window, const float *sinks, float *out) {
    const int64_t group = hq / hkv;
    int failed = 0;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * (size_t)(tk > 0 ? tk : 1));
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tq * hq; item++) {
            if (!p) continue;
            const int64_t i = item / hq, h = item % hq, kh = h / group;
            const float *qi = q + (i * hq + h) * d;
            float *o = out + (i * hq + h) * dv;
            float top = sinks ? sinks[h] : -INFINITY;
            for (int64_t j = 0; j < tk; j++) {
                const int visible = k_pos[j] <= q_pos[i] && (window <= 0 || k_pos[j] > q_pos[i] - window);
                p[j] = visible ? scale * dot(qi, k + (j * hkv + kh) * d, d) : -INFINITY;
                if (p[j] > top) top = p[j];
            }
            for (int64_t e = 0; e < dv; e++) o[e] = 0.0f;
            if (top == -INFINITY) continue;   /* nothing visible: zeros (torch would give NaN) */
            float total = sinks ? expf(sinks[h] - top) : 0.0f;
            for (int64_t j = 0; j < tk; j++) {
                if (p[j] == -INFINITY) continue;
                const float w = expf(p[j] - top);
                total += w;
                const float *vj = v + (j * hkv + kh) * dv;
                for (int64_t e = 0; e < dv; e++) o[e] += w * vj[e];
            }
            const float inv = 1.0f / total;
            for (int64_t e = 0; e < dv; e++) o[e] *= inv;
        }
        free(p);
    }
    return failed;
}
