/*
 * team.c - how many threads a call may use: the process-wide cap, OpenMP's
 * limits, fork() (the OpenMP pool released before it, the child-after-fork
 * flag), the monotonic timer, and the adaptive team policy that decides
 * whether a call opens a parallel region at all.  Only timing decides here,
 * never the bits: every thread count gives the same results (the runners
 * split outputs, never one sum).  Which ISA path runs is isa.c's.
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* dladdr */
#endif
#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if !defined(_WIN32)
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#endif
#include <stdio.h>
#include <string.h>

static volatile int g_thread_cap = 0; /* 0 = none; set from Python, read per call */
static volatile int g_forked = 0;     /* set in a child after fork() */

int lora_forked(void) { return g_forked; }

/* fork() and the OpenMP pool.  GNU libgomp keeps, per thread that opened a
 * parallel region, a pool of worker threads that fork() does not copy; a
 * child then waits forever for them at its first parallel region, whoever
 * opens it (torch's wheel ships a libgomp that torch and this library share,
 * so one threaded call of either in the parent hung torch's next threaded op
 * in the child).  Before fork(), the prepare handler releases the forking
 * thread's pool with OpenMP 5.0's omp_pause_resource_all (libgomp's frees
 * the calling thread's host pool and touches no offload device: checked in
 * GCC 12's and in the one torch 2.13's wheel ships, symbol version OMP_5.0;
 * LLVM's libomp has it too, and fork handlers of its own), so the
 * child starts without one and a parallel region there makes new threads.
 * Soft: libgomp does the same for both kinds, and libomp then keeps
 * threadprivate data.  The function is looked up in the runtime this
 * library is linked to (found through omp_get_max_threads), so an older
 * runtime without it only loses this.  The parent's next team call starts
 * its threads again (~0.1 ms).  The child still runs this library's calls
 * on one thread (g_forked): a pool of another thread of the parent, busy at
 * the fork, is not the forking thread's to release. */
#if defined(_OPENMP) && !defined(_WIN32)
/* by value, not omp.h's enum: GCC 12 implements it but its omp.h may predate
 * the enum elsewhere (_OPENMP stays 201511); the values are the standard's */
#define LORA_OMP_PAUSE_SOFT_ 1 /* omp_pause_soft */
typedef int (*lora_pause_fn_)(int);
static lora_pause_fn_ g_omp_pause = NULL;

static void lora_before_fork_(void) {
    if (g_omp_pause != NULL && omp_get_level() == 0) (void)g_omp_pause(LORA_OMP_PAUSE_SOFT_);
}

static void lora_find_omp_pause_(void) {
    Dl_info info;
    if (dladdr((void *)&omp_get_max_threads, &info) == 0 || info.dli_fname == NULL) return;
    void *runtime = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD); /* loaded: a reference */
    if (runtime == NULL) return;
    g_omp_pause = (lora_pause_fn_)dlsym(runtime, "omp_pause_resource_all");
}
#define LORA_BEFORE_FORK_ lora_before_fork_
#else
#define LORA_BEFORE_FORK_ NULL
#define lora_find_omp_pause_() ((void)0)
#endif

int lora_fork_releases_pool(void) {
#if defined(_OPENMP) && !defined(_WIN32)
    return g_omp_pause != NULL;
#else
    return 0;
#endif
}

#if !defined(_WIN32)
static void lora_after_fork_child_(void) { g_forked = 1; }
#endif

#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor))
#endif
static void lora_team_init_(void) {
#if !defined(_WIN32)
    lora_find_omp_pause_();
    pthread_atfork(LORA_BEFORE_FORK_, NULL, lora_after_fork_child_);
#endif
}

int lora_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void lora_set_num_threads(int n) { g_thread_cap = n > 0 ? n : 0; }

int lora_get_num_threads(void) {
#ifdef _OPENMP
    if (g_forked) return 1;
    int n = omp_get_max_threads();
    const int limit = omp_get_thread_limit(); /* OMP_THREAD_LIMIT caps every team */
    if (limit > 0 && limit < n) n = limit;
    const int cap = g_thread_cap;
    if (cap > 0 && cap < n) n = cap;
    return n < 1 ? 1 : n;
#else
    return 1;
#endif
}

/* ------------------------------------------------ the adaptive team policy
 *
 * A call opens a parallel region only when two things hold: it has at least
 * LORA_PAR_MIN_WORK multiply-adds (below that, waking a team costs more than
 * it saves even on idle cores), and the team calls measured lately paid off.
 * Every team call times itself: its wall time against the sum of the time its
 * threads spent computing (barrier waits excluded), which is about what one
 * thread would have needed.  A team call above LORA_TEAM_PAYOFF of that sum
 * did not pay: a thread was waiting for a CPU (other processes, or another
 * thread pool in this process, keep the cores busy), and a spinning partner
 * then burns whole scheduler time slices.
 *
 * The judge keeps accounts, not a count: what judged calls lost over the
 * payoff line is owed, what they won repays it, and the team pays again when
 * nothing is owed.  Under load the two are not alike: a won call saves a few
 * microseconds, a lost one can wait a scheduler tick (~4 ms) for its partner,
 * so a loss that later calls happen to win does not clear the debt (judging
 * each call alone, losses and wins in turn never backed off, and a 4096 x
 * 4096 rank-16 decode took 2.2x its one-thread time on a Zen 4 with both
 * cores busy elsewhere).  Once LORA_LOSSES judged calls have run in debt and
 * the last of them lost, calls run on one thread for a back-off period, and
 * the team calls after it are the next probe.
 *
 * The back-off is at least LORA_SOLO_PER times the wall time of every team
 * call since the team last paid, the probe's first call included, so probing
 * costs at most ~1/LORA_SOLO_PER of the time however long its calls waited
 * (sizing it by the last losing call alone let a probe whose first call
 * waited a tick cost as much as the 10 ms back-off it bought).  It doubles
 * from LORA_SOLO_MIN while teams keep losing, up to LORA_SOLO_MAX, and halves
 * after every team call that pays.
 *
 * The first team call of a process and the first after a back-off are timed
 * into the probe's cost but not judged: the OpenMP threads have gone to sleep
 * meanwhile (libgomp's default waits spin only briefly), and waking them can
 * cost more than a 20-100 us call saves, so judging that call would make one
 * lost call keep the process on one thread for good (a 4096 x 4096 rank-64
 * decode ran 3.6x slower that way on an idle machine); the next team call,
 * with the team awake if calls follow each other, is judged.  Requiring
 * LORA_LOSSES judged calls in debt keeps one call slowed by an interrupt on
 * an idle machine from costing 10 ms on one thread.
 *
 * Only the timing decides, never the bits: every thread count gives the same
 * results.  The state is process-wide, read and written with relaxed atomics
 * (a lost update only moves one probe). */
/* The work floor, in multiply-adds per team synchronisation (apply.c's runners pass
 * a call's work, or its work per block when a team meets at barriers in every
 * block).  Waking a team and its barriers cost ~2-3 us on a 2-vCPU VM: at
 * 2^17 a 4096 x 4096 rank-16 decode ran 5.4 us on one thread against 5.8 us
 * on two, a 1024 x 1024 rank-16 prefill of 4 positions 1.11x slower on two;
 * at 2^18 two threads took 0.53x (4096 x 4096 rank 32) and 0.60x (2048 x 2048
 * rank 64) of one thread's decode time, but a 1024 x 1024 rank-16 prefill of
 * 8 positions (two blocks of 2^17) was still 1.12x slower (minima of
 * interleaved windows). */
#define LORA_PAR_MIN_WORK ((int64_t)1 << 18)
/* The floor for a call whose adapter bytes exceed one core's L2 cache: one
 * thread then streams them from the L3 (or DRAM), and a team splits them so
 * that each core reads its share from its own L2 (hot) or keeps two streams
 * in flight (cold).  On an AMD EPYC Zen 3 VM (512 KiB L2 a core, 2 vCPUs) a
 * 4096 x 4096 rank-16 float32 decode (544 KiB with x and out, 2^17
 * multiply-adds) took 0.78x of one thread's time on two, 11008 x 4096 rank
 * 16 0.70x, and a sweep over adapters past the L3 read 15.2 GB/s on two
 * threads against 11.0 on one; at 256 KiB (rank 8, or rank 16 in bfloat16), which fits one core's L2,
 * two threads were 1.17x slower hot and 1.2x slower cold, so those stay on
 * one (medians of 7 interleaved windows).  On Intel's 1.25-2 MiB L2s the
 * same decode fits one core's L2 and keeps the plain floor (a float32 call
 * of rank r reads 4 (1 + 1/r) bytes per multiply-add: below 2^18, rank 4 and
 * up stay under 1.25 MiB). */
#define LORA_PAR_MIN_WORK_PAST_L2 ((int64_t)1 << 16)
#define LORA_TEAM_PAYOFF 0.9
#define LORA_SOLO_MIN ((int64_t)10000000)   /* ns */
#define LORA_SOLO_MAX ((int64_t)2000000000) /* ns */
#define LORA_SOLO_PER 100
#define LORA_LOSSES 2  /* judged team calls in debt, the last one lost, that start a back-off */

static int64_t g_solo_until = 0;           /* monotonic ns: one thread until then */
static int64_t g_solo_ns = LORA_SOLO_MIN;  /* the next back-off */
static int64_t g_team_calls = 0, g_team_lost = 0;
static int g_waking = 1;                   /* the next team call wakes the team: not judged */
static int64_t g_owed_ns = 0;    /* judged calls' time over the payoff line, less what they won */
static int64_t g_probe_ns = 0;   /* wall time of the team calls since the team last paid */
static int g_owing_calls = 0;    /* judged team calls since the team last paid */

#define LOAD_(v) __atomic_load_n(&(v), __ATOMIC_RELAXED)
#define STORE_(v, x) __atomic_store_n(&(v), (x), __ATOMIC_RELAXED)

/* CLOCK_MONOTONIC where POSIX has it: LLVM's libomp implements omp_get_wtime
 * with gettimeofday, whose seconds since 1970 keep only ~0.24 us in a double
 * and may step backwards; libgomp's is monotonic already. */
double lora_now(void) {
#if defined(CLOCK_MONOTONIC) && !defined(_WIN32)
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#elif defined(_OPENMP)
    return omp_get_wtime();
#else
    return 0.0;
#endif
}

/* The floor in use: the CPU table's for this core where its row measured
 * one (isa.c; `bench.py --team-compare`: on AMD Zen 4 Genoa, whose 1 MiB L2
 * holds a 4096 x 4096 rank-16 float32 decode, a cold sweep of such decodes
 * took 0.63-0.80x (float32) and 0.83-0.84x (bfloat16) of its time at 2^18
 * with a team from 2^17, and hot calls 0.64-1.06x one thread's time, where
 * a 2-vCPU Intel VM's hot 4096 x 4096 rank-16 decode took 1.07x), else
 * LORA_PAR_MIN_WORK.  Looked up once;
 * lora_team_set_min_work replaces it (measurements, tests). */
static int64_t g_min_work = -1;

int64_t lora_team_min_work(void) {
    int64_t floor = LOAD_(g_min_work);
    if (floor < 0) {
        char vendor[13];
        int family, model, stepping;
        lora_cpu_id(vendor, &family, &model, &stepping);
        floor = lora_team_floor_for_cpu(vendor, family, model);
        if (floor <= 0) floor = LORA_PAR_MIN_WORK;
        STORE_(g_min_work, floor);
    }
    return floor;
}
int64_t lora_team_default_min_work(void) { return LORA_PAR_MIN_WORK; }
void lora_team_set_min_work(int64_t floor) { STORE_(g_min_work, floor > 0 ? floor : -1); }
int64_t lora_team_min_work_past_l2(void) { return LORA_PAR_MIN_WORK_PAST_L2; }

/* One core's L2 data (or unified) cache in bytes, read once from Linux's sysfs
 * (cpu0: the cores of one machine share a size, or the smallest is not worth
 * a probe); 0 where it cannot be read, and the plain floor applies.  Read from
 * the system, never timed: the thread count never changes the bits anyway. */
static int64_t g_l2_bytes = -1;

static int64_t read_l2_bytes_(void) {
#if defined(__linux__)
    char path[96], text[32];
    for (int i = 0; i < 8; i++) {
        long level = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f) break;
        const int ok = fscanf(f, "%ld", &level) == 1;
        fclose(f);
        if (!ok || level != 2) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        if (!(f = fopen(path, "r"))) continue;
        const int type_ok = fscanf(f, "%31s", text) == 1 && strcmp(text, "Instruction") != 0;
        fclose(f);
        if (!type_ok) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r"))) continue;
        long size = 0;
        char unit = 0;
        const int got = fscanf(f, "%ld%c", &size, &unit);
        fclose(f);
        if (got < 1 || size <= 0) continue;
        if (got == 2 && (unit == 'K' || unit == 'k')) return (int64_t)size << 10;
        if (got == 2 && (unit == 'M' || unit == 'm')) return (int64_t)size << 20;
        return (int64_t)size;
    }
#endif
    return 0;
}

int64_t lora_team_l2_bytes(void) {
    int64_t l2 = LOAD_(g_l2_bytes);
    if (l2 < 0) {
        l2 = read_l2_bytes_();
        STORE_(g_l2_bytes, l2);
    }
    return l2;
}

int lora_call_threads(int64_t work, int64_t bytes) {
    if (work < lora_team_min_work()) {
        if (work < LORA_PAR_MIN_WORK_PAST_L2 || bytes <= 0) return 1;
        const int64_t l2 = lora_team_l2_bytes();
        if (l2 <= 0 || bytes <= l2) return 1;
    }
    const int nt = lora_get_num_threads();
    if (nt == 1 || LOAD_(g_solo_until) == 0) return nt;
    if ((int64_t)(lora_now() * 1e9) < LOAD_(g_solo_until)) return 1;
    STORE_(g_solo_until, 0);
    STORE_(g_waking, 1);
    return nt;
}

void lora_team_report(double wall, double busy) {
    __atomic_add_fetch(&g_team_calls, 1, __ATOMIC_RELAXED);
    const int64_t wall_ns = (int64_t)(wall * 1e9);
    const int64_t probe = __atomic_add_fetch(&g_probe_ns, wall_ns, __ATOMIC_RELAXED);
    if (__atomic_exchange_n(&g_waking, 0, __ATOMIC_RELAXED)) return;
    const int64_t over = (int64_t)((wall - LORA_TEAM_PAYOFF * busy) * 1e9);
    if (over > 0) __atomic_add_fetch(&g_team_lost, 1, __ATOMIC_RELAXED);
    const int64_t owed = LOAD_(g_owed_ns) + over;
    int64_t solo = LOAD_(g_solo_ns);
    if (owed <= 0) { /* the team pays: nothing owed */
        if (solo > LORA_SOLO_MIN) STORE_(g_solo_ns, solo / 2);
        STORE_(g_owed_ns, 0);
        STORE_(g_probe_ns, 0);
        STORE_(g_owing_calls, 0);
        return;
    }
    STORE_(g_owed_ns, owed);
    if (__atomic_add_fetch(&g_owing_calls, 1, __ATOMIC_RELAXED) < LORA_LOSSES || over <= 0) return;
    STORE_(g_owed_ns, 0);
    STORE_(g_probe_ns, 0);
    STORE_(g_owing_calls, 0);
    const int64_t cost = probe > LORA_SOLO_MAX / LORA_SOLO_PER ? LORA_SOLO_MAX : probe * LORA_SOLO_PER;
    if (cost > solo) solo = cost;
    if (solo > LORA_SOLO_MAX) solo = LORA_SOLO_MAX;
    STORE_(g_solo_until, (int64_t)(lora_now() * 1e9) + solo);
    STORE_(g_solo_ns, 2 * solo < LORA_SOLO_MAX ? 2 * solo : LORA_SOLO_MAX);
}

double lora_team_backoff(void) {
    const int64_t until = LOAD_(g_solo_until);
    const int64_t left = until ? until - (int64_t)(lora_now() * 1e9) : 0;
    return left > 0 ? (double)left * 1e-9 : 0.0;
}

void lora_team_stats(int64_t *calls, int64_t *lost) {
    *calls = LOAD_(g_team_calls);
    *lost = LOAD_(g_team_lost);
}

void lora_team_reset(void) {
    STORE_(g_solo_until, 0);
    STORE_(g_solo_ns, LORA_SOLO_MIN);
    STORE_(g_team_calls, 0);
    STORE_(g_team_lost, 0);
    STORE_(g_waking, 1);
    STORE_(g_owed_ns, 0);
    STORE_(g_probe_ns, 0);
    STORE_(g_owing_calls, 0);
}

int lora_probe_threads(void) {
    int team = 1;
#ifdef _OPENMP
    const int nt = lora_get_num_threads();
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
#pragma omp single
            team = omp_get_num_threads();
        }
    }
#endif
    return team;
}
