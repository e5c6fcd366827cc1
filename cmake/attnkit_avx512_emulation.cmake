# The AVX-512 kernels a second time, on SIMDe's portable intrinsics
# (tests/common/avx512_emulation.h), so that the kernel tests and the
# attention fuzzer run them on CPUs without AVX-512 too. No ISA flag: the
# object runs on any x86-64. It is linked into test programs only, never
# into the library.
#
#   attnkit_link_avx512_emulation(<program> [compile options...])
#
# compiles src/kernels/cpu/kernels_avx512.cc that way into <program> and
# defines ATTNKIT_TEST_AVX512_EMULATION=1 for it (the tables are declared
# in tests/common/emulated_kernels.h); without SIMDe (libsimde-dev) or off
# x86-64 it says so and does nothing. The options pick the optimisation
# level: GCC at -O2 spends minutes on SIMDe's inlined lane loops.
#
#   attnkit_avx512_emulation_object(<program> [compile options...])
#
# defines that object (<program>_avx512_emulated) alone, before <program>
# exists; attnkit_link_avx512_emulation(<program>) then links it. Ninja
# starts compiles that are ready in the order the build file lists them,
# which is the order the targets were defined: a long object defined after
# its program is compiled last, alone on one core, while the other waits
# for it to link (docs/RELIABILITY.md, CI).
function(attnkit_avx512_emulation_object program)
  find_path(ATTNKIT_SIMDE_INCLUDE_DIR simde/x86/avx512.h)
  if(NOT ATTNKIT_SIMDE_INCLUDE_DIR OR NOT CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
    message(STATUS "attnkit: SIMDe not found (libsimde-dev) or not x86-64; ${program} runs the "
                   "AVX-512 kernels only on CPUs that have AVX-512")
    return()
  endif()
  set(object ${program}_avx512_emulated)
  add_library(${object} OBJECT ${PROJECT_SOURCE_DIR}/src/kernels/cpu/kernels_avx512.cc)
  target_include_directories(${object} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  target_include_directories(${object} SYSTEM PRIVATE ${ATTNKIT_SIMDE_INCLUDE_DIR})
  # -Wno-psabi: the compilers note that 64-byte vector arguments have
  # another ABI without AVX-512; the object never meets AVX-512 code.
  target_compile_options(${object} PRIVATE
    -include ${PROJECT_SOURCE_DIR}/tests/common/avx512_emulation.h -Wno-psabi ${ARGN})
  target_link_libraries(${object} PRIVATE attnkit_warnings)
endfunction()

function(attnkit_link_avx512_emulation program)
  set(object ${program}_avx512_emulated)
  if(NOT TARGET ${object})
    attnkit_avx512_emulation_object(${program} ${ARGN})
  endif()
  if(TARGET ${object})
    target_sources(${program} PRIVATE $<TARGET_OBJECTS:${object}>)
    target_compile_definitions(${program} PRIVATE ATTNKIT_TEST_AVX512_EMULATION=1)
  endif()
endfunction()
