/* bfloat16 products computed in bfloat16: AVX512_BF16 micro-kernels (vdpbf16ps, float32
 * accumulation, round to nearest even on output), included once at the end of blockprod.c
 * (they use its parallel region, run_tasks, and its instruction-set choice, ss_isa); the
 * gradients (the values gradient, the column sums) in kern_bf16_grad.h, which this one includes.
 *
 * No float32 copy of the values, the input or the gradient: the values are packed (blocks in
 * bfloat16, pairs along the contracted dimension): batch-major, once per call by groups of
 * block rows sized for L2, then row tiles of the batch run every block row of a group, the input
 * rows of a block prefetched a few tiles ahead (bf_tiled_product); feature-major, per task (a block
 * row's blocks) into a per-thread buffer; the input and the gradient are read in place (pairs
 * broadcast, or interleaved in registers along the batch for the values gradient). Products
 * served:
 *   ss_product_bf16      Y[n, row] = bias[row] + sum M_q[a, b] X[n, col_q * c + b] for M stored
 *                        by block rows, batch-major (the forward of a SparseLinear, M = W, and
 *                        its gradient to the input, M = W.T read by block columns), or
 *                        feature-major (Y[row, n], X[k, n]: a SparseMatmul's A @ x, A.T @ g);
 *   ss_values_grad_bf16  G_p[a, b] = sum_n L[n, rows_p * r + a] R[n, cols_p * c + b] (the
 *                        gradient to the values of a SparseLinear: L = g, R = x, batch-major;
 *                        of a SparseMatmul: contiguous along the batch).
 * Any block shape (r x c; lanes of 16 rows, pairs of columns, masked tails).
 *
 * Defence in depth: every block index is checked against its dimension as it is read (the
 * index data may be written by a racing thread between the caller's proof and this read); one
 * out of range makes the call return SS_EINDEX, never an out-of-bounds read. The indices that
 * were checked are copied into the task's own buffer and only that copy is used. */
#ifdef SS_X86

#define SS_EINDEX (-3)
#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define BF_INL static inline __attribute__((always_inline)) BF_TARGET
#define BF_LANES 16
#ifndef BF_ROWS
#define BF_ROWS 256 /* batch rows per feature-major product task: a chunk of X and Y in L2 */
#endif
#ifndef BF_NB
#define BF_NB 8 /* batch rows of the product tile */
#endif
#ifndef BF_PF
#define BF_PF 3 /* tiles ahead to prefetch the input rows of a block (one tile is ~200 cycles
                   * at 5 % of blocks: too short for the input read from memory) */
#endif
#ifndef BF_SMALL_N
#define BF_SMALL_N 32 /* batches up to this many rows: whole-block tiles, no packing */
#endif
#ifndef BF_SMALL_T_N
#define BF_SMALL_T_N 32 /* the same for a transposed product (M's columns contiguous) */
#endif
#define BF_SMALL_ROWS 1
#define BF_SMALL_T 2
#ifndef BF_VG_ROWS
#define BF_VG_ROWS 256 /* batch rows per pass of the values gradient (batch-major) */
#endif

/* Whether this CPU runs the bfloat16 kernels (AVX512_BF16 with AVX-512BW) and the selected
 * instruction set is AVX-512. */
int ss_bf16_supported(void)
{
    __builtin_cpu_init();
    return ss_isa() == ISA_AVX512 && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

/* 16 float32 lanes to bfloat16, round to nearest even (vcvtneps2bf16: NaN kept quiet; a
 * subnormal float32 sum, below 1.2e-38, flushes to zero, as vdpbf16ps flushes its inputs) */
BF_INL __m256i bf_round(__m512 v)
{
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* bfloat16 lanes (masked) widened to float32 */
BF_INL __m512 bf_widen(const uint16_t *p, __mmask16 m)
{
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane i: (lo[i], hi[i]) as one pair (lo in the low half) */
BF_INL __m512i bf_interleave(__m256i lo, __m256i hi)
{
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), idx,
                                     _mm512_castsi256_si512(hi));
}

/* acc + the pairs of w times the pair of bfloat16 at p (4 bytes, any alignment) in every lane:
 * vdpbf16ps with its memory operand broadcast ({1to16}), one instruction. GCC does not fold a
 * broadcast load into vdpbf16ps (it emits vpbroadcastd, then the product); the folded form made
 * the batch-major product 2-5 % faster and the values gradient up to 2 % (batch 256, 1024 x 1024
 * BSR 16 x 16, 5-25 %). The same 4 bytes are read as by the intrinsic's load. */
typedef uint32_t bf_pair_t __attribute__((may_alias, aligned(2)));
BF_INL __m512 bf_dp_pair(__m512 acc, __m512bh w, const void *p)
{
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const bf_pair_t *)p));
    return acc;
}

static inline __mmask16 bf_mask(int64_t k)
{
    return k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k > 0 ? k : 0)) - 1u);
}

/* The float32 sums v (lanes m) to element off of an output: float32 as they are (f32), or
 * rounded to bfloat16 */
BF_INL void bf_put(void *base, int f32, int64_t off, __mmask16 m, __m512 v)
{
    if (f32)
        _mm512_mask_storeu_ps((float *)base + off, m, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)base + off, m, bf_round(v));
}

/* n float32 sums at p rounded to bfloat16 and widened back to float32, in place: the bits of a
 * bfloat16 result cast to float32 (SS_OUT_ROUNDED). A pass after the products, not a third
 * output kind inside their tiles: there, a run-time choice of it kept every tile's accumulators
 * on the stack (the bfloat16 values gradient at batch 256 twice as slow, measured). */
static BF_TARGET void bf_widen_rounded(float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = bf_mask(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, p + i);
        _mm512_mask_storeu_ps(p + i, m, _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf_round(v)), 16)));
    }
}

/* bf_widen_rounded over Y[row, n] = y[row * yi + n * yn] (row < rows, n < N) */
static BF_TARGET void bf_widen_rounded_2d(float *y, int64_t rows, int64_t N, int64_t yi,
                                          int64_t yn)
{
    if (yi == 1)
        for (int64_t n = 0; n < N; n++) bf_widen_rounded(y + n * yn, rows);
    else if (yn == 1)
        for (int64_t a = 0; a < rows; a++) bf_widen_rounded(y + a * yi, N);
    else
        for (int64_t a = 0; a < rows; a++)
            for (int64_t n = 0; n < N; n++) bf_widen_rounded(y + a * yi + n * yn, 1);
}

/* An output dtype of the *_bf16_to kernels: 0 (SS_DT_BF16), 1 (SS_DT_F32), 2 (SS_DT_F32 |
 * SS_OUT_ROUNDED: written as 1, then bf_widen_rounded), -1 (another) */
static inline int bf_out_kind(int dt)
{
    return dt == DT_BF16 ? 0 : dt == DT_F32 ? 1 : dt == (DT_F32 | SS_OUT_ROUNDED) ? 2 : -1;
}

/* ------------------------------------------------------------------------------------------ */
/* The batch-major product */

typedef struct {
    int64_t n_br, r, c, N, nnzb, n_bc, n_vals;
    const int64_t *crow, *col, *order;
    const uint16_t *vals;
    int64_t sp, sa, sb;
    const uint16_t *x;
    int64_t xk, xn;
    void *y; /* bfloat16, or float32 where yf32 */
    int64_t yi, yn;
    const uint16_t *bias;
    int feature_major; /* X[k, n] = x[k * xk + n], Y[row, n] = y[row * yi + n] */
    int yf32; /* Y written in float32 (the sums as they are), not rounded to bfloat16 */
    int small; /* batch-major, few rows, 16 x 16 blocks: BF_SMALL_ROWS (M's rows contiguous:
                * bf_small_tile), BF_SMALL_T (M's columns contiguous: bf_small_t_tile) */
    int64_t nt, maxq, nac, np; /* batch rows per task; blocks per row; row lanes; pairs */
    uint32_t **pack;
    int64_t **xoff;
    int err;
    /* row-tiled batch-major product (bf_tiled_product): the checked copy of the block-row
     * pointers, the group of block rows [g0, g1) now served (its blocks from qg0, packed in
     * gpk, their input offsets in gxoff), row tiles of trows rows (ntile of them) */
    const int64_t *rowp;
    int64_t g0, g1, qg0, trows, ntile;
    uint32_t *gpk;
    int64_t *gxoff;
    int vf32; /* the values are float32, rounded to bfloat16 as the small-batch tile reads
               * them (BF_SMALL_ROWS only: bf_small_tile's VF) */
} bfp_ctx;

/* The (up to) 16 rows of 16 bfloat16 at s + l * sa (rows l >= left, and the elements outside
 * mask m, read as zeros) as 8
 * vectors d[t * 16 + l] = (row l's elements 2t, 2t + 1): a 16 x 8 transpose of 32-bit pairs,
 * three rounds of two-source permutes. */
static BF_TARGET void bf_pack_rows16(const uint16_t *s, int64_t sa, int64_t left, __mmask16 m,
                                     uint32_t *d)
{
    __m512i z[8], q[8], rr[8];
    for (int k = 0; k < 8; k++) { /* (the first m elements of each row) */
        __m256i lo = 2 * k < left ? _mm256_maskz_loadu_epi16(m, s + 2 * k * sa)
                                  : _mm256_setzero_si256();
        __m256i hi = 2 * k + 1 < left ? _mm256_maskz_loadu_epi16(m, s + (2 * k + 1) * sa)
                                      : _mm256_setzero_si256();
        z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    int i1[2][16], i2[2][16], i3[2][16];
    for (int l = 0; l < 16; l++) {
        int tl = l / 4, rl = l % 4, tj = l / 8, r8 = l % 8;
        for (int h = 0; h < 2; h++) i1[h][l] = (rl < 2 ? 0 : 16) + (rl % 2) * 8 + 4 * h + tl;
        for (int p = 0; p < 2; p++) i2[p][l] = (r8 < 4 ? 0 : 16) + (2 * p + tj) * 4 + r8 % 4;
        for (int j = 0; j < 2; j++) i3[j][l] = (l < 8 ? 0 : 16) + j * 8 + l % 8;
    }
    /* q[u * 2 + h]: rows 4u .. 4u + 3, pairs 4h .. 4h + 3 (lane: pair * 4 + row) */
    for (int h = 0; h < 2; h++) {
        __m512i ix = _mm512_loadu_si512(i1[h]);
        for (int u = 0; u < 4; u++) q[u * 2 + h] = _mm512_permutex2var_epi32(z[2 * u], ix, z[2 * u + 1]);
    }
    /* rr[(v * 2 + h) * 2 + p]: rows 8v .. 8v + 7, pairs 4h + 2p, + 1 (lane: pair * 8 + row) */
    for (int p = 0; p < 2; p++) {
        __m512i ix = _mm512_loadu_si512(i2[p]);
        for (int v = 0; v < 2; v++)
            for (int h = 0; h < 2; h++)
                rr[(v * 2 + h) * 2 + p] = _mm512_permutex2var_epi32(q[(2 * v) * 2 + h], ix,
                                                                   q[(2 * v + 1) * 2 + h]);
    }
    for (int j = 0; j < 2; j++) {
        __m512i ix = _mm512_loadu_si512(i3[j]);
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 2; p++)
                _mm512_storeu_si512(d + (4 * h + 2 * p + j) * BF_LANES,
                                    _mm512_permutex2var_epi32(rr[h * 2 + p], ix,
                                                              rr[(2 + h) * 2 + p]));
    }
}

/* Block `src` (M_q[a, b] = src[a * sa + b * sb]) packed: for row chunk ac and pair t, 16
 * lanes (rows ac * 16 + l) of (M[a, 2t], M[a, 2t + 1]), zero past the block. */
static BF_TARGET void bf_pack_block(const bfp_ctx *k, const uint16_t *src, uint32_t *dst)
{
    const int64_t r = k->r, c = k->c, sa = k->sa, sb = k->sb, np = k->np;
    for (int64_t ac = 0; ac < k->nac; ac++) {
        int64_t a0 = ac * BF_LANES, left = r - a0;
        __mmask16 m = bf_mask(left);
        uint32_t *d = dst + ac * np * BF_LANES;
        const uint16_t *s = src + a0 * sa;
        if (sa == 1) { /* M's rows contiguous along a: interleave two columns */
            for (int64_t t = 0; t < np; t++) {
                __m256i lo = _mm256_maskz_loadu_epi16(m, s + 2 * t * sb);
                __m256i hi = 2 * t + 1 < c ? _mm256_maskz_loadu_epi16(m, s + (2 * t + 1) * sb)
                                           : _mm256_setzero_si256();
                _mm512_storeu_si512(d + t * BF_LANES, bf_interleave(lo, hi));
            }
        } else if (sb == 1 && c == 16) { /* 16 x 8 pairs transposed in registers */
            bf_pack_rows16(s, sa, left, (__mmask16)0xffff, d);
        } else if (sb == 1 && (c & 1) == 0) {
            /* pairs contiguous in M's rows: 32-bit moves (vpgatherdd measured slower) */
            for (int64_t l = 0; l < BF_LANES; l++) {
                const uint16_t *row = s + l * sa;
                if (l < left)
                    for (int64_t t = 0; t < np; t++) memcpy(d + t * BF_LANES + l, row + 2 * t, 4);
                else
                    for (int64_t t = 0; t < np; t++) d[t * BF_LANES + l] = 0;
            }
        } else {
            for (int64_t t = 0; t < np; t++)
                for (int64_t l = 0; l < BF_LANES; l++) {
                    uint32_t lo = 0, hi = 0;
                    if (l < left) {
                        lo = s[l * sa + 2 * t * sb];
                        if (2 * t + 1 < c) hi = s[l * sa + (2 * t + 1) * sb];
                    }
                    d[t * BF_LANES + l] = lo | (hi << 16);
                }
        }
    }
}

/* NB batch rows from n, output lanes of row chunk ac of block row i. Fewer than 8 rows: the
 * pairs of a block split over K = 8 / NB chains of accumulators (summed at the end), so that
 * a batch of 1 to 4 rows is not bound by the latency of one chain of vdpbf16ps. */
BF_INL void bf_fwd_tile(const bfp_ctx *k, const uint32_t *pk, const int64_t *xoff, int64_t nq,
                        int64_t i, int64_t ac, int64_t n, const int NB)
{
    __m512 acc[16];
    const int K = NB >= 8 ? 1 : 8 / NB;
    const int64_t a0 = ac * BF_LANES, np = k->np, c = k->c, xn = k->xn;
    __mmask16 m = bf_mask(k->r - a0);
    __m512 b0 = k->bias ? bf_widen(k->bias + i * k->r + a0, m) : _mm512_setzero_ps();
    for (int nb = 0; nb < NB; nb++) acc[nb] = b0;
    for (int nb = NB; nb < K * NB; nb++) acc[nb] = _mm512_setzero_ps();
    const int64_t full = c >> 1, stride = k->nac * np * BF_LANES;
    const uint16_t *xs = k->x + n * xn;
    const uint32_t *w = pk + ac * np * BF_LANES;
    for (int64_t qq = 0; qq < nq; qq++, w += stride) {
        const uint16_t *xb = xs + xoff[qq];
        /* the rows of this block BF_PF tiles ahead (rows a row of the input apart: the
         * hardware prefetchers miss them; harmless past the end: a hint) */
        for (int nb = 0; nb < NB; nb++)
            _mm_prefetch((const char *)(xb + (BF_PF * NB + nb) * xn), _MM_HINT_T0);
        int64_t t = 0;
        for (; t + K <= full; t += K)
            for (int kk = 0; kk < K; kk++) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (t + kk) * BF_LANES);
                for (int nb = 0; nb < NB; nb++)
                    acc[kk * NB + nb] = bf_dp_pair(acc[kk * NB + nb], wv,
                                                   xb + nb * xn + 2 * (t + kk));
            }
        for (; t < full; t++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + t * BF_LANES);
            for (int nb = 0; nb < NB; nb++) acc[nb] = bf_dp_pair(acc[nb], wv, xb + nb * xn + 2 * t);
        }
        if (c & 1) { /* the last column alone (its pair's other half is zero) */
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + full * BF_LANES);
            for (int nb = 0; nb < NB; nb++) {
                uint32_t one = xb[nb * xn + c - 1];
                acc[nb] = _mm512_dpbf16_ps(acc[nb], wv, (__m512bh)_mm512_set1_epi32((int)one));
            }
        }
    }
    for (int kk = 1; kk < K; kk++)
        for (int nb = 0; nb < NB; nb++) acc[nb] = _mm512_add_ps(acc[nb], acc[kk * NB + nb]);
    const int64_t yo = n * k->yn + i * k->r + a0, esz = k->yf32 ? 4 : 2;
    for (int nb = 0; nb < NB; nb++) bf_put(k->y, k->yf32, yo + nb * k->yn, m, acc[nb]);
    for (int nb = 0; nb < NB; nb++)
        _mm_prefetch((const char *)k->y + (yo + (NB + nb) * k->yn) * esz, _MM_HINT_T0);
}

/* Feature-major: 16 batch columns from n (cnt of them) in the lanes, the 16 rows of row chunk
 * ac of block row i; per pair t of a block, X's rows 2t, 2t + 1 interleaved in registers and
 * each row's packed pair broadcast. */
BF_INL void bf_fm_tile(const bfp_ctx *k, const uint32_t *pk, const int64_t *xoff, int64_t nq,
                       int64_t i, int64_t ac, int64_t n, int64_t cnt)
{
    __m512 acc[16];
    const int64_t a0 = ac * BF_LANES, np = k->np, c = k->c, xk = k->xk;
    const int64_t left = k->r - a0 < BF_LANES ? k->r - a0 : BF_LANES;
    const __mmask16 mn = bf_mask(cnt);
#pragma GCC unroll 16
    for (int l = 0; l < BF_LANES; l++)
        acc[l] = k->bias && l < left ? _mm512_set1_ps(bf16_to_f32(k->bias[i * k->r + a0 + l]))
                                     : _mm512_setzero_ps();
    const int64_t stride = k->nac * np * BF_LANES;
    const uint32_t *w = pk + ac * np * BF_LANES;
    for (int64_t qq = 0; qq < nq; qq++, w += stride) {
        const uint16_t *xb = k->x + xoff[qq] * xk + n;
        for (int64_t t = 0; t < np; t++) {
            __m256i hi = 2 * t + 1 < c ? _mm256_maskz_loadu_epi16(mn, xb + (2 * t + 1) * xk)
                                       : _mm256_setzero_si256();
            __m512bh xv = (__m512bh)bf_interleave(_mm256_maskz_loadu_epi16(mn, xb + 2 * t * xk),
                                                  hi);
            const uint32_t *wt = w + t * BF_LANES;
#pragma GCC unroll 16
            for (int l = 0; l < BF_LANES; l++)
                acc[l] = _mm512_dpbf16_ps(acc[l], xv, (__m512bh)_mm512_set1_epi32((int)wt[l]));
        }
    }
    const int64_t yo = (i * k->r + a0) * k->yi + n;
#pragma GCC unroll 16
    for (int l = 0; l < BF_LANES; l++)
        if (l < left) bf_put(k->y, k->yf32, yo + l * k->yi, mn, acc[l]);
}

/* lanes (i, t) of a and b summed in pairs within 128-bit lanes: [a0 + a1, a2 + a3, b0 + b1,
 * b2 + b3] per 128-bit lane */
BF_INL __m512 bf_pairsum(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* 32 float32 values at p (two rows of a 16 x 16 block) rounded to bfloat16 pairs, to nearest
 * even (vcvtne2ps2bf16): the bits torch's rounding gives (.to(torch.bfloat16)) for every normal
 * value, infinity and zero (NaN: quiet, its payload kept). A subnormal float32 value reads as
 * zero, as vdpbf16ps reads the subnormal bfloat16 torch rounds it to, but for those within
 * 2^-134 below 2^-126 (|bits| >= 0x007F8000), which torch rounds up to the smallest normal
 * bfloat16: zero here, 2^-126 through a bfloat16 copy. Making them agree (a class test and a
 * masked add per 16 values) made the batch-1 product 14 % slower (1024 x 1024, 10 % of 16 x 16
 * blocks: 5.5 -> 6.3 us); a row's sums already differ in their last bits between batch sizes. */
BF_INL __m512bh bf_round_pairs(const float *p)
{
    return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}

/* The small-batch tile: NB batch rows from n, the 16 output rows of block row i, from 16 x 16
 * blocks read in place (rows a, a + 1 of a block: one 64-byte vector, 8 per block) with the
 * input's 16 columns broadcast to both halves; acc[nb][h] lane (a - 2h) * 8 + t holds row a's
 * pair t, summed across the block row; one transpose-reduction per batch row at the end (no
 * packing: what a few batch rows cannot amortize). */
BF_INL void bf_small_tile(const bfp_ctx *k, const void *vals, const int64_t *voff,
                          const int64_t *xoff, int64_t nq, int64_t i, int64_t n, const int NB,
                          const int VF)
{
    __m512 acc[2][8];
    for (int nb = 0; nb < NB; nb++)
        for (int h = 0; h < 8; h++) acc[nb][h] = _mm512_setzero_ps();
    const uint16_t *xs = k->x + n * k->xn;
    for (int64_t qq = 0; qq < nq; qq++) {
        __m512bh wv[8];
        if (VF) { /* float32 values, rounded here */
            const float *w = (const float *)vals + voff[qq];
            for (int h = 0; h < 8; h++) wv[h] = bf_round_pairs(w + 32 * h);
        } else {
            const uint16_t *w = (const uint16_t *)vals + voff[qq];
            for (int h = 0; h < 8; h++) wv[h] = (__m512bh)_mm512_loadu_si512(w + 32 * h);
        }
        for (int nb = 0; nb < NB; nb++) {
            __m256i xr = _mm256_loadu_si256((const __m256i *)(xs + nb * k->xn + xoff[qq]));
            __m512bh xv = (__m512bh)_mm512_broadcast_i64x4(xr);
            for (int h = 0; h < 8; h++) acc[nb][h] = _mm512_dpbf16_ps(acc[nb][h], wv[h], xv);
        }
    }
    const __m512i idx = _mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
    __m512 b0 = k->bias ? bf_widen(k->bias + i * 16, (__mmask16)0xffff) : _mm512_setzero_ps();
    for (int nb = 0; nb < NB; nb++) {
        __m512 u = bf_pairsum(bf_pairsum(acc[nb][0], acc[nb][1]), bf_pairsum(acc[nb][2], acc[nb][3]));
        __m512 v = bf_pairsum(bf_pairsum(acc[nb][4], acc[nb][5]), bf_pairsum(acc[nb][6], acc[nb][7]));
        __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xDD));
        __m512 out = _mm512_add_ps(_mm512_permutexvar_ps(idx, sum), b0);
        bf_put(k->y, k->yf32, (n + nb) * k->yn + i * 16, (__mmask16)0xffff, out);
    }
}

/* The small-batch tile of a transposed product (a SparseLinear's gradient to the input: M =
 * W.T, 16 x 16 blocks stored row by row, so M_q[a, b] = w[b * 16 + a]): NB batch rows from n,
 * the 16 output rows of block row i. Per pair t of a block, M's columns 2t, 2t + 1 (W's rows:
 * two 32-byte loads) interleaved in registers, no packing (what a few batch rows cannot
 * amortize); fewer than 8 rows: the pairs split over K = 8 / NB chains of accumulators, summed
 * at the end (a chain of vdpbf16ps per row would be bound by its latency). */
BF_INL void bf_small_t_tile(const bfp_ctx *k, const int64_t *voff, const int64_t *xoff,
                            int64_t nq, int64_t i, int64_t n, const int NB)
{
    __m512 acc[16];
    const int K = NB >= 8 ? 1 : 8 / NB;
    for (int u = 0; u < K * NB; u++) acc[u] = _mm512_setzero_ps();
    const int64_t xn = k->xn;
    const uint16_t *xs = k->x + n * xn;
    for (int64_t qq = 0; qq < nq; qq++) {
        const uint16_t *w = k->vals + voff[qq], *xb = xs + xoff[qq];
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m512bh wv = (__m512bh)bf_interleave(_mm256_loadu_si256((const __m256i *)(w + 32 * t)),
                                                  _mm256_loadu_si256((const __m256i *)(w + 32 * t + 16)));
            const int kk = t % K;
            for (int nb = 0; nb < NB; nb++) {
                uint32_t pair;
                memcpy(&pair, xb + nb * xn + 2 * t, 4);
                acc[kk * NB + nb] = _mm512_dpbf16_ps(acc[kk * NB + nb], wv,
                                                     (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
    }
    for (int kk = 1; kk < K; kk++)
        for (int nb = 0; nb < NB; nb++) acc[nb] = _mm512_add_ps(acc[nb], acc[kk * NB + nb]);
    __m512 b0 = k->bias ? bf_widen(k->bias + i * 16, (__mmask16)0xffff) : _mm512_setzero_ps();
    for (int nb = 0; nb < NB; nb++)
        bf_put(k->y, k->yf32, (n + nb) * k->yn + i * 16, (__mmask16)0xffff,
               _mm512_add_ps(acc[nb], b0));
}

static BF_TARGET void bf_fwd_task(void *vctx, int64_t task, int tid)
{
    bfp_ctx *k = (bfp_ctx *)vctx;
    int64_t chunk = task / k->n_br, i = task % k->n_br;
    int64_t n0 = chunk * k->nt, nt = k->N - n0 < k->nt ? k->N - n0 : k->nt;
    int64_t q0 = k->crow[i], q1 = k->crow[i + 1];
    if (q0 < 0 || q1 < q0 || q1 > k->nnzb || q1 - q0 > k->maxq) {
        __atomic_store_n(&k->err, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t nq = q1 - q0;
    uint32_t *pk = k->pack[tid];
    int64_t *xoff = k->xoff[tid];
    const int64_t blk = k->nac * k->np * BF_LANES;
    for (int64_t qq = 0; qq < nq; qq++) {
        int64_t p = k->order ? k->order[q0 + qq] : q0 + qq;
        int64_t j = k->col[q0 + qq];
        if (p < 0 || p >= k->n_vals || j < 0 || j >= k->n_bc) {
            __atomic_store_n(&k->err, 1, __ATOMIC_RELAXED);
            return;
        }
        xoff[qq] = j * k->c;
        if (k->small)
            ((int64_t *)pk)[qq] = p * k->sp;
        else
            bf_pack_block(k, k->vals + p * k->sp, pk + qq * blk);
    }
    if (k->small == BF_SMALL_T) {
        const int64_t *voff = (const int64_t *)pk;
        int64_t n = n0, end = n0 + nt;
        for (; n + 16 <= end; n += 16) bf_small_t_tile(k, voff, xoff, nq, i, n, 16);
        if (n + 8 <= end) { bf_small_t_tile(k, voff, xoff, nq, i, n, 8); n += 8; }
        if (n + 4 <= end) { bf_small_t_tile(k, voff, xoff, nq, i, n, 4); n += 4; }
        if (n + 2 <= end) { bf_small_t_tile(k, voff, xoff, nq, i, n, 2); n += 2; }
        if (n < end) bf_small_t_tile(k, voff, xoff, nq, i, n, 1);
        return;
    }
    if (k->small) {
        int64_t *voff = (int64_t *)pk;
        const void *vals = k->vals;
        int64_t n = n0;
        if (k->vf32 && nt <= 2) { /* float32 values rounded in the tile, as read */
            if (nt == 2) bf_small_tile(k, vals, voff, xoff, nq, i, n, 2, 1);
            else bf_small_tile(k, vals, voff, xoff, nq, i, n, 1, 1);
            return;
        }
        if (k->vf32) { /* more rows: the block row's blocks rounded once, into the task's
                        * buffer after its offsets (bf_product_to sized it), then read there */
            uint16_t *cv = (uint16_t *)(voff + k->maxq);
            for (int64_t qq = 0; qq < nq; qq++) {
                const float *w = (const float *)(const void *)k->vals + voff[qq];
                for (int h = 0; h < 8; h++)
                    _mm512_storeu_si512(cv + qq * 256 + 32 * h, (__m512i)bf_round_pairs(w + 32 * h));
                voff[qq] = qq * 256;
            }
            vals = cv;
        }
        for (; n + 2 <= n0 + nt; n += 2) bf_small_tile(k, vals, voff, xoff, nq, i, n, 2, 0);
        if (n < n0 + nt) bf_small_tile(k, vals, voff, xoff, nq, i, n, 1, 0);
        return;
    }
    /* feature-major (batch-major products past the small-batch tiles: bf_tiled_product) */
    for (int64_t ac = 0; ac < k->nac; ac++)
        for (int64_t n = n0; n < n0 + nt; n += BF_LANES)
            bf_fm_tile(k, pk, xoff, nq, i, ac, n, n0 + nt - n);
}

/* The row-tiled batch-major product: the blocks of a group of block rows packed once (each
 * block row's blocks by one task), then tasks of trows batch rows that run every block row of
 * the group, so that the tile of X and of Y stays in cache across the block rows and the
 * packed group (sized for L2) is read from cache by every tile. The rows of X come in by the
 * tile's own prefetch, BF_PF tiles ahead in each block's columns (bf_fwd_tile). A prefetch of
 * the next row tile's lines, a share per block row, was never emitted (GCC deletes a loop of
 * prefetch hints and nothing else) and, emitted as volatile assembly, made the product 5-10 %
 * slower, warm or after a cache flush (batch 256, 1024 x 1024 BSR 16 x 16, 5-25 %): removed. */
static BF_TARGET void bf_gpack_task(void *vctx, int64_t t, int tid)
{
    (void)tid;
    bfp_ctx *k = (bfp_ctx *)vctx;
    const int64_t i = k->g0 + t, blk = k->nac * k->np * BF_LANES;
    for (int64_t q = k->rowp[i]; q < k->rowp[i + 1]; q++) {
        int64_t p = k->order ? k->order[q] : q;
        int64_t j = k->col[q];
        if (p < 0 || p >= k->n_vals || j < 0 || j >= k->n_bc) {
            __atomic_store_n(&k->err, 1, __ATOMIC_RELAXED);
            return;
        }
        k->gxoff[q - k->qg0] = j * k->c;
        bf_pack_block(k, k->vals + p * k->sp, k->gpk + (q - k->qg0) * blk);
    }
}

static BF_TARGET void bf_tile_task(void *vctx, int64_t t, int tid)
{
    (void)tid;
    const bfp_ctx *k = (const bfp_ctx *)vctx;
    const int64_t n0 = t * k->trows, n1 = n0 + k->trows < k->N ? n0 + k->trows : k->N;
    const int64_t blk = k->nac * k->np * BF_LANES;
    for (int64_t i = k->g0; i < k->g1; i++) {
        const int64_t q0 = k->rowp[i], nq = k->rowp[i + 1] - q0;
        const uint32_t *pk = k->gpk + (q0 - k->qg0) * blk;
        const int64_t *xoff = k->gxoff + (q0 - k->qg0);
        for (int64_t ac = 0; ac < k->nac; ac++)
            for (int64_t n = n0; n < n1;) {
                int64_t left = n1 - n;
                if (left >= BF_NB && BF_NB == 16) { bf_fwd_tile(k, pk, xoff, nq, i, ac, n, 16); n += 16; }
                else if (left >= 8) { bf_fwd_tile(k, pk, xoff, nq, i, ac, n, 8); n += 8; }
                else if (left >= 4) { bf_fwd_tile(k, pk, xoff, nq, i, ac, n, 4); n += 4; }
                else if (left >= 2) { bf_fwd_tile(k, pk, xoff, nq, i, ac, n, 2); n += 2; }
                else { bf_fwd_tile(k, pk, xoff, nq, i, ac, n, 1); n += 1; }
            }
    }
}

#ifndef BF_TROWS
#define BF_TROWS 32 /* batch rows per tile of the row-tiled product */
#endif
#ifndef BF_GROUP_BYTES
#define BF_GROUP_BYTES (512 << 10) /* packed blocks per group of block rows (L2 share) */
#endif

/* The row-tiled batch-major product (k set up by ss_product_bf16_to): 0, -2 (out of memory)
 * or SS_EINDEX. The block-row pointers are copied and checked once; only the copy is used. */
static int bf_tiled_product(bfp_ctx *k, int nthreads)
{
    const int64_t n_br = k->n_br, blk = k->nac * k->np * BF_LANES;
    int64_t *rowp = (int64_t *)malloc((size_t)(n_br + 1) * sizeof(int64_t));
    if (!rowp) return -2;
    int64_t most = 0, gq = 0; /* the largest group's blocks */
    for (int64_t i = 0; i <= n_br; i++) rowp[i] = __atomic_load_n(&k->crow[i], __ATOMIC_RELAXED);
    for (int64_t i = 0; i < n_br; i++) {
        int64_t q0 = rowp[i], q1 = rowp[i + 1];
        if (q0 < 0 || q1 < q0 || q1 > k->nnzb) {
            free(rowp);
            return SS_EINDEX;
        }
        if (gq > 0 && (gq + q1 - q0) * blk * 4 > BF_GROUP_BYTES) gq = 0;
        gq += q1 - q0;
        if (gq > most) most = gq;
    }
    int64_t trows = BF_TROWS;
    if (nthreads > 1 && (k->N + trows - 1) / trows < 4 * nthreads) {
        trows = (k->N + 4 * nthreads - 1) / (4 * nthreads);
        trows = trows < 8 ? 8 : (trows + 7) / 8 * 8;
    }
    k->rowp = rowp;
    k->trows = trows;
    k->ntile = (k->N + trows - 1) / trows;
    k->gpk = (uint32_t *)malloc((size_t)(most > 0 ? most : 1) * (size_t)blk * 4);
    k->gxoff = (int64_t *)malloc((size_t)(most > 0 ? most : 1) * sizeof(int64_t));
    int rc = 0;
    if (!k->gpk || !k->gxoff) rc = -2;
    for (int64_t g0 = 0; g0 < n_br && rc == 0;) {
        int64_t g1 = g0 + 1;
        while (g1 < n_br && (rowp[g1 + 1] - rowp[g0]) * blk * 4 <= BF_GROUP_BYTES) g1++;
        k->g0 = g0;
        k->g1 = g1;
        k->qg0 = rowp[g0];
        run_tasks(bf_gpack_task, k, g1 - g0, nthreads);
        if (k->err) { rc = SS_EINDEX; break; }
        run_tasks(bf_tile_task, k, k->ntile, nthreads);
        g0 = g1;
    }
    free(k->gpk);
    free(k->gxoff);
    free(rowp);
    return rc;
}

/* Y[row, n] = bias[row] + sum_q sum_b M_q[a, b] X[col_q * c + b, n] (row = i * r + a), all in
 * bfloat16 with float32 sums: M stored by block rows (n_br of them, blocks r x c), block q of
 * row i (crow[i] <= q < crow[i+1] <= nnzb) at block column col[q] < n_bc with the values
 * vals[p * sp + a * sa + b * sb], p = order[q] (or q) < n_vals. X[k, n] = x[k * xk + n * xn],
 * Y[row, n] = y[row * yi + n * yn] (written whole), bias nullable (bfloat16); batch-major
 * (xk == yi == 1) or feature-major (xn == yn == 1). Returns 0, -1 (no bfloat16 kernels on this
 * CPU, or operands neither batch- nor feature-major), -2 (out of memory), SS_EINDEX (an index
 * out of range: y is then partly written). ss_product_bf16_to: the same, Y in the dtype ydt
 * (SS_DT_BF16, or SS_DT_F32: the float32 sums as they are, no rounding; or SS_DT_F32 |
 * SS_OUT_ROUNDED: the bfloat16 result widened to float32, the bits a cast of it gives: a float32
 * layer's gradient to its input under bfloat16 autocast, no bfloat16 copy cast afterwards). */
static int bf_product_to(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                         const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                         const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                         const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int yout,
                         int64_t yi, int64_t yn, const void *bias, int vf32, int nthreads);

/* ss_product_bf16_to; where vf32, the values are float32, rounded to bfloat16 as they are
 * read (the small-batch tile of M's rows, 16 x 16 blocks: -1 elsewhere), with the bits of the
 * product over their bfloat16 copy but for a band of subnormals (bf_round_pairs); the bias
 * bfloat16 (ss_product_packed rounds a float32 one, SS_VALS_F32) */
static int bf_product_any(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                          const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                          const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                          const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int ydt,
                          int64_t yi, int64_t yn, const void *bias, int vf32, int nthreads)
{
    int yout = bf_out_kind(ydt);
    if (!ss_bf16_supported() || yout < 0) return -1;
    int rc = bf_product_to(n_br, r, c, crow, col, order, nnzb, n_bc, vals, n_vals, sp, sa, sb, x,
                           xk, xn, N, y, yout == 2 ? 1 : yout, yi, yn, bias, vf32, nthreads);
    if (rc == 0 && yout == 2 && N > 0 && n_br > 0)
        bf_widen_rounded_2d((float *)y, n_br * r, N, yi, yn);
    return rc;
}

int ss_product_bf16_to(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                       const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                       const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                       const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int ydt,
                       int64_t yi, int64_t yn, const void *bias, int nthreads)
{
    return bf_product_any(n_br, r, c, crow, col, order, nnzb, n_bc, vals, n_vals, sp, sa, sb, x,
                          xk, xn, N, y, ydt, yi, yn, bias, 0, nthreads);
}

/* ss_product_bf16_to's products, Y written in bfloat16 (yout 0) or float32 (1) */
static int bf_product_to(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                         const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                         const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                         const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int yout,
                         int64_t yi, int64_t yn, const void *bias, int vf32, int nthreads)
{
    int fm = !(xk == 1 && yi == 1);
    if (fm && !(xn == 1 && yn == 1)) return -1;
    if (N <= 0 || n_br <= 0) return 0;
    if (r <= 0 || c <= 0) return -1;
    if (!order && nnzb > n_vals) return SS_EINDEX;
    int64_t maxq = 0;
    for (int64_t i = 0; i < n_br; i++) {
        int64_t q0 = crow[i], q1 = crow[i + 1];
        if (q0 < 0 || q1 < q0 || q1 > nnzb) return SS_EINDEX;
        if (q1 - q0 > maxq) maxq = q1 - q0;
    }
    if (nthreads < 1) nthreads = 1;
    bfp_ctx k = {n_br, r, c, N, nnzb, n_bc, n_vals, crow, col, order, (const uint16_t *)vals,
                 sp, sa, sb, (const uint16_t *)x, xk, xn, y, yi, yn,
                 (const uint16_t *)bias, fm, yout, 0, 0, maxq,
                 (r + BF_LANES - 1) / BF_LANES, (c + 1) / 2, 0, 0, 0};
    if (!fm && N <= BF_SMALL_N && r == 16 && c == 16 && sa == 16 && sb == 1) k.small = BF_SMALL_ROWS;
    if (!fm && N <= BF_SMALL_T_N && r == 16 && c == 16 && sa == 1 && sb == 16) k.small = BF_SMALL_T;
    if (vf32) { /* float32 values: the small-batch tile of M's rows only */
        if (k.small != BF_SMALL_ROWS) return -1;
        k.vf32 = 1;
    }
    if (!fm && !k.small) return bf_tiled_product(&k, nthreads < 256 ? nthreads : 256);
    /* feature-major and small batches: tasks of block rows. Batch rows per task: 256 (a chunk
     * of the input stays in L2 while every block row reads
     * it), fewer where the block rows alone do not give each thread several tasks */
    int64_t nt = N < BF_ROWS ? N : BF_ROWS;
    if (nthreads > 1 && n_br < 4 * nthreads) {
        int64_t per = (4 * nthreads + n_br - 1) / n_br;
        int64_t want = (N + per - 1) / per;
        want = (want + 15) / 16 * 16;
        if (want < nt) nt = want;
    }
    k.nt = nt;
    int64_t ntasks = ((N + nt - 1) / nt) * n_br;
    int nth = nthreads < ntasks ? nthreads : (int)ntasks;
    if (nth > 256) nth = 256;
    uint32_t *packs[256];
    int64_t *offs[256];
    size_t q = (size_t)(maxq > 0 ? maxq : 1);
    int ok = 1;
    /* (float32 values: each block's offset, then its bfloat16 rounding: 8 + 512 bytes) */
    size_t per = k.vf32 ? 8 + 512 : (size_t)(k.nac * k.np * BF_LANES) * 4;
    for (int t = 0; t < nth; t++) {
        packs[t] = (uint32_t *)malloc(q * per);
        offs[t] = (int64_t *)malloc(q * sizeof(int64_t));
        if (!packs[t] || !offs[t]) ok = 0;
    }
    if (ok) {
        k.pack = packs;
        k.xoff = offs;
        run_tasks(bf_fwd_task, &k, ntasks, nth);
    }
    for (int t = 0; t < nth; t++) { free(packs[t]); free(offs[t]); }
    if (!ok) return -2;
    return k.err ? SS_EINDEX : 0;
}

int ss_product_bf16(int64_t n_br, int64_t r, int64_t c, const int64_t *crow, const int64_t *col,
                    const int64_t *order, int64_t nnzb, int64_t n_bc, const void *vals,
                    int64_t n_vals, int64_t sp, int64_t sa, int64_t sb, const void *x,
                    int64_t xk, int64_t xn, int64_t N, void *y, int64_t yi, int64_t yn,
                    const void *bias, int nthreads)
{
    return ss_product_bf16_to(n_br, r, c, crow, col, order, nnzb, n_bc, vals, n_vals, sp, sa,
                              sb, x, xk, xn, N, y, DT_BF16, yi, yn, bias, nthreads);
}

/* the values gradient and the column sums */
#include "kern_bf16_grad.h"

#undef BF_TARGET
#undef BF_INL
#undef BF_LANES
#else  /* not x86-64: no bfloat16 kernels (the callers keep their float32 route) */
int ss_bf16_supported(void) { return 0; }
static int bf_product_any(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                          const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                          const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                          const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int ydt,
                          int64_t yi, int64_t yn, const void *bias, int vf32, int nthreads)
{
    return -1;
}
int ss_colsum_bf16(const void *g, int64_t N, int64_t C, int64_t ld, void *out, int odt,
                   int nthreads)
{
    return -1;
}
int ss_product_bf16_to(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                       const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                       const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                       const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int ydt,
                       int64_t yi, int64_t yn, const void *bias, int nthreads)
{
    return -1;
}
int ss_values_grad_bf16_to(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows,
                           const int64_t *cols, int64_t n_br, int64_t n_bc, const void *l,
                           int64_t li, int64_t ln, const void *rgt, int64_t ri, int64_t rn,
                           int64_t N, void *g, int gdt, int nthreads)
{
    return -1;
}
int ss_product_bf16(int64_t n_br, int64_t r, int64_t c, const int64_t *crow, const int64_t *col,
                    const int64_t *order, int64_t nnzb, int64_t n_bc, const void *vals,
                    int64_t n_vals, int64_t sp, int64_t sa, int64_t sb, const void *x,
                    int64_t xk, int64_t xn, int64_t N, void *y, int64_t yi, int64_t yn,
                    const void *bias, int nthreads)
{
    return -1;
}
int ss_values_grad_bf16(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows,
                        const int64_t *cols, int64_t n_br, int64_t n_bc, const void *l,
                        int64_t li, int64_t ln, const void *rgt, int64_t ri, int64_t rn,
                        int64_t N, void *g, int nthreads)
{
    return -1;
}
#endif /* SS_X86 */
