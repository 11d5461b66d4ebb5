/* The parallel region (one per product, on the OpenMP runtime torch loaded: ss_set_runtime,
 * run_tasks, the busy-machine back-off) and the index faults (the first bad index a product
 * meets, any thread: fault_set, row_range; reported by ss_last_error). Included once by
 * blockprod.c. */
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
/* index faults: the first bad index a product meets (any thread), reported by ss_last_error */


typedef struct {
    int flag;
    int64_t member, pos, value, bound;
} ss_fault;

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

static void fault_set(ss_fault *f, int64_t member, int64_t pos, int64_t value, int64_t bound)
{
    int zero = 0;
    if (__atomic_compare_exchange_n(&f->flag, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        f->member = member;
        f->pos = pos;
        f->value = value;
        f->bound = bound;
    }
}

static inline int faulted(ss_fault *f) { return __atomic_load_n(&f->flag, __ATOMIC_RELAXED); }

/* the calling thread's last fault: member, position, value, bound */
static __thread int64_t g_last_fault[4];

static int fault_result(const ss_fault *f)
{
    if (!f->flag) return 0;
    g_last_fault[0] = f->member;
    g_last_fault[1] = f->pos;
    g_last_fault[2] = f->value;
    g_last_fault[3] = f->bound;
    return SS_E_INDEX;
}

/* Block row i's stored range [*q0, *q1) read once and checked (0 <= q0 <= q1 <= nnzb);
 * 0 and a fault when it is not. */
static inline int row_range(const int64_t *crow, int64_t i, int64_t nnzb, ss_fault *f,
                            int64_t *q0, int64_t *q1)
{
    int64_t a = LD(crow + i), b = LD(crow + i + 1);
    if (a < 0 || a > nnzb) { fault_set(f, SS_M_PTR, i, a, nnzb); return 0; }
    if (b < a || b > nnzb) { fault_set(f, SS_M_PTR, i + 1, b, nnzb); return 0; }
    *q0 = a;
    *q1 = b;
    return 1;
}
