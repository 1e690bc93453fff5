/*
 * isa.c - which ISA path runs: CPU feature detection, the table of CPU
 * models whose path was measured, the kernel table in use, forcing another
 * path on request, and the build facts kernel_info() reports.
 *
 * The path is a pointer to one ISA file's kernel table (lora_kernels_<isa>,
 * kernels.h), set once at load:
 *   1. the flags rule, lora_best_isa: the widest path the CPU's feature bits
 *      allow (__builtin_cpu_supports, cpuid for F16C; on aarch64 NEON is
 *      baseline and always chosen);
 *   2. then CORES_ below, looked up by the vendor, family and model cpuid
 *      reports (lora_isa_for_cpu): a row may name a narrower path for a core
 *      where it measured faster (a core that decodes AVX-512 but runs it on
 *      256-bit units), never a wider one.
 * Never a timing probe: a probe on a shared machine would pick different
 * paths, hence different bits (each path has its own summation order), from
 * run to run; a table gives one path per CPU model.  lora_set_isa forces any
 * supported path (the Python layer applies LORA_ISA through it).  Threads and
 * the team policy are team.c's.
 */
#include <string.h>

#include "internal.h"

#if defined(LORA_HAVE_X86)
#include <cpuid.h>
#endif

/* One CPU model whose path was measured.  `isa` is the path to run there,
 * or FLAGS_ where the flags rule is what the measurement supports (the row
 * then only names the core).  `team_floor_log2`, where not 0, replaces
 * team.c's default work floor for a team on that core, as measured there
 * (one and two threads, interleaved; the thread count never changes the
 * bits).  `evidence` points at the benchmark rows that measured it; a row
 * without a measurement does not belong here. */
typedef struct {
    const char *vendor;       /* cpuid leaf 0: "GenuineIntel", "AuthenticAMD" */
    int family;               /* base family + extended family */
    int model_lo, model_hi;   /* (extended model << 4) + model, inclusive */
    int isa;                  /* LORA_ISA_* or FLAGS_ */
    int team_floor_log2;      /* the measured team floor (team.c), 0: the default one */
    int q8_0_widening;        /* LORA_Q8_0_WIDEN_*: how the AVX-512 path builds Q8_0 values */
    const char *name;
    const char *evidence;
} core_row_;

#define FLAGS_ (-1)

/* To add a core: run `python benchmarks/bench.py --isa-compare` on it and
 * paste the row it prints, with its evidence, and the run into
 * docs/performance.md ("ISA paths by CPU").  A row covers the models that
 * were measured: Zen 4 Genoa (model 0x11) runs AVX-512 on 256-bit units and
 * still measured fastest on avx512; its other models (Raphael 0x61, Bergamo
 * 0xa0, ...) keep the flags rule without a row until someone measures them. */
static const core_row_ CORES_[] = {
    {"GenuineIntel", 6, 106, 106, FLAGS_, 0, LORA_Q8_0_WIDEN_SHUFFLE, "Ice Lake-SP",
     "docs/performance.md 'One full run on an Intel Ice Lake-SP': every row on avx512 "
     "(no avx2 run recorded to compare)"},
    {"AuthenticAMD", 25, 1, 1, FLAGS_, 0, LORA_Q8_0_WIDEN_SHUFFLE, "Zen 3 (Milan)",
     "no AVX-512; docs/performance.md 'ISA paths by CPU': bench.py --isa-compare, "
     "avx2 fastest on 4/4 rows"},
    {"AuthenticAMD", 25, 17, 17, FLAGS_, 17, LORA_Q8_0_WIDEN_CVT, "Zen 4 (Genoa)",
     "AVX-512 on 256-bit units; docs/performance.md 'ISA paths by CPU': bench.py --isa-compare, "
     "avx512 fastest on 4/4 rows, avx2 1.27x its time; bench.py --team-compare: with a team "
     "from 2^17 multiply-adds a cold decode sweep takes 0.63-0.80x (f32), 0.83-0.84x (bf16) its "
     "time at 2^18; Q8_0 values by conversion: docs/performance.md 'Building Q8_0 values'"},
};
#define N_CORES_ ((int)(sizeof CORES_ / sizeof CORES_[0]))

static const lora_kernel_table *g_kt = &lora_kernels_scalar;
static int g_isa = LORA_ISA_SCALAR;
static int g_source = LORA_ISA_FROM_FLAGS;

const lora_kernel_table *lora_active_kernels(void) { return g_kt; }

int lora_cpu_id(char *vendor, int *family, int *model, int *stepping) {
    vendor[0] = '\0';
    *family = *model = *stepping = -1;
#if defined(LORA_HAVE_X86)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 0;
    memcpy(vendor, &ebx, 4), memcpy(vendor + 4, &edx, 4), memcpy(vendor + 8, &ecx, 4);
    vendor[12] = '\0';
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    const int base = (eax >> 8) & 0xf;  /* the SDM's and the APM's rule */
    *family = base == 0xf ? base + (int)((eax >> 20) & 0xff) : base;
    *model = (int)((eax >> 4) & 0xf);
    if (base == 0x6 || base == 0xf) *model += (int)((eax >> 16) & 0xf) << 4;
    *stepping = (int)(eax & 0xf);
    return 1;
#else
    return 0;
#endif
}

/* the CPU table's row for this vendor / family / model, or NULL */
static const core_row_ *core_row_for_(const char *vendor, int family, int model) {
    for (int i = 0; vendor && i < N_CORES_; i++)
        if (!strcmp(vendor, CORES_[i].vendor) && family == CORES_[i].family &&
            model >= CORES_[i].model_lo && model <= CORES_[i].model_hi)
            return &CORES_[i];
    return NULL;
}

int lora_isa_for_cpu(const char *vendor, int family, int model, int flags_best,
                     const char **name, const char **evidence) {
    const core_row_ *row = core_row_for_(vendor, family, model);
    if (name) *name = row ? row->name : NULL;
    if (evidence) *evidence = row ? row->evidence : NULL;
    /* x86 codes rank by width and every wider path needs the narrower one's
     * features, so a row's path at or below flags_best is one the CPU runs */
    const int x86 = flags_best >= LORA_ISA_SCALAR && flags_best <= LORA_ISA_AVX512;
    if (row && row->isa != FLAGS_ && x86 && row->isa >= LORA_ISA_SCALAR && row->isa <= flags_best)
        return row->isa;
    return flags_best;
}

/* The Q8_0 build of the AVX-512 hot loops (kernels_avx512.c, q8_0_f32x16_): the CPU table's
 * for this core, else shuffle, the one measured on Intel's cores.  Either gives the same bits;
 * lora_set_q8_0_widening replaces it (tests run both). */
static int g_q8_0_widening = LORA_Q8_0_WIDEN_SHUFFLE;

int lora_q8_0_widening_for_cpu(const char *vendor, int family, int model) {
    const core_row_ *row = core_row_for_(vendor, family, model);
    return row ? row->q8_0_widening : LORA_Q8_0_WIDEN_SHUFFLE;
}
int lora_q8_0_widening(void) { return __atomic_load_n(&g_q8_0_widening, __ATOMIC_RELAXED); }
int lora_set_q8_0_widening(int w) {
    if (w != LORA_Q8_0_WIDEN_SHUFFLE && w != LORA_Q8_0_WIDEN_CVT) return LORA_ERR_ARG;
    __atomic_store_n(&g_q8_0_widening, w, __ATOMIC_RELAXED);
    return LORA_OK;
}

int64_t lora_team_floor_for_cpu(const char *vendor, int family, int model) {
    const core_row_ *row = core_row_for_(vendor, family, model);
    return row && row->team_floor_log2 > 0 ? (int64_t)1 << row->team_floor_log2 : 0;
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

static int use_path_(int isa) {
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

#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor))
#endif
static void lora_isa_init_(void) {
    char vendor[13];
    int family, model, stepping;
    lora_cpu_id(vendor, &family, &model, &stepping);
    const int flags = lora_best_isa();
    const int isa = lora_isa_for_cpu(vendor, family, model, flags, NULL, NULL);
    g_q8_0_widening = lora_q8_0_widening_for_cpu(vendor, family, model);
    if (isa != flags && use_path_(isa) == LORA_OK) {
        g_source = LORA_ISA_FROM_TABLE;
    } else {
        use_path_(flags);
        g_source = LORA_ISA_FROM_FLAGS;
    }
}

int lora_get_isa(void) { return g_isa; }

int lora_isa_source(void) { return g_source; }

int lora_set_isa(int isa) {
    const int st = use_path_(isa);
    if (st == LORA_OK) g_source = LORA_ISA_FROM_CALLER;
    return st;
}

int64_t lora_project_column_block(void) { return LORA_JBLOCK; }

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
