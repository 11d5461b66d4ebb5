/* safesparse native block kernels: the library's interface (loaded with ctypes by
 * safesparse/kernels/native.py; tests/kernels/test_interface.py checks its bindings against the
 * declarations below). Plain C, no torch or Python headers.
 *
 * Conventions: sizes, strides and indices are int64_t, strides in elements; index arrays are
 * int64 (the caller converts); a dtype is one of the codes below. Index data is never trusted
 * for addressing: every index is checked as it is read against bounds given from the tensors'
 * shapes, and a bad one ends the call with SS_E_INDEX (ss_last_error says where).
 */
#ifndef SS_BLOCKPROD_H
#define SS_BLOCKPROD_H

#include <stdint.h>

/* The version of this interface: native.py refuses a library whose ss_abi_version() differs
 * from the one its bindings were written for. */
#define SS_ABI_VERSION 6

/* dtype codes; ss_dtype_names() lists torch's names for them in code order */
enum { SS_DT_F32 = 0, SS_DT_F64 = 1, SS_DT_F16 = 2, SS_DT_BF16 = 3 };
/* or-ed into SS_DT_F32 as the output dtype of the *_bf16_to kernels: float32 holding the sums
 * rounded to bfloat16 (round to nearest even), widened (the bits of a bfloat16 result cast to
 * float32: a float32 layer's gradients under bfloat16 autocast, no cast pass) */
enum { SS_OUT_ROUNDED = 0x100 };
/* or-ed into SS_DT_BF16 as the values' dtype of a packed product array (its 24th slot): the
 * values and bias are float32, rounded to bfloat16 in the call (the values as the kernel reads
 * them, the bias once) (ABI 6) */
enum { SS_VALS_F32 = 0x200 };
#define SS_DTYPE_NAMES "float32 float64 float16 bfloat16"

/* return codes */
enum { SS_OK = 0, SS_E_NOKERNEL = -1, SS_E_NOMEM = -2, SS_E_INDEX = -3 };

/* the index arrays ss_last_error names */
enum { SS_M_PTR = 1, SS_M_IDX = 2, SS_M_ORDER = 3, SS_M_ROWS = 4, SS_M_COLS = 5 };

/* instruction sets */
enum { SS_ISA_NONE = 0, SS_ISA_AVX2 = 1, SS_ISA_AVX512 = 2 };

int ss_abi_version(void);
const char *ss_dtype_names(void);

/* A 64-bit fingerprint of nbytes at data (csrc/fingerprint.h): what the eager plans of
 * safesparse.nn compare to see a write to a layer's values that moved no version counter
 * before they read a copy of the values */
uint64_t ss_fingerprint(const void *data, int64_t nbytes);

/* torch's OpenMP runtime (GOMP_parallel, omp_get_thread_num); 1 when both are set */
int ss_set_runtime(void *parallel, void *thread_num);

int ss_cpu_isa(void);
int ss_select_isa(int isa);
int ss_isa(void);

/* Y = M @ X (+ bias) for M stored by block rows (see blockprod.c) */
int ss_product(int64_t n_br, int64_t r, int64_t c, int64_t nnzb, const int64_t *crow,
               const int64_t *col, const int64_t *order, const void *vals, int64_t sp,
               int64_t sa, int64_t sb, const void *x, int xdt, int64_t xk, int64_t xn,
               int64_t n_in, int64_t N, void *y, int ydt, int64_t yi, int64_t yn,
               const void *bias, int nthreads);

/* ss_product with its 23 arguments in one array, in ss_product's order, and a 24th slot: the
   values' dtype (SS_DT_BF16: ss_product_bf16 on the same operands, all bfloat16). The eager
   fast path of safesparse.nn: one ctypes argument per call. (ABI 3: the 24th slot.) */
int ss_product_packed(const int64_t *args);

/* ss_product_packed for a bfloat16 array whose operand is float32, rounded to bfloat16 in the
   call (see blockprod.c) */
int ss_product_packed_rounded(const int64_t *args);

/* the backward of a layer's product (the gradients to its input, values and bias) with its
   arguments in one array (see blockprod.c; ABI 4) */
int ss_linear_backward_packed(const int64_t *args);

/* G_p = L[rows_p] R[cols_p]^T per stored block (see blockprod.c) */
int ss_values_grad(int64_t nnzb, int64_t r, int64_t c, int64_t n_l, int64_t n_r,
                   const int64_t *rows, const int64_t *cols, const void *l, int64_t li,
                   int64_t ln, const void *rgt, int64_t ri, int64_t rn, int64_t N, int dt,
                   void *g, int nthreads);

/* after SS_E_INDEX, on the calling thread: the array (SS_M_*), position, value, bound */
void ss_last_error(int64_t *out);

/* bfloat16 computed in bfloat16 (kern_bf16.h; AVX512_BF16): 1 where this CPU runs them */
int ss_bf16_supported(void);
int ss_product_bf16(int64_t n_br, int64_t r, int64_t c, const int64_t *crow, const int64_t *col,
                    const int64_t *order, int64_t nnzb, int64_t n_bc, const void *vals,
                    int64_t n_vals, int64_t sp, int64_t sa, int64_t sb, const void *x,
                    int64_t xk, int64_t xn, int64_t N, void *y, int64_t yi, int64_t yn,
                    const void *bias, int nthreads);
int ss_values_grad_bf16(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows,
                        const int64_t *cols, int64_t n_br, int64_t n_bc, const void *l,
                        int64_t li, int64_t ln, const void *rgt, int64_t ri, int64_t rn,
                        int64_t N, void *g, int nthreads);
/* the same with the output's dtype (SS_DT_BF16, SS_DT_F32: the float32 sums unrounded, or
 * SS_DT_F32 | SS_OUT_ROUNDED: the bfloat16 result widened) */
int ss_product_bf16_to(int64_t n_br, int64_t r, int64_t c, const int64_t *crow,
                       const int64_t *col, const int64_t *order, int64_t nnzb, int64_t n_bc,
                       const void *vals, int64_t n_vals, int64_t sp, int64_t sa, int64_t sb,
                       const void *x, int64_t xk, int64_t xn, int64_t N, void *y, int ydt,
                       int64_t yi, int64_t yn, const void *bias, int nthreads);
int ss_values_grad_bf16_to(int64_t nnzb, int64_t r, int64_t c, const int64_t *rows,
                           const int64_t *cols, int64_t n_br, int64_t n_bc, const void *l,
                           int64_t li, int64_t ln, const void *rgt, int64_t ri, int64_t rn,
                           int64_t N, void *g, int gdt, int nthreads);
/* out[c] = sum_n g[n * ld + c] (bfloat16 g, float32 sums; out bfloat16, float32, or float32
 * rounded: SS_DT_F32 | SS_OUT_ROUNDED) */
int ss_colsum_bf16(const void *g, int64_t N, int64_t C, int64_t ld, void *out, int odt,
                   int nthreads);

int ss_convert(const void *src, int sdt, void *dst, int ddt, int64_t n);
void ss_region_stats(int64_t *out);
void ss_reset_backoff(void);

#endif /* SS_BLOCKPROD_H */
