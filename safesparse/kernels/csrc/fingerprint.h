/* A 64-bit fingerprint of a buffer (ss_fingerprint), included once by blockprod.c.
 *
 * What it is for: the eager plans of safesparse.nn keep copies of a layer's values (blocks
 * transposed, or converted to another dtype) and read them in place of the values. A write to
 * the values that moves no version counter (through `.data`, NumPy, another process) must not
 * leave a stale copy that is read: the plan compares the values' fingerprint, at each call that
 * reads a copy, with the one taken when the copy was made.
 *
 * Every 32-bit word is mixed (xor-shifts and a multiply by an odd constant: a bijection, so a
 * change in any bit of a word changes the mixed word) before two sums per lane, 16 lanes
 * (s1 += m, s2 += s1: the second weighs each word by its position). One word changed always
 * changes s1; several words changed leave all 32 sums unchanged only by a coincidence of their
 * mixed differences, about one chance in 2^64 for changes unrelated to the mixing. The words
 * are read at the caches' rate (vectorized for AVX-512 and AVX2 by function multi-versioning;
 * one pass, no allocation). */

#include <stdint.h>
#include <string.h>

#define FP_LANES 16

typedef uint32_t fp_vec __attribute__((vector_size(4 * FP_LANES))); /* GCC / clang vectors */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void fp_sums(const unsigned char *p, int64_t words, uint32_t *s1, uint32_t *s2)
{
    /* four streams (vectors i, i + 1, i + 2, i + 3 of each step), summed apart: four
     * independent chains of adds */
    fp_vec a[4] = {{0}}, b[4] = {{0}};
    int64_t i = 0;
    for (; i + 4 * FP_LANES <= words; i += 4 * FP_LANES) {
        for (int k = 0; k < 4; k++) {
            fp_vec x;
            memcpy(&x, p + 4 * (i + k * FP_LANES), sizeof x); /* (2-byte aligned values: no cast) */
            x ^= x >> 15;
            x *= 0x2c1b3c6dU;
            x ^= x >> 12;
            a[k] += x;
            b[k] += a[k];
        }
    }
    for (int k = 0; i + FP_LANES <= words; i += FP_LANES, k++) { /* the last one to three */
        fp_vec x;
        memcpy(&x, p + 4 * i, sizeof x);
        x ^= x >> 15;
        x *= 0x2c1b3c6dU;
        x ^= x >> 12;
        a[k] += x;
        b[k] += a[k];
    }
    for (int k = 1; k < 4; k++) { /* (the streams mixed apart: a word moved between streams
                                   * changes the sums) */
        a[0] = a[0] * 0x9e3779b1U + a[k];
        b[0] = b[0] * 0x85ebca77U + b[k];
    }
    memcpy(s1, &a[0], sizeof a[0]);
    memcpy(s2, &b[0], sizeof b[0]);
}

static uint64_t fp_mix(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

uint64_t ss_fingerprint(const void *data, int64_t nbytes)
{
    const unsigned char *p = (const unsigned char *)data;
    if (!p || nbytes <= 0) return fp_mix((uint64_t)(nbytes > 0 ? nbytes : 0));
    int64_t words = nbytes / 4 / FP_LANES * FP_LANES;
    uint32_t s1[FP_LANES], s2[FP_LANES];
    fp_sums(p, words, s1, s2);
    uint64_t h = fp_mix((uint64_t)nbytes);
    for (int l = 0; l < FP_LANES; l++)
        h = fp_mix(h ^ (((uint64_t)s2[l] << 32) | s1[l]));
    for (int64_t i = words * 4; i < nbytes; i++) /* the tail: under 64 bytes */
        h = fp_mix(h ^ ((uint64_t)p[i] << 8) ^ (uint64_t)i);
    return h;
}
