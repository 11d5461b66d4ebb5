/* One instantiation of the micro-kernels for an instruction set and a compute type.
 * Included by blockprod.c with these defined:
 *   SUF        suffix of the function names (e.g. avx512_f32)
 *   TARGET     __attribute__((target(...)))
 *   R          the compute type (float / double)
 *   VT, W      the vector type and its number of lanes
 *   MT, MASK(k)              a mask of the first k lanes (k <= W)
 *   LOADU(p), LOADM(p, m)    full / masked load
 *   STOREU(p, v), STOREM(p, m, v)
 *   SET1(s), ZERO(), FMA(a, b, c) (a * b + c), HSUM(v)
 *   RT_PROD    rows of the product tile (with 2 vectors of the batch)
 *   RT_OUT1 / RT_OUT2  rows of the values-gradient tile with 1 / 2 vectors of the block width
 *   RT_DOT, CT_DOT     the dot-form tile
 *   DT_SELF    the dtype code of R
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)
#define INL static inline __attribute__((always_inline)) TARGET

/* -------------------------------------------------------------------------------------------
 * Product: Y[row, n] = bias[row] + sum over M's block row of M_q[a, b] * X[col_q * c + b, n],
 * the batch read from a feature-major tile (xt[k * ldx + n]) two vectors at a time. */
INL void FN(prod_tile)(const prod_ctx *k, int64_t i, int64_t q0, int64_t q1, int64_t a0,
                       const int RTN, const R *xt, int64_t ldx, int64_t n_abs, int64_t cnt,
                       const int full)
{
    VT acc[RT_PROD][2];
    MT m0 = MASK(cnt >= W ? W : cnt), m1 = MASK(cnt >= 2 * W ? W : (cnt > W ? cnt - W : 0));
    const R *bias = (const R *)k->bias;
    for (int ra = 0; ra < RTN; ra++) {
        VT b0 = bias ? SET1(bias[i * k->r + a0 + ra]) : ZERO();
        acc[ra][0] = b0;
        acc[ra][1] = b0;
    }
    const R *vals = (const R *)k->vals;
    const int64_t c = k->c, sa = k->sa, sb = k->sb, nnzb = k->nnzb, n_bc = k->n_bc;
    for (int64_t q = q0; q < q1; q++) {
        int64_t p = k->order ? LD(k->order + q) : q, j = LD(k->col + q);
        if ((uint64_t)p >= (uint64_t)nnzb) { fault_set(k->fault, SS_M_ORDER, q, p, nnzb); return; }
        if ((uint64_t)j >= (uint64_t)n_bc) { fault_set(k->fault, SS_M_IDX, q, j, n_bc); return; }
        const R *w = vals + p * k->sp + a0 * sa;
        const R *xr = xt + j * c * ldx;
        for (int64_t b = 0; b < c; b++, xr += ldx, w += sb) {
            VT x0 = full ? LOADU(xr) : LOADM(xr, m0);
            VT x1 = full ? LOADU(xr + W) : LOADM(xr + W, m1);
            for (int ra = 0; ra < RTN; ra++) {
                VT s = SET1(w[ra * sa]);
                acc[ra][0] = FMA(s, x0, acc[ra][0]);
                acc[ra][1] = FMA(s, x1, acc[ra][1]);
            }
        }
    }
    int64_t row0 = i * k->r + a0;
    if (k->ydt == DT_SELF && k->yn == 1) {
        for (int ra = 0; ra < RTN; ra++) {
            R *y = (R *)k->y + (row0 + ra) * k->yi + n_abs;
            if (cnt >= 2 * W) {
                STOREU(y, acc[ra][0]);
                STOREU(y + W, acc[ra][1]);
            } else {
                STOREM(y, m0, acc[ra][0]);
                STOREM(y + W, m1, acc[ra][1]);
            }
        }
        return;
    }
    R tmp[RT_PROD][2 * W];
    for (int ra = 0; ra < RTN; ra++) {
        STOREU(tmp[ra], acc[ra][0]);
        STOREU(tmp[ra] + W, acc[ra][1]);
    }
    if (k->ydt == DT_SELF) {
        R *y = (R *)k->y + row0 * k->yi + n_abs * k->yn;
        for (int64_t n = 0; n < cnt; n++)
            for (int ra = 0; ra < RTN; ra++) y[ra * k->yi + n * k->yn] = tmp[ra][n];
        return;
    }
    for (int64_t n = 0; n < cnt; n++)
        for (int ra = 0; ra < RTN; ra++)
            put_el(k->y, k->ydt, (row0 + ra) * k->yi + (n_abs + n) * k->yn, (double)tmp[ra][n]);
}

static TARGET void FN(prod_task)(void *vctx, int64_t task, int tid)
{
    prod_ctx *k = (prod_ctx *)vctx;
    int64_t chunk = task / k->n_br, i = task % k->n_br;
    int64_t n0 = chunk * k->nt, nt = k->N - n0 < k->nt ? k->N - n0 : k->nt;
    int64_t q0, q1;
    if (faulted(k->fault) || !row_range(k->crow, i, k->nnzb, k->fault, &q0, &q1)) return;
    const R *xt;
    int64_t ldx;
    int full_ok;
    if (k->direct) {
        xt = (const R *)k->x + n0;
        ldx = k->xk;
        full_ok = 0;
    } else {
        R *buf = (R *)k->bufs[tid];
        if (k->buf_chunk[tid] != chunk) {
            fill_tile(buf, k->nt, k->x, k->xdt, k->xk, k->xn, k->n_in, n0, nt, DT_SELF);
            k->buf_chunk[tid] = chunk;
        }
        xt = buf;
        ldx = k->nt;
        full_ok = 1;
    }
    for (int64_t a0 = 0; a0 < k->r;) {
        int64_t left = k->r - a0;
        int rt = left >= RT_PROD ? RT_PROD : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int64_t nn = 0; nn < nt; nn += 2 * W) {
            int64_t cnt = nt - nn < 2 * W ? nt - nn : 2 * W;
            int full = full_ok || cnt == 2 * W;
            switch (rt) {
#define PCASE(RTV) case RTV: { if (full) FN(prod_tile)(k, i, q0, q1, a0, RTV, xt + nn, ldx, n0 + nn, cnt, 1); \
                             else FN(prod_tile)(k, i, q0, q1, a0, RTV, xt + nn, ldx, n0 + nn, cnt, 0); } break;
            PCASE(RT_PROD)
#if RT_PROD != 4
            PCASE(4)
#endif
            PCASE(2)
            PCASE(1)
#undef PCASE
            }
        }
        a0 += rt;
    }
}

/* One r x c block transposed: dst[b * r + a] = src[a * sa + b * sb] (the batch-major product
 * reads a block's columns as vectors); whole W x W tiles in registers where the block's rows
 * are contiguous and its sides multiples of W, else element by element. */
INL void FN(pack_block)(R *dst, const R *src, int64_t r, int64_t c, int64_t sa, int64_t sb)
{
#ifdef TRANSPOSE_W
    if (sb == 1 && r % W == 0 && c % W == 0) {
        for (int64_t a0 = 0; a0 < r; a0 += W)
            for (int64_t b0 = 0; b0 < c; b0 += W) TRANSPOSE_W(src + a0 * sa + b0, sa, dst + b0 * r + a0, r);
        return;
    }
#endif
    for (int64_t a = 0; a < r; a++)
        for (int64_t b = 0; b < c; b++) dst[b * r + a] = src[a * sa + b * sb];
}

/* The blocks q0 .. q0 + nq - 1 of a row: their values (wq: in vals, or in the blocks packed
 * once per call) and block columns (colq), each index read once and checked; 0 and a fault
 * when one is out of range. */
INL int FN(row_blocks)(const prod_ctx *k, int64_t q0, int64_t nq, const R **wq, int64_t *colq)
{
    const R *vals = (const R *)k->vals, *packed = (const R *)k->packed;
    const int64_t nnzb = k->nnzb, n_bc = k->n_bc, rc = k->r * k->c;
    for (int64_t qq = 0; qq < nq; qq++) {
        int64_t q = q0 + qq, p = packed || !k->order ? q : LD(k->order + q), j = LD(k->col + q);
        if ((uint64_t)p >= (uint64_t)nnzb) { fault_set(k->fault, SS_M_ORDER, q, p, nnzb); return 0; }
        if ((uint64_t)j >= (uint64_t)n_bc) { fault_set(k->fault, SS_M_IDX, q, j, n_bc); return 0; }
        wq[qq] = packed ? packed + p * rc : vals + p * k->sp;
        colq[qq] = j;
    }
    return 1;
}

/* Batch-major product: Y[n, row] (yi == 1) with X[n, k] read in place (broadcasts), the
 * output rows of a block row in vectors; block q's column b of M_q at w_q + b * wsb, its rows
 * contiguous. NBN batch rows x VN vectors of output rows. */
INL void FN(bm_tile)(const prod_ctx *k, const R *const *wq, int64_t wsb, int64_t nq,
                     const int64_t *colq, int64_t i, int64_t n, const int NBN, const int VN,
                     const int FULL, const int C16, int64_t a0, int64_t ac)
{
    /* FULL (a compile-time constant): the VN vectors of output rows are all whole, loads and
     * stores unmasked; a run-time choice here made GCC keep the accumulators on the stack.
     * C16 (compile-time): blocks 16 columns wide, the features contiguous (xk == 1): a
     * block's 16 steps unrolled, no loop and its exit per block (measured at 128 rows, one
     * thread, the encoder's 768^2 and 768 x 3072: 89 -> 93 % of the FMA peak, 108 GFLOP/s) */
    VT acc[BM_NB][2];
    MT m0 = MASK(ac >= W ? W : ac), m1 = MASK(ac >= 2 * W ? W : (ac > W ? ac - W : 0));
    const R *bias = (const R *)k->bias;
    VT b0 = ZERO(), b1 = ZERO();
    if (bias) {
        const R *bp = bias + i * k->r + a0;
        b0 = FULL ? LOADU(bp) : LOADM(bp, m0);
        if (VN == 2) b1 = FULL ? LOADU(bp + W) : LOADM(bp + W, m1);
    }
    for (int nb = 0; nb < NBN; nb++) {
        acc[nb][0] = b0;
        if (VN == 2) acc[nb][1] = b1;
    }
    const R *xs = (const R *)k->x + n * k->xn;
    const int64_t c = C16 ? 16 : k->c, xn = k->xn, xk = C16 ? 1 : k->xk;
    for (int64_t qq = 0; qq < nq; qq++) {
        const R *w = wq[qq] + a0;
        const R *xb = xs + colq[qq] * c * xk;
        if (qq + 1 < nq) { /* the next block's lines of the batch rows arrive meanwhile (its
                            * column is not one a prefetcher could guess) */
            const char *xp = (const char *)(xs + colq[qq + 1] * c * xk);
            for (int nb = 0; nb < NBN; nb++) __builtin_prefetch(xp + nb * xn * (int64_t)sizeof(R));
        }
        if (C16) { /* the 16 steps unrolled: the block's 16 columns (16 vectors apart: wsb ==
                    * VN * W) and the NBN batch rows' 16 features (xk == 1) at fixed offsets */
            const R *xr[BM_NB];
            for (int nb = 0; nb < NBN; nb++) xr[nb] = xb + nb * xn;
#pragma GCC unroll 16
            for (int b = 0; b < 16; b++) {
                VT w0 = LOADU(w + b * VN * W);
                VT w1 = ZERO();
                if (VN == 2) w1 = LOADU(w + b * VN * W + W);
                for (int nb = 0; nb < NBN; nb++) {
                    VT s = SET1(xr[nb][b]);
                    acc[nb][0] = FMA(s, w0, acc[nb][0]);
                    if (VN == 2) acc[nb][1] = FMA(s, w1, acc[nb][1]);
                }
            }
            continue;
        }
        for (int64_t b = 0; b < c; b++, w += wsb, xb += xk) {
            VT w0 = FULL ? LOADU(w) : LOADM(w, m0);
            VT w1 = ZERO();
            if (VN == 2) w1 = FULL ? LOADU(w + W) : LOADM(w + W, m1);
            for (int nb = 0; nb < NBN; nb++) {
                VT s = SET1(xb[nb * xn]);
                acc[nb][0] = FMA(s, w0, acc[nb][0]);
                if (VN == 2) acc[nb][1] = FMA(s, w1, acc[nb][1]);
            }
        }
    }
    int64_t row0 = i * k->r + a0;
    if (k->ydt == DT_SELF) {
        for (int nb = 0; nb < NBN; nb++) {
            R *y = (R *)k->y + (n + nb) * k->yn + row0;
            if (FULL) STOREU(y, acc[nb][0]); else STOREM(y, m0, acc[nb][0]);
            if (VN == 2) { if (FULL) STOREU(y + W, acc[nb][1]); else STOREM(y + W, m1, acc[nb][1]); }
        }
        return;
    }
#ifdef STORE_HALF
    if (k->ydt == DT_BF16 || k->ydt == DT_F16) {
        for (int nb = 0; nb < NBN; nb++) {
            int64_t at = (n + nb) * k->yn + row0;
            STORE_HALF(k->y, k->ydt, at, acc[nb][0], ac >= W ? W : ac);
            if (VN == 2) STORE_HALF(k->y, k->ydt, at + W, acc[nb][1], ac - W);
        }
        return;
    }
#endif
    R tmp[2 * W];
    for (int nb = 0; nb < NBN; nb++) {
        STOREU(tmp, acc[nb][0]);
        if (VN == 2) STOREU(tmp + W, acc[nb][1]);
        put_row(k->y, k->ydt, (n + nb) * k->yn + row0, tmp, ac);
    }
}

/* What the next task will read, on its way meanwhile (hints; every index read once and in
 * range before it makes an address). pf[0]: this task's share (block row i of n_br) of the
 * next row tile's rows of X (xk == 1), and with SS_PF_FIRST the first task of the first tile
 * the first tile's; pf[1]: the lines of Y the next block row writes in this tile (yi == 1: on
 * a cold cache each store would wait for its line). Both issued `calls` steps. And now: the
 * next block row's blocks (its values, or their packed copy): a row's few KiB read at the
 * start of a task, a burst no hardware prefetcher sees coming. */
static inline void FN(bm_prefetch)(const prod_ctx *k, int64_t chunk, int64_t i, int64_t calls,
                                   row_lines *pf)
{
    const int64_t esz = (int64_t)sizeof(R), nt = k->nt, n_row = k->n_br * k->r;
    int64_t n0 = (chunk + 1) * nt, shares = k->n_br, share = i;
#if SS_PF_FIRST
    if (chunk == 0 && i == 0) { n0 = 0; shares = 1; share = 0; }
#endif
    int64_t rows = k->N - n0 < nt ? k->N - n0 : nt;
    if (k->xk != 1 || rows < 0) rows = 0;
    row_lines_share(&pf[0], (const char *)k->x + n0 * k->xn * esz, k->xn * esz, k->n_in * esz,
                    rows, share, shares, calls);
    /* the next block row: i + 1 in this tile, or the first of the next tile */
    int64_t i2 = i + 1, m0 = chunk * nt;
    if (i2 == k->n_br) { i2 = 0; m0 += nt; }
    int64_t yrows = k->N - m0 < nt ? k->N - m0 : nt;
    if (k->ydt != DT_SELF || yrows < 0) yrows = 0;
    row_lines_share(&pf[1], (const char *)k->y + (m0 * k->yn + i2 * k->r) * esz, k->yn * esz,
                    (n_row - i2 * k->r < k->r ? n_row - i2 * k->r : k->r) * esz, yrows, 0, 1,
                    calls);
    int64_t a = LD(k->crow + i2), b = LD(k->crow + i2 + 1);
    if (a < 0 || b < a || b > k->nnzb) return;
    const int64_t rc = k->r * k->c;
    int64_t span = (k->r - 1) * k->sa + (k->c - 1) * k->sb + 1; /* a block's extent in vals */
    if (k->sa < 0 || k->sb < 0 || span > 2 * rc) span = 0;
    for (int64_t q = a; q < b && q < a + 64; q++) {
        const R *src;
        if (k->packed) {
            src = (const R *)k->packed + q * rc;
            span = rc;
        } else {
            int64_t p = k->order ? LD(k->order + q) : q;
            if ((uint64_t)p >= (uint64_t)k->nnzb) return;
            src = (const R *)k->vals + p * k->sp;
        }
        for (int64_t e = 0; e < span; e += 64 / esz) __builtin_prefetch(src + e, 0, SS_PF_HINT);
    }
}

static TARGET void FN(bm_task)(void *vctx, int64_t task, int tid)
{
    prod_ctx *k = (prod_ctx *)vctx;
    int64_t chunk = task / k->n_br, i = task % k->n_br;
    int64_t n0 = chunk * k->nt, nt = k->N - n0 < k->nt ? k->N - n0 : k->nt;
    int64_t q0, q1;
    if (faulted(k->fault) || !row_range(k->crow, i, k->nnzb, k->fault, &q0, &q1)) return;
    int64_t nq = q1 - q0;
    if (nq > k->maxq) { fault_set(k->fault, SS_M_PTR, i + 1, q1, q0 + k->maxq); return; }
    if (nq == 0) { /* an empty block row: the bias, or zeros */
        R tmp[1];
        for (int64_t n = n0; n < n0 + nt; n++)
            for (int64_t a = 0; a < k->r; a++) {
                tmp[0] = k->bias ? ((const R *)k->bias)[i * k->r + a] : (R)0;
                put_row(k->y, k->ydt, n * k->yn + i * k->r + a, tmp, 1);
            }
        return;
    }
    const R *wq_stack[64];
    int64_t colq_stack[64];
    const R **wq = nq <= 64 ? wq_stack : (const R **)k->bufs[tid];
    int64_t *colq = nq <= 64 ? colq_stack : (int64_t *)(wq + k->maxq);
    if (!FN(row_blocks)(k, q0, nq, wq, colq)) return;
    const int packed = k->packed != 0;
    int64_t wsb = packed ? k->r : k->sb;
    if (k->sa != 1 && !packed) { /* pack the row's blocks: column b of block qq at pk + qq * c * r + b * r */
        R *pk = (R *)k->pack[tid];
        const int64_t r = k->r, c = k->c;
        for (int64_t qq = 0; qq < nq; qq++) {
            R *dst = pk + qq * c * r;
            FN(pack_block)(dst, wq[qq], r, c, k->sa, k->sb);
            wq[qq] = dst;
        }
        wsb = r;
    }
    /* the next row tile's rows of X and Y on their way meanwhile (this task's share of them,
     * spread over its tiles): their first touch, a few lines at random block columns of
     * rows a page apart, is one no hardware prefetcher follows */
    row_lines pf[2];
    int64_t calls = ((k->r + 2 * W - 1) / (2 * W)) * ((nt + BM_NB - 1) / BM_NB);
    FN(bm_prefetch)(k, chunk, i, calls, pf);
    /* blocks 16 wide whose columns are one or two whole vectors apart, the features
     * contiguous: the tiles with a block's 16 steps unrolled */
    const int c16 = SS_BM_UNROLL && k->c == 16 && k->xk == 1 && wsb == k->r &&
                    (k->r == W || k->r == 2 * W);
    for (int64_t a0 = 0; a0 < k->r; a0 += 2 * W) {
        int64_t ac = k->r - a0 < 2 * W ? k->r - a0 : 2 * W;
        int two = ac > W, full = ac == W || ac == 2 * W;
        for (int64_t n = n0; n < n0 + nt;) {
            int64_t left = n0 + nt - n;
            int nb = left >= BM_NB ? BM_NB : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            prefetch_step(&pf[0]);
            prefetch_step(&pf[1]);
            /* 0: part vectors; 1: whole ones; 2: whole ones, blocks 16 wide, xk == 1 */
            int form = !full ? 0 : c16 ? 2 : 1;
            switch (nb * 8 + two * 4 + form) {
#define BCASE(NBV) \
    case NBV * 8: FN(bm_tile)(k, wq, wsb, nq, colq, i, n, NBV, 1, 0, 0, a0, ac); break; \
    case NBV * 8 + 1: FN(bm_tile)(k, wq, wsb, nq, colq, i, n, NBV, 1, 1, 0, a0, ac); break; \
    case NBV * 8 + 2: FN(bm_tile)(k, wq, wsb, nq, colq, i, n, NBV, 1, 1, 1, a0, ac); break; \
    case NBV * 8 + 4: FN(bm_tile)(k, wq, wsb, nq, colq, i, n, NBV, 2, 0, 0, a0, ac); break; \
    case NBV * 8 + 5: FN(bm_tile)(k, wq, wsb, nq, colq, i, n, NBV, 2, 1, 0, a0, ac); break; \
    case NBV * 8 + 6: FN(bm_tile)(k, wq, wsb, nq, colq, i, n, NBV, 2, 1, 1, a0, ac); break;
            BCASE(BM_NB) BCASE(4) BCASE(2) BCASE(1)
#undef BCASE
            default: break;
            }
            n += nb;
        }
    }
}

/* -------------------------------------------------------------------------------------------
 * Small batches, M's rows and X's features contiguous (sb == 1, xk == 1): whole-block tiles.
 * For block row i, a group of RTN (<= W) output rows and batch row n: RTN accumulators (one per
 * output row); per block one load of X's segment, RTN row loads and RTN FMAs; at the end one
 * transpose-reduction of the accumulators into one vector of RTN sums. Loop order block row ->
 * row group -> batch row -> block (the row's blocks stay in L1 across the batch); values read in
 * place, no packing. CF (compile-time): c == W (one unmasked vector per block row). */
INL void FN(sb_tile)(const prod_ctx *k, const R *const *wq, const int64_t *colq, int64_t nq,
                     int64_t i, int64_t a0, const int RTN, const int CF, int64_t n)
{
    VT acc[W];
    for (int ra = 0; ra < W; ra++) acc[ra] = ZERO();
    const int64_t c = k->c, sa = k->sa;
    const R *xs = (const R *)k->x + n * k->xn;
    for (int64_t qq = 0; qq < nq; qq++) {
        const R *w = wq[qq] + a0 * sa;
        const R *xr = xs + colq[qq] * c;
        if (CF) {
            VT xv = LOADU(xr);
            for (int ra = 0; ra < RTN; ra++) acc[ra] = FMA(LOADU(w + ra * sa), xv, acc[ra]);
        } else {
            for (int64_t b = 0; b < c; b += W) {
                if (c - b >= W) {
                    VT xv = LOADU(xr + b);
                    for (int ra = 0; ra < RTN; ra++)
                        acc[ra] = FMA(LOADU(w + ra * sa + b), xv, acc[ra]);
                } else {
                    MT m = MASK(c - b);
                    VT xv = LOADM(xr + b, m);
                    for (int ra = 0; ra < RTN; ra++)
                        acc[ra] = FMA(LOADM(w + ra * sa + b, m), xv, acc[ra]);
                }
            }
        }
    }
#ifdef ROWSUMS
    VT sum = ROWSUMS(acc); /* lane ra: the sum of acc[ra] (acc[ra] zero for ra >= RTN) */
#else
    R part[W];
    for (int ra = 0; ra < W; ra++) part[ra] = ra < RTN ? HSUM(acc[ra]) : (R)0;
    VT sum = LOADU(part);
#endif
    int64_t row0 = i * k->r + a0;
    const R *bias = (const R *)k->bias;
    MT m = MASK(RTN);
    if (bias) sum = ADD(sum, RTN == W ? LOADU(bias + row0) : LOADM(bias + row0, m));
    if (k->ydt == DT_SELF && k->yi == 1) {
        R *y = (R *)k->y + n * k->yn + row0;
        if (RTN == W) STOREU(y, sum); else STOREM(y, m, sum);
        return;
    }
    R out[W];
    STOREU(out, sum);
    for (int ra = 0; ra < RTN; ra++)
        put_el(k->y, k->ydt, (row0 + ra) * k->yi + n * k->yn, (double)out[ra]);
}

static TARGET void FN(sb_task)(void *vctx, int64_t i, int tid)
{
    prod_ctx *k = (prod_ctx *)vctx;
    int64_t q0, q1;
    if (faulted(k->fault) || !row_range(k->crow, i, k->nnzb, k->fault, &q0, &q1)) return;
    int64_t nq = q1 - q0;
    if (nq > k->maxq) { fault_set(k->fault, SS_M_PTR, i + 1, q1, q0 + k->maxq); return; }
    const R *wq_stack[64];
    int64_t colq_stack[64];
    const R **wq = nq <= 64 ? wq_stack : (const R **)k->bufs[tid];
    int64_t *colq = nq <= 64 ? colq_stack : (int64_t *)(wq + k->maxq);
    if (!FN(row_blocks)(k, q0, nq, wq, colq)) return;
    const int cf = k->c == W;
    for (int64_t a0 = 0; a0 < k->r;) {
        int64_t left = k->r - a0;
        int rt = left >= W ? W : left >= W / 2 ? W / 2 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int64_t n = 0; n < k->N; n++) {
            switch (rt * 2 + cf) {
#define SCASE(RTV) case RTV * 2: FN(sb_tile)(k, wq, colq, nq, i, a0, RTV, 0, n); break; \
                   case RTV * 2 + 1: FN(sb_tile)(k, wq, colq, nq, i, a0, RTV, 1, n); break;
            SCASE(W)
#if W / 2 > 4
            SCASE(W / 2)
#endif
#if W > 4
            SCASE(4)
#endif
            SCASE(2) SCASE(1)
#undef SCASE
            default: break;
            }
        }
        a0 += rt;
    }
}

/* Pack M's blocks once per call (tasks of SS_PACK blocks): block q (M's order) at packed +
 * q * r * c, column b contiguous over the rows (packed[q][b * r + a] = M_q[a, b]). */
static TARGET void FN(pack_task)(void *vctx, int64_t task, int tid)
{
    (void)tid;
    prod_ctx *k = (prod_ctx *)vctx;
    if (faulted(k->fault)) return;
    const int64_t r = k->r, c = k->c, nnzb = k->nnzb;
    const R *vals = (const R *)k->vals;
    R *packed = (R *)k->packed;
    int64_t q1 = (task + 1) * SS_PACK < nnzb ? (task + 1) * SS_PACK : nnzb;
    /* the next task's blocks on their way meanwhile (M's order scatters them) */
    int64_t span = (r - 1) * k->sa + (c - 1) * k->sb + 1;
    if (k->sa >= 0 && k->sb >= 0 && span <= 2 * r * c)
        for (int64_t q = q1; q < q1 + SS_PACK && q < nnzb; q++) {
            int64_t p = k->order ? LD(k->order + q) : q;
            if ((uint64_t)p >= (uint64_t)nnzb) break;
            for (int64_t e = 0; e < span; e += 64 / (int64_t)sizeof(R))
                __builtin_prefetch(vals + p * k->sp + e, 0, SS_PF_HINT);
        }
    for (int64_t q = task * SS_PACK; q < q1; q++) {
        int64_t p = k->order ? LD(k->order + q) : q;
        if ((uint64_t)p >= (uint64_t)nnzb) { fault_set(k->fault, SS_M_ORDER, q, p, nnzb); return; }
        FN(pack_block)(packed + q * r * c, vals + p * k->sp, r, c, k->sa, k->sb);
    }
}

/* Block p's block row and column, read once and checked; 0 and a fault when out of range. */
static inline int FN(vg_block)(vg_ctx *k, int64_t p, int64_t *bi, int64_t *bj)
{
    int64_t i = LD(k->rows + p), j = LD(k->cols + p);
    if ((uint64_t)i >= (uint64_t)k->n_lb) { fault_set(k->fault, SS_M_ROWS, p, i, k->n_lb); return 0; }
    if ((uint64_t)j >= (uint64_t)k->n_rb) { fault_set(k->fault, SS_M_COLS, p, j, k->n_rb); return 0; }
    *bi = i;
    *bj = j;
    return 1;
}

/* -------------------------------------------------------------------------------------------
 * Values gradient, outer form: G_p[a, b] = sum_n L[i*r + a, n] * R[j*c + b, n] with R's block
 * columns contiguous (ri == 1): per batch step, VN vectors of R's row, RTN broadcasts of L. */
INL void FN(vgo_tile)(const vg_ctx *k, int64_t p, int64_t bi, int64_t bj, int64_t a0,
                      int64_t b0, const int RTN, const int VN, const int FULL, int64_t bc)
{
    /* FULL (compile-time): the VN vectors of the block's columns are whole (no masks) */
    VT acc[RT_OUT1][2];
    MT m0 = MASK(bc >= W ? W : bc), m1 = MASK(bc >= 2 * W ? W : (bc > W ? bc - W : 0));
    R *g = (R *)k->g + p * k->r * k->c + a0 * k->c + b0;
    for (int ra = 0; ra < RTN; ra++) { /* batch rows after the first tile add to G */
        acc[ra][0] = !k->accum ? ZERO() : FULL ? LOADU(g + ra * k->c) : LOADM(g + ra * k->c, m0);
        if (VN == 2)
            acc[ra][1] = !k->accum ? ZERO() : FULL ? LOADU(g + ra * k->c + W)
                                                   : LOADM(g + ra * k->c + W, m1);
    }
    const int64_t n0 = k->n0, n1 = k->n1, li = k->li, ln = k->ln, rn = k->rn;
    const R *l = (const R *)k->l + bi * k->lb + a0 * li + (n0 - k->noff) * ln;
    const R *rr = (const R *)k->rgt + bj * k->rb + b0 + (n0 - k->noff) * rn;
    /* both operands' rows are a batch row apart (a page, typically): the lines SS_VG_AHEAD
     * rows on requested meanwhile, where a stride prefetcher would start too late */
    const int64_t nf = n1 - SS_VG_AHEAD;
    for (int64_t n = n0; n < n1; n++, l += ln, rr += rn) {
        if (n < nf) {
            __builtin_prefetch(rr + SS_VG_AHEAD * rn);
            __builtin_prefetch(l + SS_VG_AHEAD * ln);
        }
        VT x0 = FULL ? LOADU(rr) : LOADM(rr, m0);
        VT x1 = ZERO();
        if (VN == 2) x1 = FULL ? LOADU(rr + W) : LOADM(rr + W, m1);
        for (int ra = 0; ra < RTN; ra++) {
            VT s = SET1(l[ra * li]);
            acc[ra][0] = FMA(s, x0, acc[ra][0]);
            if (VN == 2) acc[ra][1] = FMA(s, x1, acc[ra][1]);
        }
    }
    for (int ra = 0; ra < RTN; ra++) {
        if (FULL) STOREU(g + ra * k->c, acc[ra][0]); else STOREM(g + ra * k->c, m0, acc[ra][0]);
        if (VN == 2) {
            if (FULL) STOREU(g + ra * k->c + W, acc[ra][1]);
            else STOREM(g + ra * k->c + W, m1, acc[ra][1]);
        }
    }
}

static TARGET void FN(vgo_task)(void *vctx, int64_t p, int tid)
{
    (void)tid;
    vg_ctx *k = (vg_ctx *)vctx;
    int64_t bi, bj;
    if (faulted(k->fault) || !FN(vg_block)(k, p, &bi, &bj)) return;
    if (p + 1 < k->nnzb) { /* the next block's G (a later row tile adds to it) and its first
                            * batch rows, on their way meanwhile (hints: indices in range) */
        int64_t rc = k->r * k->c, i2 = LD(k->rows + p + 1), j2 = LD(k->cols + p + 1);
        if (k->accum)
            for (int64_t e = 0; e < rc; e += 64 / (int64_t)sizeof(R))
                __builtin_prefetch((const R *)k->g + (p + 1) * rc + e);
        if ((uint64_t)i2 < (uint64_t)k->n_lb && (uint64_t)j2 < (uint64_t)k->n_rb) {
            const R *l2 = (const R *)k->l + i2 * k->lb + (k->n0 - k->noff) * k->ln;
            const R *r2 = (const R *)k->rgt + j2 * k->rb + (k->n0 - k->noff) * k->rn;
            int64_t ahead = k->n1 - k->n0 < SS_VG_AHEAD ? k->n1 - k->n0 : SS_VG_AHEAD;
            for (int64_t n = 0; n < ahead; n++) {
                __builtin_prefetch(l2 + n * k->ln);
                __builtin_prefetch(r2 + n * k->rn);
            }
        }
    }
    for (int64_t b0 = 0; b0 < k->c; b0 += 2 * W) {
        int64_t bc = k->c - b0 < 2 * W ? k->c - b0 : 2 * W;
        int two = bc > W, full = bc == W || bc == 2 * W;
        for (int64_t a0 = 0; a0 < k->r;) {
            int64_t left = k->r - a0;
            int cap = two ? RT_OUT2 : RT_OUT1;
            int rt = left >= cap ? cap : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            switch (rt * 4 + two * 2 + full) {
#define VCASE(RTV) \
    case RTV * 4 + 0: FN(vgo_tile)(k, p, bi, bj, a0, b0, RTV, 1, 0, bc); break; \
    case RTV * 4 + 1: FN(vgo_tile)(k, p, bi, bj, a0, b0, RTV, 1, 1, bc); break; \
    case RTV * 4 + 2: FN(vgo_tile)(k, p, bi, bj, a0, b0, RTV, 2, 0, bc); break; \
    case RTV * 4 + 3: FN(vgo_tile)(k, p, bi, bj, a0, b0, RTV, 2, 1, bc); break;
            VCASE(1) VCASE(2) VCASE(4)
#if RT_OUT2 != 4
            VCASE(RT_OUT2)
#endif
#if RT_OUT1 != 4 && RT_OUT1 != RT_OUT2
            case RT_OUT1 * 4 + 0: FN(vgo_tile)(k, p, bi, bj, a0, b0, RT_OUT1, 1, 0, bc); break;
            case RT_OUT1 * 4 + 1: FN(vgo_tile)(k, p, bi, bj, a0, b0, RT_OUT1, 1, 1, bc); break;
#endif
#undef VCASE
            default: break;
            }
            a0 += rt;
        }
    }
}

/* The values gradient's row tile [n0, n1) of L and R copied block by block (ss_values_grad):
 * block row i of L at l + i * lb, batch row n of it (n - noff) * r on (R likewise, by block
 * columns); from the operands' own rows (l0, r0: li == ri == 1, batch rows l0n / r0n apart),
 * whose first n_lb * r / n_rb * c elements are the blocks'. r and c multiples of W. Task t: the
 * batch rows n0 + 8t .. + 8 (each source row read once, in order). */
static TARGET void FN(vgp_task)(void *vctx, int64_t t, int tid)
{
    (void)tid;
    vg_ctx *k = (vg_ctx *)vctx;
    int64_t na = k->n0 + t * 8, nz = na + 8 < k->n1 ? na + 8 : k->n1;
    const int64_t r = k->r, c = k->c;
    for (int64_t n = na; n < nz; n++) {
        const R *ls = (const R *)k->l0 + n * k->l0n, *rs = (const R *)k->r0 + n * k->r0n;
        R *ld = (R *)k->l + (n - k->noff) * r, *rd = (R *)k->rgt + (n - k->noff) * c;
        for (int64_t i = 0; i < k->n_lb; i++)
            for (int64_t a = 0; a < r; a += W) STOREU(ld + i * k->lb + a, LOADU(ls + i * r + a));
        for (int64_t j = 0; j < k->n_rb; j++)
            for (int64_t b = 0; b < c; b += W) STOREU(rd + j * k->rb + b, LOADU(rs + j * c + b));
    }
}

/* Values gradient, dot form: both operands contiguous along the batch (ln == rn == 1). */
INL void FN(vgd_tile)(const vg_ctx *k, int64_t p, int64_t bi, int64_t bj, int64_t a0,
                      int64_t b0, const int RTN, const int CTN)
{
    VT acc[RT_DOT][CT_DOT];
    for (int ra = 0; ra < RTN; ra++)
        for (int cb = 0; cb < CTN; cb++) acc[ra][cb] = ZERO();
    const R *l = (const R *)k->l + (bi * k->r + a0) * k->li;
    const R *rr = (const R *)k->rgt + (bj * k->c + b0) * k->ri;
    int64_t n = 0, N = k->N;
    for (; n + W <= N; n += W) {
        VT lv[RT_DOT], rv[CT_DOT];
        for (int ra = 0; ra < RTN; ra++) lv[ra] = LOADU(l + ra * k->li + n);
        for (int cb = 0; cb < CTN; cb++) rv[cb] = LOADU(rr + cb * k->ri + n);
        for (int ra = 0; ra < RTN; ra++)
            for (int cb = 0; cb < CTN; cb++) acc[ra][cb] = FMA(lv[ra], rv[cb], acc[ra][cb]);
    }
    if (n < N) {
        MT m = MASK(N - n);
        VT lv[RT_DOT], rv[CT_DOT];
        for (int ra = 0; ra < RTN; ra++) lv[ra] = LOADM(l + ra * k->li + n, m);
        for (int cb = 0; cb < CTN; cb++) rv[cb] = LOADM(rr + cb * k->ri + n, m);
        for (int ra = 0; ra < RTN; ra++)
            for (int cb = 0; cb < CTN; cb++) acc[ra][cb] = FMA(lv[ra], rv[cb], acc[ra][cb]);
    }
    R *g = (R *)k->g + p * k->r * k->c;
    for (int ra = 0; ra < RTN; ra++)
        for (int cb = 0; cb < CTN; cb++) g[(a0 + ra) * k->c + b0 + cb] = HSUM(acc[ra][cb]);
}

/* one element (CSR / CSC): four accumulators along the batch (the FMA latency) */
INL R FN(vgd_one)(const R *l, const R *rr, int64_t N)
{
    VT a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO();
    int64_t n = 0;
    for (; n + 4 * W <= N; n += 4 * W) {
        a0 = FMA(LOADU(l + n), LOADU(rr + n), a0);
        a1 = FMA(LOADU(l + n + W), LOADU(rr + n + W), a1);
        a2 = FMA(LOADU(l + n + 2 * W), LOADU(rr + n + 2 * W), a2);
        a3 = FMA(LOADU(l + n + 3 * W), LOADU(rr + n + 3 * W), a3);
    }
    for (; n + W <= N; n += W) a0 = FMA(LOADU(l + n), LOADU(rr + n), a0);
    if (n < N) {
        MT m = MASK(N - n);
        a1 = FMA(LOADM(l + n, m), LOADM(rr + n, m), a1);
    }
    return HSUM(ADD(ADD(a0, a1), ADD(a2, a3)));
}

static TARGET void FN(vgd_task)(void *vctx, int64_t p, int tid)
{
    (void)tid;
    vg_ctx *k = (vg_ctx *)vctx;
    int64_t bi, bj;
    if (faulted(k->fault) || !FN(vg_block)(k, p, &bi, &bj)) return;
    if (k->r == 1 && k->c == 1) {
        ((R *)k->g)[p] = FN(vgd_one)((const R *)k->l + bi * k->li,
                                     (const R *)k->rgt + bj * k->ri, k->N);
        return;
    }
    for (int64_t a0 = 0; a0 < k->r;) {
        int rt = k->r - a0 >= RT_DOT ? RT_DOT : k->r - a0 >= 2 ? 2 : 1;
        for (int64_t b0 = 0; b0 < k->c;) {
            int ct = k->c - b0 >= CT_DOT ? CT_DOT : k->c - b0 >= 2 ? 2 : 1;
            switch (rt * 8 + ct) {
            case RT_DOT * 8 + CT_DOT: FN(vgd_tile)(k, p, bi, bj, a0, b0, RT_DOT, CT_DOT); break;
            case RT_DOT * 8 + 2: FN(vgd_tile)(k, p, bi, bj, a0, b0, RT_DOT, 2); break;
            case RT_DOT * 8 + 1: FN(vgd_tile)(k, p, bi, bj, a0, b0, RT_DOT, 1); break;
#if RT_DOT != 2
            case 2 * 8 + CT_DOT: FN(vgd_tile)(k, p, bi, bj, a0, b0, 2, CT_DOT); break;
            case 2 * 8 + 2: FN(vgd_tile)(k, p, bi, bj, a0, b0, 2, 2); break;
            case 2 * 8 + 1: FN(vgd_tile)(k, p, bi, bj, a0, b0, 2, 1); break;
#endif
            case 1 * 8 + CT_DOT: FN(vgd_tile)(k, p, bi, bj, a0, b0, 1, CT_DOT); break;
#if CT_DOT != 2
            case 1 * 8 + 2: FN(vgd_tile)(k, p, bi, bj, a0, b0, 1, 2); break;
#endif
            case 1 * 8 + 1: FN(vgd_tile)(k, p, bi, bj, a0, b0, 1, 1); break;
            default: break;
            }
            b0 += ct;
        }
        a0 += rt;
    }
}

static const kernel_set FN(kernels) = {FN(prod_task), FN(sb_task), FN(vgo_task),
                                       FN(vgd_task), FN(bm_task), FN(pack_task),
                                       FN(vgp_task), W};

#undef FN
#undef INL
#undef CAT
#undef CAT_
