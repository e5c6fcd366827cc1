// What the kernels that use AMX tiles (Intel Advanced Matrix Extensions)
// share: whether this process may use them, and the tile configuration's
// layout. Each user loads its own configuration (ldtilecfg) in the thread
// that multiplies, and releases the tiles when done.
#pragma once

#include <cstdint>

// AMX intrinsics: GCC 11 and clang 12 on, x86-64 Linux (the OS grants the
// tile state per process); other builds compile the portable fallbacks.
#if defined(__x86_64__) && defined(__linux__) &&      \
    ((defined(__clang__) && __clang_major__ >= 12) || \
     (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11))
#define ATTNKIT_AMX_BUILD 1
#endif

namespace attnkit::kernels {

// True when this build has AMX kernels, the CPU has AMX-TILE and AMX-BF16
// (and AVX512-VBMI, whose byte lookups decode the tiles' 8-bit operands),
// and the OS lets this process use the tile registers (asked for once, on
// the first call: Linux's arch_prctl ARCH_REQ_XCOMP_PERM; a kernel that
// refuses, or predates it, leaves AMX off).
bool amx_bf16_available();

// Benchmarks only: forbids (false) or allows again the AMX forms in this
// process, so that one process can time a call with and without them.
// Takes effect for calls planned afterwards.
void set_amx_allowed(bool allowed);

// amx_bf16_available() and the CPU has AMX-INT8 too.
bool amx_int8_available();

// Orders the stores into a buffer before the tile loads that read it.
// GCC's _tile_loadd is an asm statement that takes the address in a
// register and declares no memory input, so stores into a local buffer
// just before it may be dropped as dead (GCC 12 dropped a zero-padded
// copy's, and the tile read stale bytes). Call it between writing such a
// buffer and loading it.
inline void amx_buffer_written() { __asm__ volatile("" ::: "memory"); }

// The 64-byte operand of ldtilecfg, palette 1: per tile register, its rows
// and the bytes of each row.
struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace attnkit::kernels
