#pragma once

// How the AVX2 builds of the CPU kernel bodies (haar_adam_cpu_avx2.cpp, wavelet_adam_cpu_avx2.cpp)
// get their instruction set: by a target pragma around gwt's own code, not by -mavx2 on the whole
// file.
//
// Why. A function with external linkage that more than one translation unit defines (an inline or
// template function of the standard library, of c10, of ATen, of gwt's public headers) is kept
// once by the linker, from whichever object it meets first. Compiled with -mavx2, such a copy may
// hold AVX2 instructions, and if the linker keeps it, every caller uses it: code that runs on a
// CPU without AVX2 too, after the dispatch chose the baseline body, or a user's own code. An
// optimised build inlines most of them (two were left, std::vector<float>::resize and
// std::vector<double>::resize, without AVX2 instructions as it happened); a -O0 build (Debug,
// coverage) left 38 copies out of line with AVX instructions in them (c10's float16 and bfloat16
// conversions, std::sqrt(float), std::isnan(float), std::fill's loops). In the coverage build's
// test binary the linker had kept the baseline copies; nothing made it so.
//
// So each AVX2 file includes this header first. It includes every outside header the bodies use,
// compiled for the baseline instruction set; GWT_AVX2_BEGIN / GWT_AVX2_END then enclose gwt's own
// headers and code, whose functions all have internal linkage or live in namespace
// gwt::kernels::avx2, which no other file defines. Functions of the outside headers called there
// are still inlined where the compiler chooses (a baseline function may be inlined into an AVX2
// one), and an out-of-line copy of one is the baseline's. tests/isa_check.py checks the objects,
// recompiled without optimisation too, so that a header added inside the region is caught.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "gwt/wavelet.h"

// GWT_AVX2_BODY: the code between the two macros is the AVX2 build (the kernels' headers test it
// where they used to test __AVX2__, which clang's pragma does not define).
#if defined(__clang__)
#define GWT_AVX2_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
#define GWT_AVX2_END _Pragma("clang attribute pop")
#elif defined(__GNUC__)
#define GWT_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define GWT_AVX2_END _Pragma("GCC pop_options")
#else
#error "the AVX2 kernel bodies need GCC or clang (x86-64)"
#endif
#define GWT_AVX2_BODY 1
