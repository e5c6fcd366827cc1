// <immintrin.h> for the kernels written with AVX-512 and AMX intrinsics.
//
// GCC 12's own AVX-512 headers trip -W(maybe-)uninitialized (GCC bug
// 105593: the `__m512 __Y = __Y;` idiom behind _mm512_undefined_ps and the
// intrinsics built on it, vpermb's among them). The warnings fire where the
// intrinsics are inlined, in the including file's functions, so they are
// off from here to the end of that file.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif
