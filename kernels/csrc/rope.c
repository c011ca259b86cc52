/* NeoX ("rotate half") rotary embedding of the first rd values of each head, float32:
 *
 *   y[i]        = x[i] cos[i]               - x[i + rd/2] sin[i]
 *   y[i + rd/2] = x[i + rd/2] cos[i + rd/2] + x[i] sin[i + rd/2]      (i < rd/2; the rest copied)
 *
 * each product rounded before the sum (built with -ffp-contract=off), as torch computes
 * `rot * cos + cat(-rot[half:], rot[:half]) * sin`: the same bits. One call replaces that expression's
 * dozen operations, each of which starts on caches a weight product has just flushed in a decode step.
 */
#include <stdint.h>

/* x and y [tokens, heads, k] contiguous, cos and sin [tokens, rd] contiguous. */
void raymoe_rope(const float *x, int64_t tokens, int64_t heads, int64_t k, const float *cos, const float *sin,
                 int64_t rd, float *y) {
    const int64_t half = rd / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * rd, *s = sin + t * rd;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + (t * heads + h) * k;
            float *yi = y + (t * heads + h) * k;
            for (int64_t i = 0; i < half; i++) {
                const float a = xi[i], b = xi[i + half];
                yi[i] = a * c[i] + -b * s[i];
                yi[i + half] = b * c[i + half] + a * s[i + half];
            }
            for (int64_t i = rd; i < k; i++) yi[i] = xi[i];
        }
    }
}
