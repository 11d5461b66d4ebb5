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
 * Bounds: the caller (safesparse's operators) hands in index data that safesparse validated,
 * but that memory stays writable (a racing in-place write can change it after the proof). So
 * every index is read once (a relaxed atomic load: never re-read after its check) and checked
 * against the bound the caller gave from the tensors' shapes (nnzb, the block columns) before
 * anything is addressed with it; a bad one stops the product with SS_E_INDEX, and
 * ss_last_error() says which array, where and what it held. No read or write out of bounds,
 * whatever the indices.
 */
#include "blockprod.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define SS_X86 1
#include <immintrin.h>
#endif

enum { DT_F32 = SS_DT_F32, DT_F64 = SS_DT_F64, DT_F16 = SS_DT_F16, DT_BF16 = SS_DT_BF16 };

/* dtype conversions and the tile fill */
#include "convert.h"

/* the parallel region and the index faults */
#include "region.h"

/* ------------------------------------------------------------------------------------------ */
/* contexts */

typedef struct {
    int64_t n_br, r, c, N, n_in;
    int64_t nnzb, n_bc, maxq; /* bounds: stored blocks, M's block columns, a row's blocks */
    ss_fault *fault;
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
    void *packed; /* M's blocks packed once per call (batch-major, several row tiles) */
} prod_ctx;

typedef struct {
    int64_t r, c, N;
    int64_t n_lb, n_rb; /* bounds: L's row blocks, R's row blocks */
    ss_fault *fault;
    int64_t n0, n1; /* the batch rows of this region (outer form) */
    int accum;      /* 1: add to G (a later row tile) */
    const int64_t *rows, *cols;
    const void *l;
    int64_t li, ln;
    const void *rgt;
    int64_t ri, rn;
    void *g;
    int64_t nnzb; /* the stored blocks (the tasks) */
    /* block strides of L and R (r * li, c * ri; in a copied row tile (n0 - noff) * ln apart
     * from the block's first batch row) and, where the row tile is copied block by block, the
     * operands' own data and batch strides */
    int64_t lb, rb, noff;
    const void *l0, *r0;
    int64_t l0n, r0n;
} vg_ctx;

typedef struct {
    task_fn prod, small, vg_outer, vg_dot, bm, pack, vg_pack;
    int lanes;
} kernel_set;

/* ------------------------------------------------------------------------------------------ */
/* prefetching a share of a row tile (hints only: never a read, never a fault) */

#ifndef SS_PF_HINT
#define SS_PF_HINT 1 /* prefetcht2: into L2, the first level a tile has to be in */
#endif
#ifndef SS_PF_FIRST
#define SS_PF_FIRST 0 /* 1: the first tile's first task prefetches the first tile (measured
                       * in the encoder at 128 rows, one thread: 2 % slower; its input is the
                       * output of the operation before, in cache: the burst of a whole tile's
                       * prefetches in one task waited for the lines it did not need) */
#endif

#ifndef SS_BM_UNROLL
#define SS_BM_UNROLL 1 /* the batch-major tiles of 16-wide blocks unroll a block's 16 steps
                        * (0: the loop over its columns, for measurements) */
#endif

#ifndef SS_VG_AHEAD
#define SS_VG_AHEAD 16 /* batch rows ahead the values gradient's outer form prefetches */
#endif

/* The lines of `rows` rows (row n: `len` bytes from base + n * stride) in order, share `share`
 * of `shares`, issued `step` at a time by prefetch_step. */
typedef struct {
    const char *base;
    int64_t stride, lines, n, o, left, step;
} row_lines;

static inline void row_lines_share(row_lines *t, const char *base, int64_t stride, int64_t len,
                                   int64_t rows, int64_t share, int64_t shares, int64_t calls)
{
    int64_t lines = (len + 63) / 64, total = rows * lines;
    int64_t t0 = total * share / shares, t1 = total * (share + 1) / shares;
    t->base = base;
    t->stride = stride;
    t->lines = lines;
    t->n = lines > 0 ? t0 / lines : 0;
    t->o = lines > 0 ? t0 % lines : 0;
    t->left = t1 - t0;
    t->step = calls > 0 ? (t->left + calls - 1) / calls : t->left;
}

static inline __attribute__((always_inline)) void prefetch_step(row_lines *t)
{
    for (int64_t s = 0; s < t->step && t->left > 0; s++, t->left--) {
        __builtin_prefetch(t->base + t->n * t->stride + t->o * 64, 0, SS_PF_HINT);
        if (++t->o == t->lines) { t->o = 0; t->n++; }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* instantiations */

#define SS_PACK 16 /* blocks per task of the packing pass */

#ifdef SS_X86
#include "simd_avx512.h"
#include "simd_avx2.h"
#endif /* SS_X86 */

/* ------------------------------------------------------------------------------------------ */
/* dispatch */

enum { ISA_NONE = SS_ISA_NONE, ISA_AVX2 = SS_ISA_AVX2, ISA_AVX512 = SS_ISA_AVX512 };
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

/* The most blocks in one row (sizes the per-thread buffers; each task checks its row against
 * it again, the pointers may change meanwhile), or -1 and a fault. */
static int64_t longest_row(const int64_t *crow, int64_t n_br, int64_t nnzb, ss_fault *fault)
{
    int64_t maxq = 0;
    for (int64_t i = 0; i < n_br; i++) {
        int64_t q0, q1;
        if (!row_range(crow, i, nnzb, fault, &q0, &q1)) return -1;
        if (q1 - q0 > maxq) maxq = q1 - q0;
    }
    return maxq;
}

/* Per-thread lists of a row's block pointers and columns where a row holds more than the 64 a
 * task keeps on its stack; 0 when out of memory (those allocated are null or freed by the
 * caller: every slot is set). */
static int row_buffers(void **ptrs, int nth, int64_t maxq)
{
    int ok = 1;
    for (int t = 0; t < nth; t++) {
        ptrs[t] = maxq > 64 ? malloc((size_t)maxq * (sizeof(void *) + sizeof(int64_t))) : 0;
        if (maxq > 64 && !ptrs[t]) ok = 0;
    }
    return ok;
}
#ifndef SS_SMALL_N
#define SS_SMALL_N 15 /* batches up to this many rows take the whole-block tiles (measured,
                        * 1024^2, 16 x 16 blocks, one thread: from 16 rows the batch-major tile
                        * is as fast with its per-task packing and faster on pre-packed values;
                        * at 8 rows it is 1.3x slower with the packing) */
#endif
#ifndef SS_VG_ROWS
#define SS_VG_ROWS 128 /* batch rows per region of the values gradient (outer form) */
#endif
#ifndef SS_VG_COPY_MIN
#define SS_VG_COPY_MIN 64 /* batches from this many rows copy their row tiles block by block */
#endif
#ifndef SS_VG_SPLIT
#define SS_VG_SPLIT 2 /* batches over this many row tiles (SS_VG_ROWS) are split in them */
#endif
#ifndef SS_BM_ROWS
#define SS_BM_ROWS 128 /* most batch rows per task of the batch-major product (a row tile) */
#endif
#ifndef SS_TILE_BYTES
#define SS_TILE_BYTES (1024 * 1024) /* a row tile's operands (input and output rows): about
                                      * an L2 (Zen 4's 1 MiB; measured against 512 KiB: equal
                                      * or faster at 128 to 4096 rows, 768 to 3072 wide) */
#endif

/* Rows of a row tile whose `width` elements per row (the operands' rows together) of `esz`
 * bytes stay within SS_TILE_BYTES: a multiple of 8 in [16, most] (128-row tiles of a
 * 3072-wide operand hold 1.5 MiB; the results do not depend on the tile) */
static int64_t tile_rows(int64_t width, size_t esz, int64_t most)
{
    int64_t rows = SS_TILE_BYTES / ((width > 0 ? width : 1) * (int64_t)esz);
    rows = rows / 8 * 8;
    if (rows < 16) rows = 16;
    return rows < most ? rows : most;
}

/* The buffer of M's blocks packed once per call, kept across calls: a fresh one per call of a
 * large layer is a fresh mapping of the allocator (glibc maps blocks above its mmap threshold,
 * 128 KiB by default and as benchmarks pin it), and its page faults cost as much as the
 * product at 128 rows (measured: +0.3 ms on a 0.8 ms product). One buffer for the process,
 * taken by one product at a time (another product meanwhile, in another thread, allocates its
 * own), grown to the largest packed matrix up to SS_PACK_KEEP bytes and never shrunk (larger
 * ones are allocated per call). */
#ifndef SS_PACK_KEEP
#define SS_PACK_KEEP ((size_t)16 << 20)
#endif
static void *g_pack_buf = 0;
static size_t g_pack_cap = 0;
static int g_pack_busy = 0;

/* A buffer of `bytes` (0 when out of memory); *kept says whether it is the kept one */
static void *pack_buffer(size_t bytes, int *kept)
{
    *kept = 0;
    if (bytes <= SS_PACK_KEEP && !__atomic_exchange_n(&g_pack_busy, 1, __ATOMIC_ACQUIRE)) {
        if (g_pack_cap < bytes) {
            free(g_pack_buf);
            g_pack_buf = malloc(bytes);
            g_pack_cap = g_pack_buf ? bytes : 0;
        }
        if (g_pack_buf) {
            *kept = 1;
            return g_pack_buf;
        }
        __atomic_store_n(&g_pack_busy, 0, __ATOMIC_RELEASE);
    }
    return malloc(bytes);
}

static void pack_release(void *buf, int kept)
{
    if (kept) __atomic_store_n(&g_pack_busy, 0, __ATOMIC_RELEASE);
    else free(buf);
}

/* Y[row, n] = bias[row] + sum_q sum_b M_q[a, b] X[col_q * c + b, n] for a matrix M stored by
 * block rows (n_br of them, blocks r x c, nnzb stored): block q of row i (crow[i] <= q <
 * crow[i+1]) is at block column col[q] and has the values vals[p * sp + a * sa + b * sb],
 * p = order[q] (or q). X[k, n] = x[k * xk + n * xn] (k < n_in, n < N), Y[row, n] = y[row * yi +
 * n * yn]. vals and bias (nullable) are in the compute type (float64 when xdt is, float32
 * otherwise); x and y in xdt / ydt. Every index is checked as it is read (0 <= crow[i] <=
 * crow[i+1] <= nnzb, 0 <= order[q] < nnzb, 0 <= col[q] < n_in / c). Returns 0, or SS_E_NOKERNEL,
 * SS_E_NOMEM, SS_E_INDEX (ss_last_error says where; y is then partly written). */
int ss_product(int64_t n_br, int64_t r, int64_t c, int64_t nnzb, const int64_t *crow,
               const int64_t *col, const int64_t *order, const void *vals, int64_t sp,
               int64_t sa, int64_t sb, const void *x, int xdt, int64_t xk, int64_t xn,
               int64_t n_in, int64_t N, void *y, int ydt, int64_t yi, int64_t yn,
               const void *bias, int nthreads)
{
    int cdt = xdt == DT_F64 ? DT_F64 : DT_F32;
    const kernel_set *ks = kernels_for(cdt);
    if (!ks) return SS_E_NOKERNEL;
    if (N <= 0 || n_br <= 0) return 0;
    ss_fault fault = {0, 0, 0, 0, 0};
    prod_ctx k = {n_br, r, c, N, n_in, nnzb, c > 0 ? n_in / c : 0, 0, &fault, crow, col, order,
                  vals, sp, sa, sb, x, xdt, xk, xn, y, ydt, yi, yn, bias, SS_CHUNK, 0, 0, 0, 0,
                  0};
    if (nthreads < 1) nthreads = 1;
    /* small batches, M's rows and the features contiguous: whole-block tiles */
    if (N <= SS_SMALL_N && sb == 1 && xk == 1 && c >= ks->lanes / 2 && xdt == cdt) {
        int64_t maxq = longest_row(crow, n_br, nnzb, &fault);
        if (maxq < 0) return fault_result(&fault);
        k.maxq = maxq;
        int nth = nthreads < n_br ? nthreads : (int)n_br;
        if (nth > 256) nth = 256;
        void *ptrs[256];
        int ok = row_buffers(ptrs, nth, maxq);
        if (ok) {
            k.bufs = ptrs;
            run_tasks(ks->small, &k, n_br, nth);
        }
        for (int t = 0; t < nth; t++) free(ptrs[t]);
        return ok ? fault_result(&fault) : SS_E_NOMEM;
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
        /* row tiles: the tile of X and of Y stays in cache across the block rows (tasks run
         * tile by tile), so the cost per row stays flat however large the batch */
        int64_t most = tile_rows(n_in + n_br * r, esz, SS_BM_ROWS);
        if (tile_rows(n_in, esz, SS_BM_ROWS) >= N) most = N; /* all of X in one tile */
        if (bnt > most) { /* tiles of about equal rows (not a full ones and a short last) */
            int64_t tiles = (N + most - 1) / most;
            bnt = (N + tiles - 1) / tiles;
            bnt = (bnt + 7) / 8 * 8;
        }
        k.nt = bnt;
        int64_t ntiles = (N + bnt - 1) / bnt;
        ntasks = ntiles * n_br;
        int64_t maxq = longest_row(crow, n_br, nnzb, &fault);
        if (maxq < 0) return fault_result(&fault);
        k.maxq = maxq;
        void *packs[256], *ptrs[256];
        int ok = row_buffers(ptrs, nth, maxq);
        for (int t = 0; t < nth; t++) {
            packs[t] = sa == 1 ? 0 : malloc((size_t)(maxq > 0 ? maxq : 1) * r * c * esz);
            if (sa != 1 && !packs[t]) ok = 0;
        }
        /* several row tiles and M's rows strided: pack the blocks once, not per tile */
        void *packed = 0;
        int kept = 0;
        if (ok && sa != 1 && ntiles > 1) {
            packed = pack_buffer((size_t)(nnzb > 0 ? nnzb : 1) * r * c * esz, &kept);
            if (!packed) ok = 0;
            k.packed = packed;
            if (ok) run_tasks(ks->pack, &k, (nnzb + SS_PACK - 1) / SS_PACK, nth);
        }
        if (ok && !fault.flag) {
            k.pack = packs;
            k.bufs = ptrs;
            run_tasks(ks->bm, &k, ntasks, nth);
        }
        for (int t = 0; t < nth; t++) { free(packs[t]); free(ptrs[t]); }
        if (packed) pack_release(packed, kept);
        return ok ? fault_result(&fault) : SS_E_NOMEM;
    }
    if (xdt == cdt && xn == 1) {
        k.direct = 1;
        run_tasks(ks->prod, &k, ntasks, nth);
        return fault_result(&fault);
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
    return ok ? fault_result(&fault) : SS_E_NOMEM;
}

/* G_p[a, b] = sum_n L[rows[p] * r + a, n] * R[cols[p] * c + b, n] for p < nnzb, G contiguous
 * (nnzb, r, c) in the compute type (float64 or float32, = the operands' dtype here).
 * L[row, n] = l[row * li + n * ln] (row < n_l), R[col, n] = rgt[col * ri + n * rn] (col < n_r).
 * Every index is checked as it is read (0 <= rows[p] < n_l / r, 0 <= cols[p] < n_r / c).
 * Returns 0, SS_E_NOKERNEL (no kernels for this layout of the operands: the caller makes them
 * contiguous along the batch), SS_E_INDEX (ss_last_error says where). */
int ss_values_grad(int64_t nnzb, int64_t r, int64_t c, int64_t n_l, int64_t n_r,
                   const int64_t *rows, const int64_t *cols, const void *l, int64_t li,
                   int64_t ln, const void *rgt, int64_t ri, int64_t rn, int64_t N, int dt,
                   void *g, int nthreads)
{
    const kernel_set *ks = kernels_for(dt);
    if (!ks || (dt != DT_F32 && dt != DT_F64)) return SS_E_NOKERNEL;
    ss_fault fault = {0, 0, 0, 0, 0};
    vg_ctx k = {r, c, N, r > 0 ? n_l / r : 0, c > 0 ? n_r / c : 0, &fault, 0, N, 0, rows,
                cols, l, li, ln, rgt, ri, rn, g, nnzb, r * li, c * ri, 0, l, rgt, ln, rn};
    if (nthreads < 1) nthreads = 1;
    if (ri == 1 && c >= ks->lanes / 2) {
        /* row tiles (one region each, G accumulated): the tiles of L and R stay in cache
         * across the blocks, so the cost per row stays flat however large the batch */
        int64_t tile = N > SS_VG_SPLIT * SS_VG_ROWS ? SS_VG_ROWS : (N > 0 ? N : 1);
        /* each row tile copied block by block first, where the blocks are whole vectors:
         * a block's batch rows are then two contiguous runs, where in place they are a batch
         * row apart (a power of two for the usual widths: every row in one L1 set, and a
         * stride no prefetcher runs far enough ahead on; measured 60-65 -> 77-94 GFLOP/s
         * with a padded stride, 1024^2 at 10 %) */
        int64_t n_lb = k.n_lb, n_rb = k.n_rb, w = ks->lanes;
        size_t esz = dt == DT_F64 ? 8 : 4;
        /* the copy costs per batch row what the operands' rows hold, n_l + n_r; it saves a
         * share of the products' nnzb * r * c: it pays where these are at least ~40 to 1 and
         * the batch several row tiles (measured, 1024^2 16x16: 5 % (26 to 1) slower at every
         * batch, 10 % (51) equal up to 256 rows and faster from 512; the layer's fwd+bwd at
         * 256 rows, 25 %: 0.27-0.29 of nn.Linear without, 0.30-0.31 with: one 256-row tile
         * copied is 2 MiB, past the L2) */
        int64_t work = nnzb * r * c, width = n_l + n_r;
        int copy = li == 1 && r % w == 0 && c % w == 0 && N >= SS_VG_COPY_MIN && nnzb > 0 &&
                   work >= 40 * width && N > SS_VG_SPLIT * SS_VG_ROWS;
        size_t lsz = (size_t)(n_lb * (tile + 1) * r);
        size_t bytes = (lsz + (size_t)(n_rb * (tile + 1) * c)) * esz;
        int kept = 0;
        void *buf = copy ? pack_buffer(bytes, &kept) : 0;
        if (buf) {
            k.l = buf;
            k.li = 1;
            k.ln = r;
            k.lb = (tile + 1) * r; /* (a row's pad: block rows not a power of two apart) */
            k.rgt = (char *)buf + lsz * esz;
            k.rn = c;
            k.rb = (tile + 1) * c;
        }
        for (int64_t n0 = 0; n0 < N || n0 == 0; n0 += tile) {
            k.n0 = n0;
            k.n1 = n0 + tile < N ? n0 + tile : N;
            k.accum = n0 > 0;
            if (buf) {
                k.noff = n0;
                run_tasks(ks->vg_pack, &k, (k.n1 - n0 + 7) / 8, nthreads);
            }
            run_tasks(ks->vg_outer, &k, nnzb, nthreads);
            if (fault.flag) break;
        }
        if (buf) pack_release(buf, kept);
        return fault_result(&fault);
    }
    if (ln == 1 && rn == 1) {
        run_tasks(ks->vg_dot, &k, nnzb, nthreads);
        return fault_result(&fault);
    }
    return SS_E_NOKERNEL;
}

/* The calling thread's last index fault (after SS_E_INDEX): out[0] the array (SS_M_PTR: the
 * pointers crow, SS_M_IDX: col, SS_M_ORDER: order, SS_M_ROWS / SS_M_COLS: values_grad's rows /
 * cols), out[1] its position, out[2] the value read there, out[3] the bound it broke. */
void ss_last_error(int64_t *out)
{
    for (int t = 0; t < 4; t++) out[t] = g_last_fault[t];
}

/* dst[i] = src[i] converted (for the dtypes' round trips in tests) */
int ss_convert(const void *src, int sdt, void *dst, int ddt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) put_el(dst, ddt, i, get_el(src, sdt, i));
    return 0;
}

int ss_abi_version(void) { return SS_ABI_VERSION; }

const char *ss_dtype_names(void) { return SS_DTYPE_NAMES; }

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

/* ss_product with its 23 arguments packed in one int64 array, in ss_product's order (pointers
 * as integers), and a 24th slot: the values' dtype. One argument for a ctypes caller that keeps
 * the array across calls and writes only the slots that change (the eager fast path of
 * safesparse.nn, safesparse/nn/eager.py). a[23] == SS_DT_BF16: the product computed in
 * bfloat16 (ss_product_bf16_to; values, bias and x bfloat16, y bfloat16 or float32, block rows
 * of n_in / c block columns, a[3] bounding both the stored blocks and the values' blocks);
 * a[23] == SS_DT_BF16 | SS_VALS_F32: the same from float32 values and bias, rounded to
 * bfloat16 (the values as they are read, the bias here, once) (small batches of 16 x 16 blocks stored by rows; SS_E_NOKERNEL
 * elsewhere); else ss_product. */
static int bf_product_any(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                          const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                          const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                          const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int ydt,
                          int64_t yi, int64_t yn, const void *bias, int vf32, int nthreads);

#ifdef SS_X86
__attribute__((target("avx512f,avx512bw,avx512vl")))
#endif
static void round_bf16(const float *restrict src, uint16_t *restrict dst, int64_t n);

int ss_product_packed(const int64_t *a)
{
    if (a[23] == SS_DT_BF16 || a[23] == (SS_DT_BF16 | SS_VALS_F32)) {
        if (a[12] != SS_DT_BF16 || a[2] <= 0) /* (bf_product_any checks a[18]) */
            return SS_E_NOKERNEL;
        const int vf32 = a[23] != SS_DT_BF16;
        const void *bias = (const void *)(intptr_t)a[21];
        /* float32 values: a float32 bias rounded here, once (round_bf16: torch's rounding) */
        uint16_t few[4096], *rounded = 0;
        if (vf32 && bias) {
            int64_t rows = a[0] * a[1];
            if (!ss_bf16_supported() || rows <= 0) return SS_E_NOKERNEL;
            rounded = rows <= 4096 ? few : (uint16_t *)malloc((size_t)rows * 2);
            if (!rounded) return SS_E_NOMEM;
            round_bf16((const float *)bias, rounded, rows);
            bias = rounded;
        }
        int rc = bf_product_any(a[0], a[1], a[2], (const int64_t *)(intptr_t)a[4],
                                (const int64_t *)(intptr_t)a[5], (const int64_t *)(intptr_t)a[6],
                                a[3], a[15] / a[2], (const void *)(intptr_t)a[7], a[3], a[8],
                                a[9], a[10], (const void *)(intptr_t)a[11], a[13], a[14], a[16],
                                (void *)(intptr_t)a[17], (int)a[18], a[19], a[20], bias, vf32,
                                (int)a[22]);
        if (rounded && rounded != few) free(rounded);
        return rc;
    }
    return ss_product(a[0], a[1], a[2], a[3], (const int64_t *)(intptr_t)a[4],
                      (const int64_t *)(intptr_t)a[5], (const int64_t *)(intptr_t)a[6],
                      (const void *)(intptr_t)a[7], a[8], a[9], a[10],
                      (const void *)(intptr_t)a[11], (int)a[12], a[13], a[14], a[15], a[16],
                      (void *)(intptr_t)a[17], (int)a[18], a[19], a[20],
                      (const void *)(intptr_t)a[21], (int)a[22]);
}

/* bfloat16 computed in bfloat16 (AVX512_BF16): ss_bf16_supported, ss_product_bf16,
 * ss_values_grad_bf16 */
#include "kern_bf16.h"

/* float32 to bfloat16, round to nearest even, NaN kept quiet (f32_to_bf16, in a loop the
 * compiler vectorizes: AVX-512 where the bfloat16 kernels run) */
#ifdef SS_X86
__attribute__((target("avx512f,avx512bw,avx512vl")))
#endif
static void round_bf16(const float *restrict src, uint16_t *restrict dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, 4);
        uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u)
                                                     : u + 0x7fffu + ((u >> 16) & 1u);
        dst[i] = (uint16_t)(r >> 16);
    }
}

/* ss_product_packed for a bfloat16 array (a[23] == SS_DT_BF16, with SS_VALS_F32 or not)
 * whose operand X (a[11]) is float32: rounded to bfloat16 here first (round to nearest even, as torch's
 * .to(torch.bfloat16); a buffer of this call), then the bfloat16 product. For small operands,
 * where a separate conversion costs more than the product (the eager fast path of
 * safesparse.nn under bfloat16 autocast). The array is not written. */
int ss_product_packed_rounded(const int64_t *a)
{
    int64_t b[24];
    int64_t n_in = a[15], N = a[16], xk = a[13], xn = a[14];
    if ((a[23] != SS_DT_BF16 && a[23] != (SS_DT_BF16 | SS_VALS_F32)) || !ss_bf16_supported())
        return SS_E_NOKERNEL;
    memcpy(b, a, sizeof b);
    b[12] = SS_DT_BF16;
    if (N <= 0 || n_in <= 0 || xk < 0 || xn < 0) return ss_product_packed(b);
    int64_t count = (n_in - 1) * xk + (N - 1) * xn + 1;
    uint16_t *tmp = (uint16_t *)malloc((size_t)count * 2);
    if (!tmp) return SS_E_NOMEM;
    round_bf16((const float *)(intptr_t)a[11], tmp, count);
    b[11] = (int64_t)(intptr_t)tmp;
    int rc = ss_product_packed(b);
    free(tmp);
    return rc;
}

/* The backward of a layer's product Y = X W^T (+ bias), W stored by block rows or columns, in
 * one call: the array of ss_product_packed for GX = G W (W^T by block rows, a[0..23]), then at
 * a + 24 the values gradient's arguments in ss_values_grad's order and its output's dtype:
 *   v[0..4]   nnzb, r, c, rows, cols        v[5..6]  n_l (W's rows), n_r (W's columns)
 *   v[7..9]   l (G), li, ln                  v[10..12] rgt (X), ri, rn
 *   v[13]     N                              v[14] the operands' dtype, v[15] gv, v[16] its dtype
 *   v[17]     threads                        v[18] gb, v[19] its dtype
 *   v[20]     1: X is float32, rounded to bfloat16 here first (bfloat16 operands; as
 *             .to(torch.bfloat16): the input a layer under autocast read rounded in its forward)
 * Each output whose address is 0 is skipped: GV (v[15]: ss_values_grad, or for bfloat16
 * operands ss_values_grad_bf16_to, whose output dtype v[16] may be float32 rounded), GX (a[17]:
 * ss_product_packed, whose bfloat16 output dtype a[18] may be float32 rounded), and the bias
 * gradient gb = G.sum(0) (v[18], bfloat16 G only: ss_colsum_bf16 in dtype v[19]). For the eager
 * fast path of safesparse.nn (nn/eager.py): one ctypes argument per backward. Returns the first
 * nonzero code (the outputs then partly written). */
int ss_linear_backward_packed(const int64_t *a)
{
    const int64_t *v = a + 24;
    const void *l = (const void *)(intptr_t)v[7], *rgt = (const void *)(intptr_t)v[10];
    int rc = 0;
    if (v[15]) {
        void *g = (void *)(intptr_t)v[15];
        const int64_t *rows = (const int64_t *)(intptr_t)v[3];
        const int64_t *cols = (const int64_t *)(intptr_t)v[4];
        if (v[1] <= 0 || v[2] <= 0) return SS_E_NOKERNEL;
        if (v[14] == SS_DT_BF16) {
            uint16_t *tmp = 0;
            if (v[20]) {
                if (v[6] <= 0 || v[13] <= 0 || v[11] < 0 || v[12] < 0) return SS_E_NOKERNEL;
                int64_t count = (v[6] - 1) * v[11] + (v[13] - 1) * v[12] + 1;
                tmp = (uint16_t *)malloc((size_t)count * 2);
                if (!tmp) return SS_E_NOMEM;
                round_bf16((const float *)rgt, tmp, count);
            }
            rc = ss_values_grad_bf16_to(v[0], v[1], v[2], rows, cols, v[5] / v[1], v[6] / v[2],
                                        l, v[8], v[9], tmp ? tmp : rgt, v[11], v[12], v[13], g,
                                        (int)v[16], (int)v[17]);
            free(tmp);
        } else if (v[20])
            rc = SS_E_NOKERNEL;
        else if (v[16] != v[14])
            rc = SS_E_NOKERNEL;
        else
            rc = ss_values_grad(v[0], v[1], v[2], v[5], v[6], rows, cols, l, v[8], v[9], rgt,
                                v[11], v[12], v[13], (int)v[14], g, (int)v[17]);
        if (rc) return rc;
    }
    if (a[17]) {
        rc = ss_product_packed(a);
        if (rc) return rc;
    }
    if (v[18]) {
        if (v[14] != SS_DT_BF16) return SS_E_NOKERNEL;
        rc = ss_colsum_bf16(l, v[13], v[5], v[9], (void *)(intptr_t)v[18], (int)v[19],
                            (int)v[17]);
    }
    return rc;
}

#include "fingerprint.h"
