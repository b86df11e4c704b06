/* Products whose every output element is computed by one fixed sequence of IEEE operations,
 * whatever the shape of the call, the position of the row, the CPU or its vector width.
 *
 * BLAS picks its kernels and its order of additions by shape (OpenBLAS gives row i of x @ w other
 * bits in a call of 1, 3 or 17 rows than in a call of 64), by CPU and by thread count, so a
 * sample's activations would depend on how many samples share its micro-batch. Here:
 *
 *   matmul:    c[i,j] = the FMA chain acc = fma(a[i,k], b[k,j], acc) from acc = 0 over each
 *              block of KC consecutive k, the blocks' results added left to right
 *              (c = acc_0; c = c + acc_1; ...).
 *   outer_sum: c[k,n] = sum over rows s of round(x[s,k] * y[s,n]) in the left-to-right pairwise
 *              tree of popdist_py.engine.canonical_sum (blocks of 2**e rows, largest first, each
 *              summed pairwise level by level, then the blocks from left to right).
 *
 * Each element's sequence does not depend on tiles, edges or vector width, and FMA and IEEE
 * add/multiply are correctly rounded, so the AVX-512, AVX2 and scalar paths give the same bits.
 * No contraction of a * b + c into an FMA is allowed anywhere but where written. */
#pragma GCC optimize("fp-contract=off")
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_kernel_args.h"
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define BI_X86 1
#else
#define BI_X86 0
#endif

#define KC 256 /* part of matmul's definition: never change without changing the contract */
#define MC 96  /* cache blocking only: it does not change a bit */
#define NC 2048
#define SMALL_PACK (48 * 1024)
#define MIN(a, b) ((a) < (b) ? (a) : (b))

enum isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef struct {
    char *base;
    Py_ssize_t rows, cols, rs, cs; /* strides in bytes */
} view;

/* ------------------------------------------------------------------------------- packing */
/* A block [mc x kc] as panels of mr rows, k-major (dst[k * mr + i]); rows past m are zero. */
#define DEFINE_PACKING(T)                                                                         \
    static void pack_a_##T(const view *a, Py_ssize_t i0, Py_ssize_t mc, Py_ssize_t k0,           \
                           Py_ssize_t kc, int mr, T *dst) {                                      \
        for (Py_ssize_t ip = 0; ip < mc; ip += mr, dst += kc * mr) {                             \
            for (int i = 0; i < mr; i++) { /* along each row of a, the order it lies in */       \
                if (ip + i >= mc) {                                                              \
                    for (Py_ssize_t k = 0; k < kc; k++) dst[k * mr + i] = (T)0;                  \
                    continue;                                                                    \
                }                                                                                \
                const char *row = a->base + (i0 + ip + i) * a->rs + k0 * a->cs;                  \
                for (Py_ssize_t k = 0; k < kc; k++) dst[k * mr + i] = *(const T *)(row + k * a->cs); \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    /* B block [kc x nc] as panels of nr columns (dst[k * nr + j]); columns past n are zero. */  \
    static void pack_b_##T(const view *b, Py_ssize_t k0, Py_ssize_t kc, Py_ssize_t j0,           \
                           Py_ssize_t nc, int nr, T *dst) {                                      \
        for (Py_ssize_t jp = 0; jp < nc; jp += nr, dst += kc * nr) {                             \
            if (b->rs == (Py_ssize_t)sizeof(T)) { /* b is a transpose: read its columns along k */ \
                for (int j = 0; j < nr; j++) {                                                   \
                    const T *col = (const T *)(b->base + k0 * b->rs + (j0 + jp + j) * b->cs);    \
                    for (Py_ssize_t k = 0; k < kc; k++) dst[k * nr + j] = jp + j < nc ? col[k] : (T)0; \
                }                                                                                \
                continue;                                                                        \
            }                                                                                    \
            for (Py_ssize_t k = 0; k < kc; k++) {                                                \
                const char *row = b->base + (k0 + k) * b->rs;                                    \
                T *d = dst + k * nr;                                                             \
                if (jp + nr <= nc && b->cs == (Py_ssize_t)sizeof(T)) {                           \
                    memcpy(d, row + (j0 + jp) * b->cs, nr * sizeof(T));                          \
                } else {                                                                         \
                    for (int j = 0; j < nr; j++)                                                 \
                        d[j] = (jp + j < nc) ? *(const T *)(row + (j0 + jp + j) * b->cs) : (T)0; \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
DEFINE_PACKING(float)
DEFINE_PACKING(double)

/* Writes a finished tile: the first k block assigns, later ones add (the contract's order). */
#define DEFINE_STORE(T)                                                                           \
    static inline void store_tile_##T(const T *acc, int nr, T *c, Py_ssize_t ldc, int mv, int nv, \
                                      int first) {                                               \
        for (int i = 0; i < mv; i++)                                                             \
            for (int j = 0; j < nv; j++)                                                         \
                c[i * ldc + j] = first ? acc[i * nr + j] : c[i * ldc + j] + acc[i * nr + j];      \
    }
DEFINE_STORE(float)
DEFINE_STORE(double)

/* ------------------------------------------------------------------------- micro-kernels */
/* Each computes an mr x nr tile into acc (row-major, nr wide) from a packed panel of a and rows
 * of b ldb apart (a packed panel, or b where it lies). */
typedef void (*ukr_f32)(Py_ssize_t kc, const float *a, const float *b, Py_ssize_t ldb, float *acc);
typedef void (*ukr_f64)(Py_ssize_t kc, const double *a, const double *b, Py_ssize_t ldb, double *acc);

#define SCALAR_MR 4
#define SCALAR_NR 4
static void ukr_scalar_float(Py_ssize_t kc, const float *a, const float *b, Py_ssize_t ldb, float *acc) {
    float t[SCALAR_MR * SCALAR_NR] = {0};
    for (Py_ssize_t k = 0; k < kc; k++)
        for (int i = 0; i < SCALAR_MR; i++)
            for (int j = 0; j < SCALAR_NR; j++)
                t[i * SCALAR_NR + j] = fmaf(a[k * SCALAR_MR + i], b[k * ldb + j], t[i * SCALAR_NR + j]);
    memcpy(acc, t, sizeof t);
}
static void ukr_scalar_double(Py_ssize_t kc, const double *a, const double *b, Py_ssize_t ldb, double *acc) {
    double t[SCALAR_MR * SCALAR_NR] = {0};
    for (Py_ssize_t k = 0; k < kc; k++)
        for (int i = 0; i < SCALAR_MR; i++)
            for (int j = 0; j < SCALAR_NR; j++)
                t[i * SCALAR_NR + j] = fma(a[k * SCALAR_MR + i], b[k * ldb + j], t[i * SCALAR_NR + j]);
    memcpy(acc, t, sizeof t);
}

#if BI_X86
/* AVX2: 6 rows x 2 vectors (BLIS's Haswell shape); AVX-512: 8 rows x 2 vectors. */
#define DEFINE_UKR(NAME, T, TARGET, MR, VEC, VL, ZERO, LOAD, BCAST, FMA, STORE)                   \
    __attribute__((target(TARGET))) static void NAME(Py_ssize_t kc, const T *a, const T *b,      \
                                                     Py_ssize_t ldb, T *acc) {                   \
        VEC c0[MR], c1[MR];                                                                      \
        for (int i = 0; i < MR; i++) c0[i] = c1[i] = ZERO();                                     \
        for (Py_ssize_t k = 0; k < kc; k++) {                                                    \
            VEC b0 = LOAD(b + k * ldb), b1 = LOAD(b + k * ldb + VL);                             \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                              \
                VEC x = BCAST(a[k * MR + i]);                                                    \
                c0[i] = FMA(x, b0, c0[i]);                                                       \
                c1[i] = FMA(x, b1, c1[i]);                                                       \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < MR; i++) {                                                           \
            STORE(acc + i * 2 * VL, c0[i]);                                                      \
            STORE(acc + i * 2 * VL + VL, c1[i]);                                                 \
        }                                                                                        \
    }
DEFINE_UKR(ukr_avx2_float, float, "avx2,fma", 6, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps,
           _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps)
DEFINE_UKR(ukr_avx2_double, double, "avx2,fma", 6, __m256d, 4, _mm256_setzero_pd, _mm256_loadu_pd,
           _mm256_set1_pd, _mm256_fmadd_pd, _mm256_storeu_pd)
DEFINE_UKR(ukr_avx512_float, float, "avx512f", 8, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
           _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps)
DEFINE_UKR(ukr_avx512_double, double, "avx512f", 8, __m512d, 8, _mm512_setzero_pd, _mm512_loadu_pd,
           _mm512_set1_pd, _mm512_fmadd_pd, _mm512_storeu_pd)
#endif

/* ------------------------------------------------------------------------------- drivers */
/* The loops of a blocked product: the k blocks are KC wide and run in order, which is all the
 * result depends on; the i and j blocking only decides what is in cache. */
#define DEFINE_MATMUL(T, UKR_T)                                                                   \
    static int matmul_##T(const view *a, const view *b, T *c, UKR_T ukr, int mr, int nr) {       \
        Py_ssize_t m = a->rows, kk = a->cols, n = b->cols;                                       \
        if (kk == 0) {                                                                           \
            memset(c, 0, (size_t)m * n * sizeof(T));                                             \
            return 0;                                                                            \
        }                                                                                        \
        /* One panel of rows reads each column of b once: packing b would only copy it. */      \
        int direct = m <= mr && b->cs == (Py_ssize_t)sizeof(T) && b->rs % (Py_ssize_t)sizeof(T) == 0; \
        Py_ssize_t mcap = ((MIN(m, MC) + mr - 1) / mr) * mr;                                     \
        Py_ssize_t ncap = direct ? nr : ((MIN(n, NC) + nr - 1) / nr) * nr;                       \
        size_t kcap = (size_t)MIN(kk, KC);                                                       \
        size_t abytes = (mcap * kcap * sizeof(T) + 63) / 64 * 64;                                \
        size_t bbytes = (ncap * kcap * sizeof(T) + 63) / 64 * 64;                                \
        /* Small calls pack on the stack: their time is mostly overhead. */                      \
        char small[SMALL_PACK] __attribute__((aligned(64)));                                     \
        int on_heap = abytes + bbytes > SMALL_PACK;                                              \
        T *pa = on_heap ? aligned_alloc(64, abytes) : (T *)small;                                \
        T *pb = on_heap ? aligned_alloc(64, bbytes) : (T *)(small + abytes);                     \
        T acc[16 * 64] __attribute__((aligned(64)));                                             \
        if (!pa || !pb) {                                                                        \
            if (on_heap) {                                                                       \
                free(pa);                                                                        \
                free(pb);                                                                        \
            }                                                                                    \
            return -1;                                                                           \
        }                                                                                        \
        for (Py_ssize_t j0 = 0; j0 < n; j0 += NC) {                                              \
            Py_ssize_t nc = n - j0 < NC ? n - j0 : NC;                                           \
            for (Py_ssize_t k0 = 0; k0 < kk; k0 += KC) {                                         \
                Py_ssize_t kc = kk - k0 < KC ? kk - k0 : KC;                                     \
                if (!direct) pack_b_##T(b, k0, kc, j0, nc, nr, pb);                              \
                for (Py_ssize_t i0 = 0; i0 < m; i0 += MC) {                                      \
                    Py_ssize_t mc = m - i0 < MC ? m - i0 : MC;                                   \
                    pack_a_##T(a, i0, mc, k0, kc, mr, pa);                                       \
                    for (Py_ssize_t jp = 0; jp < nc; jp += nr) {                                 \
                        int nv = nc - jp < nr ? (int)(nc - jp) : nr;                             \
                        for (Py_ssize_t ip = 0; ip < mc; ip += mr) {                             \
                            int mv = mc - ip < mr ? (int)(mc - ip) : mr;                         \
                            if (!direct)                                                         \
                                ukr(kc, pa + ip * kc, pb + jp * kc, nr, acc);                    \
                            else if (nv == nr) /* b's rows where they lie */                    \
                                ukr(kc, pa + ip * kc, (const T *)(b->base + k0 * b->rs) + j0 + jp, \
                                    b->rs / (Py_ssize_t)sizeof(T), acc);                         \
                            else { /* the last columns, padded */                               \
                                pack_b_##T(b, k0, kc, j0 + jp, nv, nr, pb);                      \
                                ukr(kc, pa + ip * kc, pb, nr, acc);                              \
                            }                                                                    \
                            store_tile_##T(acc, nr, c + (i0 + ip) * n + j0 + jp, n, mv, nv,       \
                                           k0 == 0);                                             \
                        }                                                                        \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        if (on_heap) {                                                                           \
            free(pa);                                                                            \
            free(pb);                                                                            \
        }                                                                                        \
        return 0;                                                                                \
    }
DEFINE_MATMUL(float, ukr_f32)
DEFINE_MATMUL(double, ukr_f64)

/* outer_sum: a tile of TK of x's columns by TN of y's columns, from packed copies (xt: x's
 * columns as rows of `rows` values; yp: y's TN columns as `rows` rows of TN), zero-padded so every
 * tile is whole. Rows of the batch go in groups of 8 (a subtree of the canonical tree when the
 * group starts at a multiple of 8), whose sums wait on a binary-counter stack, one level per
 * power of two, until their sibling arrives. */
#define TK 8
#define TN 64
#define MAX_LEVELS 64
#define DEFINE_OUTER_TILE(T, NAME, ATTR, VB)                                                      \
    typedef T NAME##_vec __attribute__((vector_size(VB), aligned(sizeof(T))));                   \
    ATTR static void NAME(const T *xt, const T *yp, Py_ssize_t rows, T *res, T *stack) {         \
        typedef NAME##_vec VEC;                                                                  \
        enum { W = VB / (int)sizeof(T) };                                                        \
        uint64_t occupied = 0;                                                                   \
        T cur[TK * TN] __attribute__((aligned(64)));                                             \
        int have_res = 0;                                                                        \
        Py_ssize_t full = rows & ~(Py_ssize_t)7;                                                 \
        for (Py_ssize_t s = 0; s < full; s += 8) {                                               \
            T xs[TK][8];                                                                         \
            for (int i = 0; i < TK; i++) memcpy(xs[i], xt + i * rows + s, sizeof xs[i]);         \
            const T *yr = yp + s * TN;                                                           \
            for (int j = 0; j < TN; j += W) { /* each y vector loaded once for the TK rows */    \
                VEC y0 = *(const VEC *)(yr + j), y1 = *(const VEC *)(yr + TN + j);               \
                VEC y2 = *(const VEC *)(yr + 2 * TN + j), y3 = *(const VEC *)(yr + 3 * TN + j);  \
                VEC y4 = *(const VEC *)(yr + 4 * TN + j), y5 = *(const VEC *)(yr + 5 * TN + j);  \
                VEC y6 = *(const VEC *)(yr + 6 * TN + j), y7 = *(const VEC *)(yr + 7 * TN + j);  \
                _Pragma("GCC unroll 8") for (int i = 0; i < TK; i++) {                           \
                    const T *a = xs[i];                                                          \
                    *(VEC *)(cur + i * TN + j) = ((a[0] * y0 + a[1] * y1) + (a[2] * y2 + a[3] * y3)) + \
                                                 ((a[4] * y4 + a[5] * y5) + (a[6] * y6 + a[7] * y7)); \
                }                                                                                \
            }                                                                                    \
            int level = 0;                                                                       \
            while (occupied >> level & 1) { /* the older sibling is on the left */               \
                const T *left = stack + (size_t)level * TK * TN;                                 \
                for (int e = 0; e < TK * TN; e++) cur[e] = left[e] + cur[e];                     \
                occupied &= ~((uint64_t)1 << level);                                             \
                level++;                                                                         \
            }                                                                                    \
            memcpy(stack + (size_t)level * TK * TN, cur, sizeof cur);                            \
            occupied |= (uint64_t)1 << level;                                                    \
        }                                                                                        \
        /* The stack's blocks, largest (leftmost) first, then the last rows' blocks of 4, 2, 1. */ \
        for (int level = MAX_LEVELS - 1; level >= 0; level--) {                                  \
            if (!(occupied >> level & 1)) continue;                                              \
            const T *blk = stack + (size_t)level * TK * TN;                                      \
            for (int e = 0; e < TK * TN; e++) res[e] = have_res ? res[e] + blk[e] : blk[e];     \
            have_res = 1;                                                                        \
        }                                                                                        \
        Py_ssize_t s = full;                                                                     \
        for (int size = 4; size >= 1; size >>= 1) {                                              \
            if (!((rows - full) & size)) continue;                                               \
            for (int i = 0; i < TK; i++) {                                                       \
                const T *a = xt + i * rows + s, *yr = yp + s * TN;                               \
                for (int j = 0; j < TN; j++) {                                                   \
                    T v;                                                                         \
                    if (size == 4)                                                               \
                        v = (a[0] * yr[j] + a[1] * yr[TN + j]) + (a[2] * yr[2 * TN + j] + a[3] * yr[3 * TN + j]); \
                    else if (size == 2)                                                          \
                        v = a[0] * yr[j] + a[1] * yr[TN + j];                                    \
                    else                                                                         \
                        v = a[0] * yr[j];                                                        \
                    res[i * TN + j] = have_res ? res[i * TN + j] + v : v;                        \
                }                                                                                \
            }                                                                                    \
            have_res = 1;                                                                        \
            s += size;                                                                           \
        }                                                                                        \
    }
#if BI_X86
DEFINE_OUTER_TILE(float, outer_tile_avx512_float, __attribute__((target("avx512f"))), 64)
DEFINE_OUTER_TILE(double, outer_tile_avx512_double, __attribute__((target("avx512f"))), 64)
DEFINE_OUTER_TILE(float, outer_tile_avx2_float, __attribute__((target("avx2"))), 32)
DEFINE_OUTER_TILE(double, outer_tile_avx2_double, __attribute__((target("avx2"))), 32)
#endif
DEFINE_OUTER_TILE(float, outer_tile_scalar_float, , 16)
DEFINE_OUTER_TILE(double, outer_tile_scalar_double, , 16)

typedef void (*outer_f32)(const float *, const float *, Py_ssize_t, float *, float *);
typedef void (*outer_f64)(const double *, const double *, Py_ssize_t, double *, double *);

/* The bytes of outer_sum's packed copies of x [rows, kk] (xt, kk padded to TK) and of a panel
 * of y (yp), rounded up to 64: 0, or -1 when either exceeds the address space. A broadcast x
 * (stride 0) can have more rows than memory holds, so these are computed with checked products
 * before anything is allocated. */
static int outer_sizes(Py_ssize_t rows, Py_ssize_t kk, Py_ssize_t itemsize, Py_ssize_t *xbytes,
                       Py_ssize_t *ybytes) {
    Py_ssize_t kpad = kk / TK * TK + (kk % TK ? TK : 0); /* kk + TK - 1 could overflow */
    Py_ssize_t xb = ka_mul(ka_mul(kpad, rows), itemsize), yb = ka_mul(ka_mul(rows, TN), itemsize);
    if (kpad < kk || xb < 0 || yb < 0 || xb > PY_SSIZE_T_MAX - 63 || yb > PY_SSIZE_T_MAX - 63) return -1;
    *xbytes = (xb + 63) / 64 * 64;
    *ybytes = (yb + 63) / 64 * 64;
    return 0;
}

/* Packs x's columns as rows (TK at a time) and y's columns in panels of TN (zero-padded), then
 * runs the tiles panel by panel, so each panel stays in cache while every k tile passes over it.
 * xbytes and ybytes: the packed copies' sizes from outer_sizes. */
#define DEFINE_OUTER(T, TILE_T)                                                                   \
    static int outer_##T(const view *x, const T *y, Py_ssize_t n, T *c, TILE_T tile, Py_ssize_t xbytes, \
                         Py_ssize_t ybytes) {                                                    \
        Py_ssize_t rows = x->rows, kk = x->cols;                                                 \
        Py_ssize_t kpad = (kk + TK - 1) / TK * TK;                                               \
        T *stack = aligned_alloc(64, sizeof(T) * MAX_LEVELS * TK * TN);                          \
        T *xt = aligned_alloc(64, (size_t)xbytes);                                               \
        T *yp = aligned_alloc(64, (size_t)ybytes);                                               \
        T res[TK * TN] __attribute__((aligned(64)));                                             \
        if (!stack || !xt || !yp) {                                                              \
            free(stack);                                                                         \
            free(xt);                                                                            \
            free(yp);                                                                            \
            return -1;                                                                           \
        }                                                                                        \
        memset(xt + kk * rows, 0, (size_t)(kpad - kk) * rows * sizeof(T));                      \
        for (Py_ssize_t s0 = 0; s0 < rows; s0 += 16) { /* transposed in blocks that stay in L1 */ \
            Py_ssize_t se = MIN(rows, s0 + 16);                                                  \
            for (Py_ssize_t k = 0; k < kk; k++)                                                  \
                for (Py_ssize_t s = s0; s < se; s++)                                             \
                    xt[k * rows + s] = *(const T *)(x->base + s * x->rs + k * x->cs);            \
        }                                                                                        \
        for (Py_ssize_t n0 = 0; n0 < n; n0 += TN) {                                              \
            int nv = n - n0 < TN ? (int)(n - n0) : TN;                                           \
            for (Py_ssize_t s = 0; s < rows; s++) {                                              \
                memcpy(yp + s * TN, y + s * n + n0, nv * sizeof(T));                             \
                memset(yp + s * TN + nv, 0, (TN - nv) * sizeof(T));                              \
            }                                                                                    \
            for (Py_ssize_t k0 = 0; k0 < kk; k0 += TK) {                                         \
                int kv = kk - k0 < TK ? (int)(kk - k0) : TK;                                     \
                tile(xt + k0 * rows, yp, rows, res, stack);                                      \
                for (int i = 0; i < kv; i++) memcpy(c + (k0 + i) * n + n0, res + i * TN, nv * sizeof(T)); \
            }                                                                                    \
        }                                                                                        \
        free(stack);                                                                             \
        free(xt);                                                                                \
        free(yp);                                                                                \
        return 0;                                                                                \
    }
DEFINE_OUTER(float, outer_f32)
DEFINE_OUTER(double, outer_f64)

/* ------------------------------------------------------------------------------ Python API */
static int best_isa_found = -1;

/* CPUID and XGETBV asked directly, not __builtin_cpu_supports: that reads the CPU model of the
 * compiler's runtime (libgcc's, LLVM's compiler-rt), which zig's C compiler, the one `make dist`
 * builds the wheel with, does not fill in: there it said no to everything, and the scalar path ran
 * 60 times slower. A feature counts where the OS also saves its registers (XCR0): SSE and AVX
 * state for AVX2, the opmask and ZMM state as well for AVX-512. */
static int find_best_isa(void) {
#if BI_X86
    unsigned int a, b, c, d, xcr0, xcr0_high;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return ISA_SCALAR;
    const int fma = (c & bit_FMA) != 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_high) : "c"(0));
    if ((xcr0 & 0x6) != 0x6 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return ISA_SCALAR;
    if ((b & bit_AVX512F) && (xcr0 & 0xe6) == 0xe6) return ISA_AVX512;
    if ((b & bit_AVX2) && fma) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

static int best_isa(void) { return best_isa_found; }

/* 4: float32, 8: float64, 0: another dtype (or byte order). */
static int kind_of(const Py_buffer *buf) {
    return ka_code(buf, 4) == 'f' ? 4 : ka_code(buf, 8) == 'd' ? 8 : 0;
}

/* Operand `name` of `func` as a 2-d view of float32 or float64 items, each aligned to its size;
 * an output (`output`) must also be writable and C-contiguous. Every refusal names the operand:
 * TypeError for what is no float array, ValueError for its shape or layout. */
static int get_view(PyObject *obj, Py_buffer *buf, view *v, int output, const char *func, const char *name) {
    if (ka_get(obj, buf, func, name) < 0) return -1;
    if (!kind_of(buf))
        PyErr_Format(PyExc_TypeError, "%s: %s must be float32 or float64, got buffer format '%s'", func, name,
                     ka_format(buf));
    else if (buf->ndim != 2)
        PyErr_Format(PyExc_ValueError, "%s: %s must be 2-d, got %d-d", func, name, buf->ndim);
    else if (!ka_aligned(buf))
        PyErr_Format(PyExc_ValueError, "%s: %s's items are not aligned to their %zd bytes", func, name,
                     buf->itemsize);
    else if (output && buf->readonly)
        PyErr_Format(PyExc_ValueError, "%s: %s is read-only", func, name);
    else if (output && !PyBuffer_IsContiguous(buf, 'C'))
        PyErr_Format(PyExc_ValueError, "%s: %s must be C-contiguous", func, name);
    else {
        v->base = buf->buf;
        v->rows = buf->shape[0];
        v->cols = buf->shape[1];
        v->rs = buf->strides[0];
        v->cs = buf->strides[1];
        return 0;
    }
    PyBuffer_Release(buf);
    return -1;
}

static int check_isa(const char *func, int isa) {
    if (isa >= ISA_SCALAR && isa <= best_isa()) return 0;
    PyErr_Format(PyExc_ValueError, "%s: isa %d is not one this CPU runs (0 to %d)", func, isa, best_isa());
    return -1;
}

/* What every entry point starts from: its arguments (p, q, out, isa) checked, as views of one
 * float kind. Filled by parse_operands, ended by release_operands. */
typedef struct {
    Py_buffer bufs[3];
    view v[3];
    int isa;
    int kind; /* 4: float32, 8: float64 */
} operands;

/* The arguments of func, named `names` in messages, into *ops: 0, or -1 with the error set and
 * every buffer released (or none taken). Each operand is checked (get_view), then that they share
 * one dtype, then isa; what an entry point adds (how the shapes fit) comes after. */
static int parse_operands(PyObject *args, const char *func, const char *const names[3], operands *ops) {
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOOi", &objs[0], &objs[1], &objs[2], &ops->isa)) return -1;
    for (int i = 0; i < 3; i++) {
        if (get_view(objs[i], &ops->bufs[i], &ops->v[i], i == 2, func, names[i]) < 0) {
            while (i--) PyBuffer_Release(&ops->bufs[i]);
            return -1;
        }
    }
    ops->kind = kind_of(&ops->bufs[0]);
    if (kind_of(&ops->bufs[1]) != ops->kind || kind_of(&ops->bufs[2]) != ops->kind)
        PyErr_Format(PyExc_TypeError, "%s: %s, %s and %s must share one dtype, got formats '%s', '%s' and '%s'",
                     func, names[0], names[1], names[2], ka_format(&ops->bufs[0]), ka_format(&ops->bufs[1]),
                     ka_format(&ops->bufs[2]));
    else if (check_isa(func, ops->isa) == 0)
        return 0;
    for (int i = 0; i < 3; i++) PyBuffer_Release(&ops->bufs[i]);
    return -1;
}

/* The end of every entry point: the buffers released, None when rc is 0, else the error set. */
static PyObject *release_operands(operands *ops, int rc) {
    for (int i = 0; i < 3; i++) PyBuffer_Release(&ops->bufs[i]);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    static const char *const names[3] = {"a", "b", "out"};
    operands ops;
    if (parse_operands(args, "matmul", names, &ops) < 0) return NULL;
    const view *a = &ops.v[0], *b = &ops.v[1], *c = &ops.v[2];
    int isa = ops.isa, kind = ops.kind, rc = -2;
    if (a->cols != b->rows)
        PyErr_Format(PyExc_ValueError, "matmul: a is [%zd, %zd] and b [%zd, %zd]: a's columns must be b's rows",
                     a->rows, a->cols, b->rows, b->cols);
    else if (c->rows != a->rows || c->cols != b->cols)
        PyErr_Format(PyExc_ValueError, "matmul: out must be [%zd, %zd], got [%zd, %zd]", a->rows, b->cols, c->rows,
                     c->cols);
    else {
        Py_BEGIN_ALLOW_THREADS
        if (kind == 4) {
            ukr_f32 u = ukr_scalar_float;
            int mr = SCALAR_MR, nr = SCALAR_NR;
#if BI_X86
            if (isa == ISA_AVX512) { u = ukr_avx512_float; mr = 8; nr = 32; }
            else if (isa == ISA_AVX2) { u = ukr_avx2_float; mr = 6; nr = 16; }
#endif
            rc = matmul_float(a, b, (float *)c->base, u, mr, nr);
        } else {
            ukr_f64 u = ukr_scalar_double;
            int mr = SCALAR_MR, nr = SCALAR_NR;
#if BI_X86
            if (isa == ISA_AVX512) { u = ukr_avx512_double; mr = 8; nr = 16; }
            else if (isa == ISA_AVX2) { u = ukr_avx2_double; mr = 6; nr = 8; }
#endif
            rc = matmul_double(a, b, (double *)c->base, u, mr, nr);
        }
        Py_END_ALLOW_THREADS
        if (rc == -1) PyErr_NoMemory();
    }
    return release_operands(&ops, rc);
}

static PyObject *py_outer_sum(PyObject *self, PyObject *args) {
    static const char *const names[3] = {"x", "y", "out"};
    operands ops;
    if (parse_operands(args, "outer_sum", names, &ops) < 0) return NULL;
    const view *x = &ops.v[0], *y = &ops.v[1], *c = &ops.v[2];
    int isa = ops.isa, kind = ops.kind, rc = -2;
    Py_ssize_t xbytes = 0, ybytes = 0;
    if (x->rows < 1 || y->rows != x->rows)
        PyErr_Format(PyExc_ValueError, "outer_sum: x and y must have the same rows, at least one; got %zd and %zd",
                     x->rows, y->rows);
    else if (!PyBuffer_IsContiguous(&ops.bufs[1], 'C'))
        PyErr_SetString(PyExc_ValueError, "outer_sum: y must be C-contiguous");
    else if (c->rows != x->cols || c->cols != y->cols)
        PyErr_Format(PyExc_ValueError, "outer_sum: out must be [%zd, %zd], got [%zd, %zd]", x->cols, y->cols,
                     c->rows, c->cols);
    else if (outer_sizes(x->rows, x->cols, kind, &xbytes, &ybytes) < 0)
        PyErr_Format(PyExc_MemoryError, "outer_sum: x has %zd rows of %zd: its packed copy would not fit in the "
                     "address space", x->rows, x->cols);
    else if (c->rows == 0 || c->cols == 0)
        rc = 0; /* an empty out: nothing to compute, nothing to allocate */
    else {
        Py_ssize_t n = y->cols;
        Py_BEGIN_ALLOW_THREADS
        if (kind == 4) {
            outer_f32 t = outer_tile_scalar_float;
#if BI_X86
            if (isa == ISA_AVX512) t = outer_tile_avx512_float;
            else if (isa == ISA_AVX2) t = outer_tile_avx2_float;
#endif
            rc = outer_float(x, (const float *)y->base, n, (float *)c->base, t, xbytes, ybytes);
        } else {
            outer_f64 t = outer_tile_scalar_double;
#if BI_X86
            if (isa == ISA_AVX512) t = outer_tile_avx512_double;
            else if (isa == ISA_AVX2) t = outer_tile_avx2_double;
#endif
            rc = outer_double(x, (const double *)y->base, n, (double *)c->base, t, xbytes, ybytes);
        }
        Py_END_ALLOW_THREADS
        if (rc == -1)
            PyErr_Format(PyExc_MemoryError, "outer_sum: no memory for the packed copies of x and y (%zd bytes)",
                         xbytes + ybytes);
    }
    return release_operands(&ops, rc);
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(a, b, out, isa): out = a @ b in the fixed order."},
    {"outer_sum", py_outer_sum, METH_VARARGS, "outer_sum(x, y, out, isa): out = x.T @ y as a canonical tree."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batch_invariant", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__batch_invariant(void) {
    best_isa_found = find_best_isa();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "KC", KC) < 0 || PyModule_AddIntConstant(m, "BEST_ISA", best_isa()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
