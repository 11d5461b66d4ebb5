/* bfloat16 computed in bfloat16, the gradients: the values gradient (ss_values_grad_bf16_to,
 * ss_values_grad_bf16) and the column sums (ss_colsum_bf16, a SparseLinear's bias gradient).
 * Included once by kern_bf16.h inside its x86-64 section, after the products: it uses that
 * header's target attribute, masks, conversions and stores (BF_TARGET, bf_mask, bf_widen,
 * bf_put, bf_widen_rounded, bf_out_kind) and blockprod.c's parallel region (run_tasks). The
 * same defence in depth: every block index is checked against its dimension as it is read; one
 * out of range returns SS_EINDEX, never an out-of-bounds read. */
/* ------------------------------------------------------------------------------------------ */
/* The values gradient */

typedef struct {
    int64_t r, c, N, n_br, n_bc, nac, npairs;
    const int64_t *rows, *cols, *starts;
    const uint16_t *l;
    int64_t li, ln;
    const uint16_t *rgt;
    int64_t ri, rn;
    int dot; /* operands contiguous along the batch (ln == rn == 1), not across it */
    void *g;
    int gf32; /* G written in float32 (the sums as they are; 2: their bfloat16 rounding
               * widened, by bf_vg_store), not rounded to bfloat16 */
    uint32_t **pairs;
    int err;
    /* batch-major, large batches: the rows [n0, n1) of one pass; sums of the earlier passes
     * kept in float32 in acc (nnzb r x c; null: one pass), the first pass starts from zero,
     * the last one rounds into g */
    int64_t n0, n1;
    float *acc;
    int first, last;
    int64_t nnzb_all; /* the stored blocks (the next block's prefetch stays below) */
} bfv_ctx;

/* A values-gradient tile's RT rows of sums (out: 16 floats a row) to G at go (rows c apart), in
 * float32 or rounded to bfloat16, whole vectors unmasked (a masked store costs several plain
 * ones on Zen 4: the values gradient at batch 1 1.5x slower, measured). Out of line, after the
 * tile stored its accumulators: any store choice inlined into the tile (unmasked or not,
 * float32 or not) made GCC keep its accumulators on the stack, the values gradient at batch 256
 * twice as slow (measured). */
static __attribute__((noinline)) BF_TARGET void bf_vg_store(const bfv_ctx *k, int64_t go,
                                                           __mmask16 mb, const float *out,
                                                           int RT)
{
    for (int ra = 0; ra < RT; ra++) {
        __m512 v = _mm512_load_ps(out + 16 * ra);
        int64_t off = go + ra * k->c;
        if (k->gf32 == 2) /* (SS_OUT_ROUNDED: the bfloat16 rounding, widened, in the store) */
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf_round(v)), 16));
        if (mb != (__mmask16)0xffff)
            bf_put(k->g, k->gf32 != 0, off, mb, v);
        else if (k->gf32)
            _mm512_storeu_ps((float *)k->g + off, v);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)k->g + off), bf_round(v));
    }
}

#ifndef BF_VG_AHEAD
#define BF_VG_AHEAD 6 /* rows of R ahead the values gradient prefetches: R's rows are a row of
                       * the input apart (2 KiB for 1024 features: every row of a column in
                       * the same two L1 sets), so lines fetched 16 rows ahead were evicted
                       * before their use; 6 measured best (4 to 8 alike; the values gradient
                       * 3-5 % faster than at 16, batch 256, 1024 x 1024, 5 to 25 %) */
#endif

/* RT rows x the lanes of columns b0 .. (mask mb) of one block over the pass's batch rows:
 * L's pairs read from the run's packed buffer (lpair[t * 16 + ra]: rows n0 + 2t, + 1), R's
 * pair interleaved in registers (rp: R at row n0); the sums start from the earlier passes' (ap,
 * float32) and go to ap, or rounded to gp in the last pass. */
BF_INL void bf_vg_tile(const bfv_ctx *k, const uint32_t *lpair, const uint16_t *rp,
                       int64_t go, float *ap, __mmask16 mb, const uint16_t *nrp,
                       const uint16_t *nlp, const int RT)
{
    __m512 acc[16];
    if (k->first)
        for (int ra = 0; ra < RT; ra++) acc[ra] = _mm512_setzero_ps();
    else
        for (int ra = 0; ra < RT; ra++) acc[ra] = _mm512_maskz_loadu_ps(mb, ap + ra * k->c);
    const int64_t N = k->n1 - k->n0, rn = k->rn, full = N >> 1;
    int64_t t = 0;
    for (; t < full; t++, rp += 2 * rn, lpair += BF_LANES) {
        /* R's rows are strided (a row of the input apart): the hardware prefetchers stop at
         * page boundaries, so fetch BF_VG_AHEAD rows ahead (harmless past the end: a hint) */
        _mm_prefetch((const char *)(rp + BF_VG_AHEAD * rn), _MM_HINT_T0);
        _mm_prefetch((const char *)(rp + (BF_VG_AHEAD + 1) * rn), _MM_HINT_T0);
        /* the next block's rows of R and the next run's rows of L, two of each per pair of
         * rows: a block's time ahead (what a read from memory takes), not 16 rows */
        if (nrp) {
            _mm_prefetch((const char *)(nrp + 2 * t * rn), _MM_HINT_T0);
            _mm_prefetch((const char *)(nrp + (2 * t + 1) * rn), _MM_HINT_T0);
        }
        if (nlp) {
            _mm_prefetch((const char *)(nlp + 2 * t * k->ln), _MM_HINT_T0);
            _mm_prefetch((const char *)(nlp + (2 * t + 1) * k->ln), _MM_HINT_T0);
        }
        __m512bh xv = (__m512bh)bf_interleave(_mm256_maskz_loadu_epi16(mb, rp),
                                              _mm256_maskz_loadu_epi16(mb, rp + rn));
        for (int ra = 0; ra < RT; ra++) acc[ra] = bf_dp_pair(acc[ra], xv, lpair + ra);
    }
    if (N & 1) { /* the last batch row alone */
        __m512bh xv = (__m512bh)bf_interleave(_mm256_maskz_loadu_epi16(mb, rp),
                                              _mm256_setzero_si256());
        for (int ra = 0; ra < RT; ra++)
            acc[ra] = _mm512_dpbf16_ps(acc[ra], xv, (__m512bh)_mm512_set1_epi32((int)lpair[ra]));
    }
    if (k->last) { /* (through a buffer: see bf_vg_store) */
        float out[16 * 16] __attribute__((aligned(64)));
        for (int ra = 0; ra < RT; ra++) _mm512_store_ps(out + 16 * ra, acc[ra]);
        bf_vg_store(k, go, mb, out, RT);
    } else
        for (int ra = 0; ra < RT; ra++) _mm512_mask_storeu_ps(ap + ra * k->c, mb, acc[ra]);
}

/* Dot form (both operands contiguous along the batch): RT rows from lp (L's row a0), the
 * lanes of R's rows from rp (bleft of them, mask mb); per 16 batch columns R's panel is
 * transposed into pairs (in registers, through a 1 KiB buffer) and L's pairs, contiguous,
 * are broadcast from memory. */
BF_INL void bf_vgd_tile(const bfv_ctx *k, const uint16_t *lp, const uint16_t *rp,
                        int64_t bleft, int64_t go, __mmask16 mb, const int RT)
{
    __m512 acc[16];
    uint32_t tr[8 * BF_LANES] __attribute__((aligned(64)));
    for (int ra = 0; ra < RT; ra++) acc[ra] = _mm512_setzero_ps();
    const int64_t N = k->N, li = k->li;
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        int64_t cnt = N - n0 < 16 ? N - n0 : 16, full = cnt >> 1;
        bf_pack_rows16(rp + n0, k->ri, bleft, bf_mask(cnt), tr);
        for (int64_t t = 0; t < full; t++) {
            __m512bh xv = (__m512bh)_mm512_load_si512(tr + t * BF_LANES);
            for (int ra = 0; ra < RT; ra++) {
                uint32_t pair;
                memcpy(&pair, lp + ra * li + n0 + 2 * t, 4);
                acc[ra] = _mm512_dpbf16_ps(acc[ra], xv, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
        if (cnt & 1) { /* the last batch column alone */
            __m512bh xv = (__m512bh)_mm512_load_si512(tr + full * BF_LANES);
            for (int ra = 0; ra < RT; ra++) {
                uint32_t one = lp[ra * li + n0 + cnt - 1];
                acc[ra] = _mm512_dpbf16_ps(acc[ra], xv, (__m512bh)_mm512_set1_epi32((int)one));
            }
        }
    }
    for (int ra = 0; ra < RT; ra++) bf_put(k->g, k->gf32, go + ra * k->c, mb, acc[ra]);
}

static BF_TARGET void bf_vgd_block(const bfv_ctx *k, int64_t p, int64_t i, int64_t j)
{
    const int64_t r = k->r, c = k->c;
    const int64_t g = p * r * c;
    for (int64_t b0 = 0; b0 < c; b0 += BF_LANES) {
        int64_t bleft = c - b0 < BF_LANES ? c - b0 : BF_LANES;
        __mmask16 mb = bf_mask(bleft);
        const uint16_t *rp = k->rgt + (j * c + b0) * k->ri;
        for (int64_t a0 = 0; a0 < r;) {
            int64_t left = r - a0;
            const uint16_t *lp = k->l + (i * r + a0) * k->li;
            const int64_t gp = g + a0 * c + b0;
            if (left >= 16) { bf_vgd_tile(k, lp, rp, bleft, gp, mb, 16); a0 += 16; }
            else if (left >= 8) { bf_vgd_tile(k, lp, rp, bleft, gp, mb, 8); a0 += 8; }
            else if (left >= 4) { bf_vgd_tile(k, lp, rp, bleft, gp, mb, 4); a0 += 4; }
            else if (left >= 2) { bf_vgd_tile(k, lp, rp, bleft, gp, mb, 2); a0 += 2; }
            else { bf_vgd_tile(k, lp, rp, bleft, gp, mb, 1); a0 += 1; }
        }
    }
}

/* One run of blocks with the same block row (consecutive in stored order: a BSR matrix's
 * block rows): L's rows of that block row packed once in pairs along the batch (contiguous,
 * read by every block of the run), then each block. */
static BF_TARGET void bf_vg_task(void *vctx, int64_t run, int tid)
{
    bfv_ctx *k = (bfv_ctx *)vctx;
    const int64_t p0 = k->starts[run], p1 = k->starts[run + 1];
    const int64_t r = k->r, c = k->c, n0 = k->n0, N = k->n1, ln = k->ln, np = k->npairs;
    int64_t i = k->rows[p0];
    if (i < 0 || i >= k->n_br) {
        __atomic_store_n(&k->err, 1, __ATOMIC_RELAXED);
        return;
    }
    if (k->dot) {
        for (int64_t p = p0; p < p1; p++) {
            int64_t j = k->cols[p];
            if (j < 0 || j >= k->n_bc) {
                __atomic_store_n(&k->err, 1, __ATOMIC_RELAXED);
                return;
            }
            bf_vgd_block(k, p, i, j);
        }
        return;
    }
    uint32_t *buf = k->pairs[tid];
    for (int64_t ac = 0; ac < k->nac; ac++) {
        __mmask16 ma = bf_mask(r - ac * BF_LANES);
        const uint16_t *lp = k->l + i * r + ac * BF_LANES;
        uint32_t *d = buf + ac * np * BF_LANES;
        for (int64_t t = 0; t < np; t++) {
            int64_t n = n0 + 2 * t;
            if (n >= N) break;
            __m256i hi = n + 1 < N ? _mm256_maskz_loadu_epi16(ma, lp + (n + 1) * ln)
                                   : _mm256_setzero_si256();
            _mm512_storeu_si512(d + t * BF_LANES,
                                bf_interleave(_mm256_maskz_loadu_epi16(ma, lp + n * ln), hi));
        }
    }
    for (int64_t p = p0; p < p1; p++) {
        int64_t j = k->cols[p];
        if (j < 0 || j >= k->n_bc) {
            __atomic_store_n(&k->err, 1, __ATOMIC_RELAXED);
            return;
        }
        const int64_t g = p * r * c;
        float *ab = k->acc ? k->acc + p * r * c : 0;
        /* prefetch targets (hints: never read; an index out of range gives none) */
        const uint16_t *nrp = 0, *nlp = 0;
        if (p + 1 < k->nnzb_all) {
            int64_t jn = __atomic_load_n(&k->cols[p + 1], __ATOMIC_RELAXED);
            if (jn >= 0 && jn < k->n_bc) nrp = k->rgt + n0 * k->rn + jn * c;
        }
        if (p == p0 && p1 < k->nnzb_all) {
            int64_t in = __atomic_load_n(&k->rows[p1], __ATOMIC_RELAXED);
            if (in >= 0 && in < k->n_br) nlp = k->l + in * r + n0 * ln;
        }
        for (int64_t b0 = 0; b0 < c; b0 += BF_LANES) {
            __mmask16 mb = bf_mask(c - b0);
            const uint16_t *rp = k->rgt + n0 * k->rn + j * c + b0;
            for (int64_t a0 = 0; a0 < r;) {
                int64_t left = r - a0;
                const uint32_t *lpair = buf + (a0 / BF_LANES) * np * BF_LANES + a0 % BF_LANES;
                const int64_t gp = g + a0 * c + b0;
                float *ap = ab ? ab + a0 * c + b0 : 0;
                int64_t lane_left = BF_LANES - a0 % BF_LANES;
                if (left > lane_left) left = lane_left;
                if (a0 > 0 || b0 > 0) nrp = nlp = 0; /* (the block's first tile) */
                if (left >= 16) { bf_vg_tile(k, lpair, rp, gp, ap, mb, nrp, nlp, 16); a0 += 16; }
                else if (left >= 8) { bf_vg_tile(k, lpair, rp, gp, ap, mb, nrp, nlp, 8); a0 += 8; }
                else if (left >= 4) { bf_vg_tile(k, lpair, rp, gp, ap, mb, nrp, nlp, 4); a0 += 4; }
                else if (left >= 2) { bf_vg_tile(k, lpair, rp, gp, ap, mb, nrp, nlp, 2); a0 += 2; }
                else { bf_vg_tile(k, lpair, rp, gp, ap, mb, nrp, nlp, 1); a0 += 1; }
            }
        }
    }
}

/* G_p[a, b] = sum_n L[rows[p] * r + a, n] * R[cols[p] * c + b, n] for p < nnzb, G contiguous
 * (nnzb, r, c) in bfloat16 (float32 sums); L[k, n] = l[k * li + n * ln] (rows[p] < n_br),
 * R[k, n] = rgt[k * ri + n * rn] (cols[p] < n_bc), both bfloat16, batch-major (li == ri == 1)
 * or contiguous along the batch (ln == rn == 1). Returns 0, -1 (no bfloat16 kernels on this
 * CPU, or other strides), -2 (out of memory), SS_EINDEX (an index out of range: g is then
 * partly written). ss_values_grad_bf16_to: the same, G in the dtype gdt (SS_DT_BF16, SS_DT_F32:
 * the float32 sums as they are, or SS_DT_F32 | SS_OUT_ROUNDED: the bfloat16 result widened, as
 * a float32 layer's values gradient under bfloat16 autocast reaches it). */
int ss_values_grad_bf16_to(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows,
                           const int64_t *cols, int64_t n_br, int64_t n_bc, const void *l,
                           int64_t li, int64_t ln, const void *rgt, int64_t ri, int64_t rn,
                           int64_t N, void *g, int gdt, int nthreads)
{
    int gout = bf_out_kind(gdt);
    if (!ss_bf16_supported() || gout < 0) return -1;
    int dot = !(li == 1 && ri == 1);
    if (dot && !(ln == 1 && rn == 1)) return -1;
    if (r <= 0 || c <= 0) return -1;
    if (nnzb <= 0) return 0;
    if (N <= 0) {
        memset(g, 0, (size_t)(nnzb * r * c) * (gout ? 4 : 2));
        return 0;
    }
    /* runs of blocks with the same block row, at most 64 blocks each (work to share) */
    int64_t *starts = (int64_t *)malloc((size_t)(nnzb + 1) * sizeof(int64_t));
    if (!starts) return -2;
    int64_t nruns = 0;
    for (int64_t p = 0; p < nnzb; p++)
        if (p == 0 || rows[p] != rows[p - 1] || p - starts[nruns - 1] >= 64) starts[nruns++] = p;
    starts[nruns] = nnzb;
    if (nthreads < 1) nthreads = 1;
    int nth = nthreads < nruns ? nthreads : (int)nruns;
    if (nth > 256) nth = 256;
    /* batch-major: passes of BF_VG_ROWS batch rows (the pass's rows of L and R stay in cache
     * while every block reads them, so the cost per row stays flat however large the batch),
     * sums carried in float32 between passes; one pass up to twice that */
    int64_t tile = dot || N <= 2 * BF_VG_ROWS ? N : BF_VG_ROWS;
    bfv_ctx k = {r, c, N, n_br, n_bc, (r + BF_LANES - 1) / BF_LANES, (tile + 1) / 2, rows,
                 cols, starts, (const uint16_t *)l, li, ln, (const uint16_t *)rgt, ri, rn, dot,
                 g, gout == 2 && dot ? 1 : gout, 0, 0, 0, N, 0, 1, 1, nnzb};
    uint32_t *bufs[256];
    int ok = 1;
    for (int t = 0; t < nth; t++) {
        bufs[t] = dot ? 0 : (uint32_t *)malloc((size_t)(k.nac * k.npairs * BF_LANES) * 4);
        if (!dot && !bufs[t]) ok = 0;
    }
    if (ok && tile < N) {
        k.acc = (float *)malloc((size_t)(nnzb * r * c) * sizeof(float));
        if (!k.acc) ok = 0;
    }
    if (ok) {
        k.pairs = bufs;
        for (int64_t n0 = 0; n0 < N && !k.err; n0 += tile) {
            k.n0 = n0;
            k.n1 = n0 + tile < N ? n0 + tile : N;
            k.first = n0 == 0;
            k.last = k.n1 == N;
            run_tasks(bf_vg_task, &k, nruns, nth);
        }
    }
    for (int t = 0; t < nth; t++) free(bufs[t]);
    free(k.acc);
    free(starts);
    if (!ok) return -2;
    if (k.err) return SS_EINDEX;
    /* (batch-major: rounded in bf_vg_store; the dot form writes float32, rounded here) */
    if (gout == 2 && dot) bf_widen_rounded((float *)g, nnzb * r * c);
    return 0;
}

int ss_values_grad_bf16(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows,
                        const int64_t *cols, int64_t n_br, int64_t n_bc, const void *l,
                        int64_t li, int64_t ln, const void *rgt, int64_t ri, int64_t rn,
                        int64_t N, void *g, int nthreads)
{
    return ss_values_grad_bf16_to(nnzb, r, c, rows, cols, n_br, n_bc, l, li, ln, rgt, ri, rn, N,
                                  g, DT_BF16, nthreads);
}

/* ------------------------------------------------------------------------------------------ */
/* The column sums (a SparseLinear's bias gradient: g.sum(0)) */

typedef struct {
    const uint16_t *g;
    int64_t N, C, ld;
    void *out;
    int f32;
} bfs_ctx;

#define BF_SUM_COLS 256 /* columns per task: 16 vectors of float32 sums in registers */

/* columns [t * 256, + 256) summed over the N rows in float32 (rows in order), then written */
static BF_TARGET void bf_colsum_task(void *vctx, int64_t t, int tid)
{
    (void)tid;
    const bfs_ctx *k = (const bfs_ctx *)vctx;
    const int64_t c0 = t * BF_SUM_COLS, left = k->C - c0;
    const int nv = (int)((left < BF_SUM_COLS ? left : BF_SUM_COLS) + 15) / 16;
    __m512 acc[16];
    __mmask16 m[16];
    for (int v = 0; v < 16; v++) {
        acc[v] = _mm512_setzero_ps();
        m[v] = bf_mask(left - 16 * v);
    }
    const uint16_t *row = k->g + c0;
    if (nv == 16 && left >= BF_SUM_COLS) {
        for (int64_t n = 0; n < k->N; n++, row += k->ld) {
#pragma GCC unroll 16
            for (int v = 0; v < 16; v++) acc[v] = _mm512_add_ps(acc[v], bf_widen(row + 16 * v, 0xffff));
        }
    } else {
        for (int64_t n = 0; n < k->N; n++, row += k->ld)
            for (int v = 0; v < nv; v++) acc[v] = _mm512_add_ps(acc[v], bf_widen(row + 16 * v, m[v]));
    }
    for (int v = 0; v < nv; v++) bf_put(k->out, k->f32, c0 + 16 * v, m[v], acc[v]);
}

/* out[c] = sum_n g[n * ld + c] for c < C (bfloat16 g; float32 sums, rows in order), out in
 * odt (SS_DT_BF16: rounded, SS_DT_F32, or SS_DT_F32 | SS_OUT_ROUNDED: the bfloat16 result
 * widened). Returns 0, or -1 (no bfloat16 kernels here, another dtype). */
int ss_colsum_bf16(const void *g, int64_t N, int64_t C, int64_t ld, void *out, int odt,
                   int nthreads)
{
    int gout = bf_out_kind(odt);
    if (!ss_bf16_supported() || gout < 0 || N < 0 || C < 0 || (N > 1 && ld < C))
        return -1;
    bfs_ctx k = {(const uint16_t *)g, N, C, ld, out, gout != 0};
    run_tasks(bf_colsum_task, &k, (C + BF_SUM_COLS - 1) / BF_SUM_COLS, nthreads < 1 ? 1 : nthreads);
    if (gout == 2) bf_widen_rounded((float *)out, C);
    return 0;
}
