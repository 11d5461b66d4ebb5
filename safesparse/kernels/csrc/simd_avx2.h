/* SIMD mapping for AVX2 + FMA (ggml style: one header per instruction set): the helpers, then
 * the macros kern.h is written in, for float32 and float64, each followed by its kern.h
 * instantiation. Included once by blockprod.c (x86-64 builds only), after simd_avx512.h. */
/* AVX2 + FMA helpers */
__attribute__((target("avx2,fma"))) static inline __m256i ss_mask32(int64_t k)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), idx);
}
__attribute__((target("avx2,fma"))) static inline __m256i ss_mask64(int64_t k)
{
    const __m256i idx = _mm256_setr_epi64x(0, 1, 2, 3);
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(k), idx);
}
__attribute__((target("avx2,fma"))) static inline float ss_hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
__attribute__((target("avx2,fma"))) static inline double ss_hsum256d(__m256d v)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}

/* lane k: the sum of v[k] (8 vectors) */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) __m256
ss_rowsums8(const __m256 *v)
{
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* AVX2 + FMA, float32 */
#define SUF avx2_f32
#define ROWSUMS(v) ss_rowsums8(v)
#define TARGET __attribute__((target("avx2,fma")))
#define R float
#define VT __m256
#define W 8
#define MT __m256i
#define MASK(k) ss_mask32(k)
#define LOADU(p) _mm256_loadu_ps(p)
#define LOADM(p, m) _mm256_maskload_ps((p), (m))
#define STOREU(p, v) _mm256_storeu_ps((p), (v))
#define STOREM(p, m, v) _mm256_maskstore_ps((p), (m), (v))
#define SET1(s) _mm256_set1_ps(s)
#define ZERO() _mm256_setzero_ps()
#define FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define ADD(a, b) _mm256_add_ps((a), (b))
#define HSUM(v) ss_hsum256(v)
#define RT_PROD 6
#define RT_OUT1 8
#define RT_OUT2 6
#define RT_DOT 2
#define CT_DOT 4
#define BM_NB 6
#define DT_SELF DT_F32
#include "kern.h"
#include "kern_dtype_end.h"

/* AVX2 + FMA, float64 */
#define SUF avx2_f64
#define R double
#define VT __m256d
#define W 4
#define MT __m256i
#define MASK(k) ss_mask64(k)
#define LOADU(p) _mm256_loadu_pd(p)
#define LOADM(p, m) _mm256_maskload_pd((p), (m))
#define STOREU(p, v) _mm256_storeu_pd((p), (v))
#define STOREM(p, m, v) _mm256_maskstore_pd((p), (m), (v))
#define SET1(s) _mm256_set1_pd(s)
#define ZERO() _mm256_setzero_pd()
#define FMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define ADD(a, b) _mm256_add_pd((a), (b))
#define HSUM(v) ss_hsum256d(v)
#define DT_SELF DT_F64
#include "kern.h"
#include "kern_dtype_end.h"
#include "kern_isa_end.h"
