/*
 * isa.c - which ISA path runs: CPU feature detection, the kernel table in
 * use, lowering it on request, and the build facts kernel_info() reports.
 *
 * The path is a pointer to one ISA file's kernel table (lora_kernels_<isa>,
 * kernels.h), set once at load from the CPU's feature bits
 * (__builtin_cpu_supports, cpuid for F16C; on aarch64 NEON is baseline and
 * always chosen) and lowered on request (lora_set_isa: the Python layer
 * applies LORA_ISA through it); it can never be raised above what the CPU
 * supports.  Threads and the team policy are team.c's.
 */
#include "internal.h"

#if defined(LORA_HAVE_X86)
#include <cpuid.h>
#endif

static const lora_kernel_table *g_kt = &lora_kernels_scalar;
static int g_isa = LORA_ISA_SCALAR;

const lora_kernel_table *lora_active_kernels(void) { return g_kt; }

#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor))
#endif
static void lora_isa_init_(void) {
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
