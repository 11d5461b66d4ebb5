/* safesparse native block kernels: the three products of a compressed sparse matrix (CSR, CSC,
 * BSR, BSC, any block shape) with a dense operand, on CPU.
 *
 * Plain C, no torch headers: called through ctypes with data pointers, sizes and strides (in
 * elements), so one build serves every torch version. The micro-kernels are compiled once per
 * instruction set (AVX-512F, AVX2+FMA) with target attributes and chosen at run time from what
 * the CPU has; where none fits, ss_isa() says 0 and the caller uses its torch-op kernels.
 *
 * Threads: one parallel region per product, on the OpenMP runtime torch already loaded (its
 * GOMP_parallel and omp_get_thread_num are handed in by ss_set_runtime; this library links
 * against no runtime, so the process holds exactly one). Work is taken from a shared counter, so
 * a descheduled thread delays the region by one task at most.
 *
 * Trust: the caller (safesparse's operators) hands in index data that safesparse validated;
 * nothing here checks it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define SS_X86 1
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_F64 = 1, DT_F16 = 2, DT_BF16 = 3 };

/* ------------------------------------------------------------------------------------------ */
/* dtype conversions (scalar, portable; round to nearest even as torch does) */

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            mant &= 0x3ffu;
            u = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow (rounds to inf) */
    if (au < 0x38800000u) { /* subnormal or zero in half */
        if (au < 0x33000000u) return (uint16_t)sign;
        uint32_t e = au >> 23, m = (au & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14 .. 24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = au + 0xfffu + ((au >> 13) & 1u);
    r -= (uint32_t)(127 - 15) << 23;
    return (uint16_t)(sign | (r >> 13));
}

static inline double get_el(const void *p, int dt, int64_t i)
{
    switch (dt) {
    case DT_F32: return ((const float *)p)[i];
    case DT_F64: return ((const double *)p)[i];
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static inline void put_el(void *p, int dt, int64_t i, double v)
{
    switch (dt) {
    case DT_F32: ((float *)p)[i] = (float)v; break;
    case DT_F64: ((double *)p)[i] = v; break;
    case DT_F16: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
    default: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    }
}

/* p[i + t] = v[t] for t < cnt, converted to dt */
static inline void put_row_f(void *p, int dt, int64_t i, const float *v, int64_t cnt)
{
    for (int64_t t = 0; t < cnt; t++) put_el(p, dt, i + t, v[t]);
}
static inline void put_row_d(void *p, int dt, int64_t i, const double *v, int64_t cnt)
{
    for (int64_t t = 0; t < cnt; t++) put_el(p, dt, i + t, v[t]);
}
#define put_row(p, dt, i, v, cnt) _Generic((v), float *: put_row_f, double *: put_row_d)(p, dt, i, v, cnt)

/* buf[k * ld + n] = X[k, n0 + n] (k < n_in, n < nt) in the compute type `cdt` */
static void fill_tile(void *buf, int64_t ld, const void *x, int xdt, int64_t xk, int64_t xn,
                      int64_t n_in, int64_t n0, int64_t nt, int cdt)
{
    if (cdt == DT_F32) {
        float *b = (float *)buf;
        if (xdt == DT_F32) {
            const float *s = (const float *)x;
            for (int64_t n = 0; n < nt; n++) {
                const float *sn = s + (n0 + n) * xn;
                for (int64_t k = 0; k < n_in; k++) b[k * ld + n] = sn[k * xk];
            }
        } else if (xdt == DT_BF16) {
            const uint16_t *s = (const uint16_t *)x;
            for (int64_t n = 0; n < nt; n++) {
                const uint16_t *sn = s + (n0 + n) * xn;
                for (int64_t k = 0; k < n_in; k++) b[k * ld + n] = bf16_to_f32(sn[k * xk]);
            }
        } else {
            for (int64_t n = 0; n < nt; n++)
                for (int64_t k = 0; k < n_in; k++)
                    b[k * ld + n] = (float)get_el(x, xdt, (n0 + n) * xn + k * xk);
        }
    } else {
        double *b = (double *)buf;
        for (int64_t n = 0; n < nt; n++)
            for (int64_t k = 0; k < n_in; k++)
                b[k * ld + n] = get_el(x, xdt, (n0 + n) * xn + k * xk);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* the parallel region */

typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_thread_num_t)(void);
static gomp_parallel_t g_parallel = 0;
static omp_thread_num_t g_thread_num = 0;

int ss_set_runtime(void *parallel, void *thread_num)
{
    g_parallel = (gomp_parallel_t)parallel;
    g_thread_num = (omp_thread_num_t)thread_num;
    return g_parallel != 0 && g_thread_num != 0;
}

typedef void (*task_fn)(void *ctx, int64_t task, int tid);

typedef struct {
    task_fn fn;
    void *ctx;
    int64_t ntasks, grain;
    int64_t next; /* shared counter */
    int serial;
    int64_t start_ns, helper_ns; /* region start; first helper's arrival (0: none yet) */
} job_t;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Busy-machine back-off: when a region's helper thread arrived after most of the work was
 * done (its core was taken by another process), the next regions run on the calling thread
 * alone, then threads are tried again: 64 regions, doubled after each failed try (up to
 * 16384), back to 64 after a region whose helper came in time. A region on a busy machine then
 * costs about what one thread costs, not a wait for a descheduled thread at every region. */
#define SS_BACKOFF 64
#define SS_BACKOFF_MAX 16384
static int64_t g_regions = 0, g_serial_until = 0, g_backoff = SS_BACKOFF;

static void job_run(void *arg)
{
    job_t *j = (job_t *)arg;
    int tid = j->serial ? 0 : g_thread_num();
    if (tid != 0) {
        int64_t zero = 0, t = now_ns();
        __atomic_compare_exchange_n(&j->helper_ns, &zero, t, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
    }
    for (;;) {
        int64_t t0 = __atomic_fetch_add(&j->next, j->grain, __ATOMIC_RELAXED);
        if (t0 >= j->ntasks) break;
        int64_t t1 = t0 + j->grain < j->ntasks ? t0 + j->grain : j->ntasks;
        for (int64_t t = t0; t < t1; t++) j->fn(j->ctx, t, tid);
    }
}

static void run_tasks(task_fn fn, void *ctx, int64_t ntasks, int nthreads)
{
    if (ntasks <= 0) return;
    if (nthreads > ntasks) nthreads = (int)ntasks;
    job_t j = {fn, ctx, ntasks, 1, 0, 0, 0, 0};
    int64_t g = ntasks / ((int64_t)(nthreads > 0 ? nthreads : 1) * 16);
    j.grain = g > 1 ? g : 1;
    int64_t region = __atomic_add_fetch(&g_regions, 1, __ATOMIC_RELAXED);
    if (nthreads > 1 && g_parallel &&
        region >= __atomic_load_n(&g_serial_until, __ATOMIC_RELAXED)) {
        j.start_ns = now_ns();
        g_parallel(job_run, &j, (unsigned)nthreads, 0);
        int64_t total = now_ns() - j.start_ns;
        int64_t helper = __atomic_load_n(&j.helper_ns, __ATOMIC_RELAXED);
        if (total > 100000 && (helper == 0 || 2 * (helper - j.start_ns) > total)) {
            int64_t b = __atomic_load_n(&g_backoff, __ATOMIC_RELAXED);
            __atomic_store_n(&g_serial_until, region + b, __ATOMIC_RELAXED);
            __atomic_store_n(&g_backoff, b < SS_BACKOFF_MAX ? 2 * b : b, __ATOMIC_RELAXED);
        } else if (helper != 0) {
            __atomic_store_n(&g_backoff, SS_BACKOFF, __ATOMIC_RELAXED);
        }
    } else {
        j.serial = 1;
        job_run(&j);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* contexts */

typedef struct {
    int64_t n_br, r, c, N, n_in;
    const int64_t *crow, *col, *order;
    const void *vals;
    int64_t sp, sa, sb;
    const void *x;
    int xdt;
    int64_t xk, xn;
    void *y;
    int ydt;
    int64_t yi, yn;
    const void *bias;
    int64_t nt; /* batch columns per chunk */
    int direct;
    void **bufs;
    int64_t *buf_chunk;
    void **pack;
} prod_ctx;

typedef struct {
    int64_t r, c, N;
    const int64_t *rows, *cols;
    const void *l;
    int64_t li, ln;
    const void *rgt;
    int64_t ri, rn;
    void *g;
} vg_ctx;

typedef struct {
    task_fn prod, rowdot, vg_outer, vg_dot, bm;
    int lanes;
} kernel_set;

/* ------------------------------------------------------------------------------------------ */
/* instantiations */

#ifdef SS_X86
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

/* AVX-512F, float32 */
#define SUF avx512_f32
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
#undef TARGET
#undef RT_PROD
#undef RT_OUT1
#undef RT_OUT2
#undef RT_DOT
#undef CT_DOT
#undef BM_NB

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

/* AVX2 + FMA, float32 */
#define SUF avx2_f32
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
#endif /* SS_X86 */

/* ------------------------------------------------------------------------------------------ */
/* dispatch */

enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int g_isa = -1;

/* The best instruction set this CPU has (2: AVX-512F, 1: AVX2+FMA, 0: none) */
int ss_cpu_isa(void)
{
#ifdef SS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_NONE;
}

/* Use `isa` (at most what the CPU has); returns the one in use. */
int ss_select_isa(int isa)
{
    int best = ss_cpu_isa();
    g_isa = isa < 0 || isa > best ? best : isa;
    return g_isa;
}

int ss_isa(void)
{
    if (g_isa < 0) ss_select_isa(-1);
    return g_isa;
}

static const kernel_set *kernels_for(int cdt)
{
#ifdef SS_X86
    switch (ss_isa()) {
    case ISA_AVX512: return cdt == DT_F64 ? &kernels_avx512_f64 : &kernels_avx512_f32;
    case ISA_AVX2: return cdt == DT_F64 ? &kernels_avx2_f64 : &kernels_avx2_f32;
    default: break;
    }
#endif
    (void)cdt;
    return 0;
}

#define SS_CHUNK 64

/* Y[row, n] = bias[row] + sum_q sum_b M_q[a, b] X[col_q * c + b, n] for a matrix M stored by
 * block rows (n_br of them, blocks r x c): block q of row i (crow[i] <= q < crow[i+1]) is at
 * block column col[q] and has the values vals[p * sp + a * sa + b * sb], p = order[q] (or q).
 * X[k, n] = x[k * xk + n * xn] (k < n_in, n < N), Y[row, n] = y[row * yi + n * yn]. vals and
 * bias (nullable) are in the compute type (float64 when xdt is, float32 otherwise); x and y in
 * xdt / ydt. Returns 0, or -1 (no kernels), -2 (out of memory). */
int ss_product(int64_t n_br, int64_t r, int64_t c, const int64_t *crow, const int64_t *col,
               const int64_t *order, const void *vals, int64_t sp, int64_t sa, int64_t sb,
               const void *x, int xdt, int64_t xk, int64_t xn, int64_t n_in, int64_t N,
               void *y, int ydt, int64_t yi, int64_t yn, const void *bias, int nthreads)
{
    int cdt = xdt == DT_F64 ? DT_F64 : DT_F32;
    const kernel_set *ks = kernels_for(cdt);
    if (!ks) return -1;
    if (N <= 0 || n_br <= 0) return 0;
    prod_ctx k = {n_br, r, c, N, n_in, crow, col, order, vals, sp, sa, sb, x, xdt, xk, xn,
                  y, ydt, yi, yn, bias, SS_CHUNK, 0, 0, 0, 0};
    if (nthreads < 1) nthreads = 1;
    /* a few batch rows, features contiguous: dot products along the block rows */
    if (N <= 4 && sb == 1 && xk == 1 && c >= ks->lanes / 2 && xdt == cdt) {
        run_tasks(ks->rowdot, &k, n_br, nthreads);
        return 0;
    }
    int64_t nchunk = (N + SS_CHUNK - 1) / SS_CHUNK;
    int64_t ntasks = nchunk * n_br;
    int nth = nthreads < ntasks ? nthreads : (int)ntasks;
    if (nth > 256) nth = 256;
    size_t esz = cdt == DT_F64 ? 8 : 4;
    if (yi == 1 && xdt == cdt && r >= ks->lanes / 2) {
        /* batch-major: X read in place, output rows in vectors; the blocks of one row are
         * packed (transposed) per task where M's rows are not contiguous */
        /* batch rows per task: all of them where the block rows alone give every thread
         * several tasks (the packing of a row's blocks is then paid once) */
        int64_t want = (int64_t)nth * 4, per = want <= n_br ? 1 : (want + n_br - 1) / n_br;
        int64_t bnt = (N + per - 1) / per;
        bnt = (bnt + 7) / 8 * 8;
        k.nt = bnt;
        ntasks = ((N + bnt - 1) / bnt) * n_br;
        int64_t maxq = 0;
        for (int64_t i = 0; i < n_br; i++)
            if (crow[i + 1] - crow[i] > maxq) maxq = crow[i + 1] - crow[i];
        void *packs[256], *ptrs[256];
        int ok = 1;
        for (int t = 0; t < nth; t++) {
            packs[t] = sa == 1 ? 0 : malloc((size_t)(maxq > 0 ? maxq : 1) * r * c * esz);
            ptrs[t] = maxq > 64 ? malloc((size_t)maxq * sizeof(void *)) : 0;
            if ((sa != 1 && !packs[t]) || (maxq > 64 && !ptrs[t])) ok = 0;
        }
        if (ok) {
            k.pack = packs;
            k.bufs = ptrs;
            run_tasks(ks->bm, &k, ntasks, nth);
        }
        for (int t = 0; t < nth; t++) { free(packs[t]); free(ptrs[t]); }
        return ok ? 0 : -2;
    }
    if (xdt == cdt && xn == 1) {
        k.direct = 1;
        run_tasks(ks->prod, &k, ntasks, nth);
        return 0;
    }
    void *bufs[256];
    int64_t chunks[256];
    int ok = 1;
    for (int t = 0; t < nth; t++) {
        bufs[t] = calloc((size_t)(n_in > 0 ? n_in : 1) * SS_CHUNK, esz);
        chunks[t] = -1;
        if (!bufs[t]) ok = 0;
    }
    if (ok) {
        k.bufs = bufs;
        k.buf_chunk = chunks;
        run_tasks(ks->prod, &k, ntasks, nth);
    }
    for (int t = 0; t < nth; t++) free(bufs[t]);
    return ok ? 0 : -2;
}

/* G_p[a, b] = sum_n L[rows[p] * r + a, n] * R[cols[p] * c + b, n] for p < nnzb, G contiguous
 * (nnzb, r, c) in the compute type (float64 or float32, = the operands' dtype here).
 * L[row, n] = l[row * li + n * ln], R[col, n] = rgt[col * ri + n * rn]. Returns 0, -1 (no
 * kernels for this layout of the operands: the caller makes them contiguous along the batch). */
int ss_values_grad(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows, const int64_t *cols,
                   const void *l, int64_t li, int64_t ln, const void *rgt, int64_t ri,
                   int64_t rn, int64_t N, int dt, void *g, int nthreads)
{
    const kernel_set *ks = kernels_for(dt);
    if (!ks || (dt != DT_F32 && dt != DT_F64)) return -1;
    vg_ctx k = {r, c, N, rows, cols, l, li, ln, rgt, ri, rn, g};
    if (nthreads < 1) nthreads = 1;
    if (ri == 1 && c >= ks->lanes / 2) {
        run_tasks(ks->vg_outer, &k, nnzb, nthreads);
        return 0;
    }
    if (ln == 1 && rn == 1) {
        run_tasks(ks->vg_dot, &k, nnzb, nthreads);
        return 0;
    }
    return -1;
}

/* dst[i] = src[i] converted (for the dtypes' round trips in tests) */
int ss_convert(const void *src, int sdt, void *dst, int ddt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) put_el(dst, ddt, i, get_el(src, sdt, i));
    return 0;
}

int ss_abi_version(void) { return 1; }

/* Regions opened so far and the region up to which products run on the calling thread (the
 * busy-machine back-off), for diagnostics. */
void ss_region_stats(int64_t *out)
{
    out[0] = __atomic_load_n(&g_regions, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&g_serial_until, __ATOMIC_RELAXED);
}

/* Forget the back-off (the next region tries threads again): for tests. */
void ss_reset_backoff(void)
{
    __atomic_store_n(&g_serial_until, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_backoff, SS_BACKOFF, __ATOMIC_RELAXED);
}

/* bfloat16 computed in bfloat16 (AVX512_BF16): ss_bf16_supported, ss_product_bf16,
 * ss_values_grad_bf16 */
#include "kern_bf16.h"
