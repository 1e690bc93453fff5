/*
 * runtime.c - which ISA path runs (CPU feature detection, LORA_ISA lowering
 * is done by the Python layer through lora_set_isa), how many threads a call
 * may use, the fork handler, and build facts for kernel_info().
 *
 * The path is a pointer to one ISA file's kernel table, set once at load
 * from the CPU's feature bits (__builtin_cpu_supports, cpuid for F16C; on
 * aarch64 NEON is baseline and always chosen) and lowered on request; it can
 * never be raised above what the CPU supports.
 */
#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(LORA_HAVE_X86)
#include <cpuid.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#endif

static const lora_kernel_table *g_kt = &lora_kernels_scalar;
static int g_isa = LORA_ISA_SCALAR;
static volatile int g_thread_cap = 0; /* 0 = none; set from Python, read per call */
static volatile int g_forked = 0;     /* set in a child after fork() */

const lora_kernel_table *lora_active_kernels(void) { return g_kt; }

int lora_forked(void) { return g_forked; }

#if !defined(_WIN32)
static void lora_after_fork_child_(void) { g_forked = 1; }
#endif

#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor))
#endif
static void lora_init_(void) {
#if !defined(_WIN32)
    pthread_atfork(NULL, NULL, lora_after_fork_child_);
#endif
    g_isa = lora_best_isa();
    lora_set_isa(g_isa);
}

int lora_isa_supported(int isa) {
    if (isa == LORA_ISA_SCALAR) return 1;
#if defined(LORA_HAVE_NEON)
    if (isa == LORA_ISA_NEON) return 1;
#endif
#if defined(LORA_HAVE_X86)
    __builtin_cpu_init();
    unsigned eax, ebx, ecx, edx;
    const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    if (isa == LORA_ISA_AVX2) return avx2;
    if (isa == LORA_ISA_AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

int lora_best_isa(void) {
#if defined(LORA_HAVE_NEON)
    return LORA_ISA_NEON;
#endif
    if (lora_isa_supported(LORA_ISA_AVX512)) return LORA_ISA_AVX512;
    if (lora_isa_supported(LORA_ISA_AVX2)) return LORA_ISA_AVX2;
    return LORA_ISA_SCALAR;
}

int lora_get_isa(void) { return g_isa; }

int lora_set_isa(int isa) {
    if (!lora_isa_supported(isa)) return LORA_ERR_ARG;
    switch (isa) {
#if defined(LORA_HAVE_X86)
    case LORA_ISA_AVX512: g_kt = &lora_kernels_avx512; break;
    case LORA_ISA_AVX2: g_kt = &lora_kernels_avx2; break;
#endif
#if defined(LORA_HAVE_NEON)
    case LORA_ISA_NEON: g_kt = &lora_kernels_neon; break;
#endif
    default: g_kt = &lora_kernels_scalar; break;
    }
    g_isa = isa;
    return LORA_OK;
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

const char *lora_compiler(void) {
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#elif defined(_MSC_VER)
    return "msvc";
#else
    return "unknown";
#endif
}

