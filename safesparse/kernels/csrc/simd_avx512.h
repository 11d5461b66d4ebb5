/* SIMD mapping for AVX-512F (ggml style: one header per instruction set): the helpers, then
 * the macros kern.h is written in, for float32 and float64, each followed by its kern.h
 * instantiation. Included once by blockprod.c (x86-64 builds only), after the contexts. */
/* float32 lanes stored as bfloat16 / float16 (round to nearest even, NaN kept), cnt <= 16 */
__attribute__((target("avx512f"))) static inline int ss_store_half16(void *y, int dt, int64_t i,
                                                                    __m512 v, int64_t cnt)
{
    __m256i h;
    if (dt == DT_BF16) {
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
    } else if (dt == DT_F16) {
        h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        return 0;
    }
    uint16_t *dst = (uint16_t *)y + i;
    if (cnt >= 16) _mm256_storeu_si256((__m256i *)dst, h);
    else {
        uint16_t tmp[16];
        _mm256_storeu_si256((__m256i *)tmp, h);
        memcpy(dst, tmp, (size_t)cnt * 2);
    }
    return 1;
}

/* lane k: the sum of v[k] (16 vectors: a transpose-reduction, 15 adds and 31 shuffles, where
 * 16 horizontal sums take ~4x the instructions) */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m512
ss_rowsums16(const __m512 *v)
{
    __m512 s[8], u[4], w[2];
    for (int t = 0; t < 8; t++) /* 256-bit halves: chunks 0-1 v[2t], 2-3 v[2t+1] */
        s[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0xEE));
    for (int t = 0; t < 4; t++) /* chunk j: v[4t + j] */
        u[t] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * t], s[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * t], s[2 * t + 1], 0xDD));
    for (int t = 0; t < 2; t++) /* chunk j: v[8t + j] x2, v[8t + 4 + j] x2 */
        w[t] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0xEE));
    /* lane 4j + t: v[j + 4t] */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                             _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, z);
}

/* dst[k * ldd + a] = src[a * lds + k] for a, k < 16: a 16 x 16 float32 transpose in registers
 * (16 loads, 64 shuffles, 16 stores where a scalar copy takes 256 loads and stores) */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
ss_transpose16(const float *src, int64_t lds, float *dst, int64_t ldd)
{
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i++) { /* pairs of rows interleaved */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* 4 x 4 transposes within each 128-bit lane */
        r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 2; i++) /* then the 128-bit lanes */
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    }
    for (int k = 0; k < 16; k++) _mm512_storeu_ps(dst + k * ldd, r[k]);
}

/* AVX-512F, float32 */
#define SUF avx512_f32
#define ROWSUMS(v) ss_rowsums16(v)
#define TRANSPOSE_W(src, lds, dst, ldd) ss_transpose16((src), (lds), (dst), (ldd))
#define STORE_HALF(y, dt, i, v, cnt) ss_store_half16((y), (dt), (i), (v), (cnt))
#define TARGET __attribute__((target("avx512f,fma")))
#define R float
#define VT __m512
#define W 16
#define MT __mmask16
#define MASK(k) ((__mmask16)((1u << (k)) - 1u))
#define LOADU(p) _mm512_loadu_ps(p)
#define LOADM(p, m) _mm512_maskz_loadu_ps((m), (p))
#define STOREU(p, v) _mm512_storeu_ps((p), (v))
#define STOREM(p, m, v) _mm512_mask_storeu_ps((p), (m), (v))
#define SET1(s) _mm512_set1_ps(s)
#define ZERO() _mm512_setzero_ps()
#define FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define ADD(a, b) _mm512_add_ps((a), (b))
#define HSUM(v) _mm512_reduce_add_ps(v)
#define RT_PROD 8
#define RT_OUT1 16
#define RT_OUT2 8
#define RT_DOT 4
#define CT_DOT 4
#define BM_NB 8
#define DT_SELF DT_F32
#include "kern.h"
#undef STORE_HALF
#include "kern_dtype_end.h"

/* AVX-512F, float64 */
#define SUF avx512_f64
#define R double
#define VT __m512d
#define W 8
#define MT __mmask8
#define MASK(k) ((__mmask8)((1u << (k)) - 1u))
#define LOADU(p) _mm512_loadu_pd(p)
#define LOADM(p, m) _mm512_maskz_loadu_pd((m), (p))
#define STOREU(p, v) _mm512_storeu_pd((p), (v))
#define STOREM(p, m, v) _mm512_mask_storeu_pd((p), (m), (v))
#define SET1(s) _mm512_set1_pd(s)
#define ZERO() _mm512_setzero_pd()
#define FMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define ADD(a, b) _mm512_add_pd((a), (b))
#define HSUM(v) _mm512_reduce_add_pd(v)
#define DT_SELF DT_F64
#include "kern.h"
#include "kern_dtype_end.h"
#include "kern_isa_end.h"
