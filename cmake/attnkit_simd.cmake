# Per-target flags for the fast kernels' SIMD translation units. Only these
# files get the flags, so the rest of the library (and every inline function
# it shares with them) stays runnable on any x86-64; the kernels pick a
# target at run time from cpuid (src/core/cpu_features.cc). Included from
# the top-level CMakeLists.txt after the attnkit target is defined.
include(CheckCXXSourceCompiles)

set(ATTNKIT_AVX2_FLAGS -mavx2 -mfma -mf16c)
set(ATTNKIT_AVX512_FLAGS -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mfma)

if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  list(JOIN ATTNKIT_AVX2_FLAGS " " CMAKE_REQUIRED_FLAGS)
  check_cxx_source_compiles([[
    #include <immintrin.h>
    int main() {
      __m256 a = _mm256_set1_ps(1.0f);
      a = _mm256_fmadd_ps(a, _mm256_cvtph_ps(_mm_set1_epi16(0x3c00)), a);
      return (int)_mm256_cvtss_f32(a);
    }
  ]] ATTNKIT_COMPILER_HAS_AVX2)
  list(JOIN ATTNKIT_AVX512_FLAGS " " CMAKE_REQUIRED_FLAGS)
  check_cxx_source_compiles([[
    #include <immintrin.h>
    int main() {
      __m512 a = _mm512_set1_ps(1.0f);
      a = _mm512_dpbf16_ps(a, _mm512_cvtne2ps_pbh(a, a), _mm512_cvtne2ps_pbh(a, a));
      const __m512i i = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi16(1),
                                            _mm512_set1_epi16(2));
      return (int)_mm512_reduce_add_ps(a) + _mm512_reduce_add_epi32(i);
    }
  ]] ATTNKIT_COMPILER_HAS_AVX512)
  unset(CMAKE_REQUIRED_FLAGS)
endif()

if(ATTNKIT_COMPILER_HAS_AVX2)
  set_source_files_properties(${PROJECT_SOURCE_DIR}/src/kernels/cpu/kernels_avx2.cc
    ${PROJECT_SOURCE_DIR}/src/kernels/linear_bf16_avx2.cc PROPERTIES COMPILE_OPTIONS "${ATTNKIT_AVX2_FLAGS}")
  target_compile_definitions(attnkit PRIVATE ATTNKIT_HAVE_AVX2=1)
endif()
if(ATTNKIT_COMPILER_HAS_AVX512)
  set_source_files_properties(${PROJECT_SOURCE_DIR}/src/kernels/cpu/kernels_avx512.cc
    ${PROJECT_SOURCE_DIR}/src/kernels/linear_bf16_avx512.cc PROPERTIES COMPILE_OPTIONS "${ATTNKIT_AVX512_FLAGS}")
  target_compile_definitions(attnkit PRIVATE ATTNKIT_HAVE_AVX512=1)
endif()

# The kernels under UBSan: ATTNKIT_KERNEL_UBSAN_OPTIONS (CMakeLists.txt).
if(ATTNKIT_KERNEL_UBSAN_OPTIONS)
  set_property(SOURCE ${PROJECT_SOURCE_DIR}/src/kernels/cpu/kernels_avx2.cc
    ${PROJECT_SOURCE_DIR}/src/kernels/cpu/kernels_avx512.cc
    ${PROJECT_SOURCE_DIR}/src/kernels/cpu/gated_delta_rule_cpu.cc
    ${PROJECT_SOURCE_DIR}/src/kernels/cpu/gated_delta_rule_timed.cc
    APPEND PROPERTY COMPILE_OPTIONS ${ATTNKIT_KERNEL_UBSAN_OPTIONS})
endif()
