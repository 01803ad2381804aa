/* The build's instruction set, and the macros every unit of the kernels' library shares (trserve,
 * engine/model/csrc/).
 *
 * Each .c file here is compiled with the same flags for one ISA variant, and the variant's units are
 * linked into one library (engine/model/kernels/build.py picks the variant the CPU runs):
 *   avx512vnni: avx512's and -mavx512vnni (the int8 arithmetic's integer dot products in one instruction)
 *   avx512: -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c
 *   avx2vnni:   avx2's and -mavxvnni (AVX-VNNI: vpdpbusd on 256 bits)
 *   avx2:   -mavx2 -mfma -mf16c
 *   scalar: baseline x86-64 (fmaf from libm; slow, the fallback of last resort)
 * all with -ffp-contract=off so the compiler never fuses or splits a multiply-add on its own.
 * Every unit checks here that its flags make a whole variant.
 *
 * INLINE: the small hot helpers of the headers (vec.h, dot.h), forced inline into their callers'
 * loops. HIDDEN: a function one unit gives another (pool.h, qlinear.h): a direct call inside the
 * library, never exported from it (the library exports only the trserve_* entry points).
 */
#ifndef TRSERVE_ISA_H
#define TRSERVE_ISA_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Builds are chosen by compile flags; each variant needs all the flags its intrinsics use. */
#if defined(__AVX512F__)
#if !defined(__AVX512BW__) || !defined(__AVX512DQ__) || !defined(__AVX512VL__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx512 build needs -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c"
#endif
#if defined(__AVX512VNNI__)
#define ISA_NAME "avx512vnni"
#else
#define ISA_NAME "avx512"
#endif
#elif defined(__AVX2__)
#if !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 build needs -mavx2 -mfma -mf16c"
#endif
#if defined(__AVXVNNI__)
#define ISA_NAME "avx2vnni"
#else
#define ISA_NAME "avx2"
#endif
#else
#define ISA_NAME "scalar"
#endif

#define INLINE static inline __attribute__((always_inline))
#define HIDDEN __attribute__((visibility("hidden")))

#endif
