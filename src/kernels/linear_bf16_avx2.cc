// The bf16 stream GEMM for AVX2 + FMA (compiled with -mavx2 -mfma -mf16c;
// cmake/attnkit_simd.cmake): 16 bf16 weights per load, widened exactly to
// two fp32 vectors in registers by a shift (the even-indexed ones, low
// halves of the 32-bit lanes) and a mask (the odd-indexed ones, already in
// the high halves): two integer ops per 16 weights and no shuffle, against
// prepared x rows whose chunks hold the even and odd values apart.
#include "kernels/linear_bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "kernels/linear_bf16_tiles.h"

namespace attnkit::kernels::bf16_stream {
namespace {

struct V256 {
  using Raw = __m256i;
  using Part = __m256;
  using Acc = __m256;
  static constexpr int kChunk = 16, kParts = 2;
  // 16 registers. One row: 4 columns, 4 FMA chains (each 2 FMAs per chunk,
  // enough to keep memory the limit). More rows: 4 x 3 tiles, 12
  // accumulators + 3 widened weights + 1 x vector, the mask read from
  // memory: 24 FMAs to 3 shifts and 3 ands per chunk (3 x 3 had 18 to 6,
  // and 16 or 32 rows left a 1-row group). GCC does not keep that tile in
  // registers (it spills accumulators, or reads x from memory for each
  // FMA: 30 loads per 24 FMAs), so main_tile holds it in inline assembly;
  // the 1-3 rows left over and the last columns take the loop of
  // linear_bf16_tiles.h.
  static constexpr int kNrOne = 4, kMr = 4, kNr = 3;
  static constexpr bool kMainTile = true;

  static Raw load_w(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static Part part(Raw raw, int i) {
    return i == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))
                  : _mm256_castsi256_ps(
                        _mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Part load_x(const float* row, int64_t k, int i) {
    return _mm256_loadu_ps(row + k + 8 * i);
  }
  static Acc mac(Acc acc, Part w, Part x) { return _mm256_fmadd_ps(w, x, acc); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static float hsum(Acc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float x_value(const float* row, int64_t k) { return row[k]; }

  // acc[m][n] over k < whole (a multiple of 16) for rows xp[0, 4) (stride
  // ldxp) and W rows w[0, 3) (stride ldw): per chunk and part (even, then
  // odd), acc = w part * x part + acc, as tile()'s loop does.
  static void main_tile(const float* xp, int64_t ldxp, const uint16_t* w, int64_t ldw,
                        int64_t whole, Acc (*acc)[kNr]) {
    alignas(32) static const uint32_t kHigh[8] = {0xffff0000u, 0xffff0000u, 0xffff0000u,
                                                  0xffff0000u, 0xffff0000u, 0xffff0000u,
                                                  0xffff0000u, 0xffff0000u};
    const float *x0 = xp, *x1 = xp + ldxp, *x2 = xp + 2 * ldxp, *x3 = xp + 3 * ldxp;
    const uint16_t *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw;
    int64_t chunks = whole / kChunk;
    // ymm0-11: acc[m][n] at 3 m + n; ymm12-14: the widened W part of
    // columns 0-2; ymm15: the x part of one row.
// clang-format off
#define ATTNKIT_ROW(X, OFF, A0, A1, A2)          \
  "vmovups " OFF "(%[" X "]), %%ymm15\n\t"       \
  "vfmadd231ps %%ymm12, %%ymm15, %%" A0 "\n\t"   \
  "vfmadd231ps %%ymm13, %%ymm15, %%" A1 "\n\t"   \
  "vfmadd231ps %%ymm14, %%ymm15, %%" A2 "\n\t"
#define ATTNKIT_ROWS(OFF)                        \
  ATTNKIT_ROW("x0", OFF, "ymm0", "ymm1", "ymm2") \
  ATTNKIT_ROW("x1", OFF, "ymm3", "ymm4", "ymm5") \
  ATTNKIT_ROW("x2", OFF, "ymm6", "ymm7", "ymm8") \
  ATTNKIT_ROW("x3", OFF, "ymm9", "ymm10", "ymm11")
    // clang-format on
    __asm__ volatile(
        "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
        "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
        "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
        "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
        "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
        "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
        "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
        "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
        "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
        "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
        "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
        "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
        "test %[n], %[n]\n\t"
        "jz 2f\n"
        "1:\n\t"
        // The even bf16 of each lane: shifted into the high half.
        "vmovdqu (%[w0]), %%ymm12\n\t"
        "vpslld $16, %%ymm12, %%ymm12\n\t"
        "vmovdqu (%[w1]), %%ymm13\n\t"
        "vpslld $16, %%ymm13, %%ymm13\n\t"
        "vmovdqu (%[w2]), %%ymm14\n\t"
        "vpslld $16, %%ymm14, %%ymm14\n\t"
        ATTNKIT_ROWS("0")
        // The odd ones: already in the high half, the low half masked off.
        "vmovdqu (%[w0]), %%ymm12\n\t"
        "vpand %[high], %%ymm12, %%ymm12\n\t"
        "vmovdqu (%[w1]), %%ymm13\n\t"
        "vpand %[high], %%ymm13, %%ymm13\n\t"
        "vmovdqu (%[w2]), %%ymm14\n\t"
        "vpand %[high], %%ymm14, %%ymm14\n\t"
        ATTNKIT_ROWS("32")
        "add $32, %[w0]\n\t"
        "add $32, %[w1]\n\t"
        "add $32, %[w2]\n\t"
        "add $64, %[x0]\n\t"
        "add $64, %[x1]\n\t"
        "add $64, %[x2]\n\t"
        "add $64, %[x3]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n"
        "2:\n\t"
        "vmovups %%ymm0, (%[acc])\n\t"
        "vmovups %%ymm1, 32(%[acc])\n\t"
        "vmovups %%ymm2, 64(%[acc])\n\t"
        "vmovups %%ymm3, 96(%[acc])\n\t"
        "vmovups %%ymm4, 128(%[acc])\n\t"
        "vmovups %%ymm5, 160(%[acc])\n\t"
        "vmovups %%ymm6, 192(%[acc])\n\t"
        "vmovups %%ymm7, 224(%[acc])\n\t"
        "vmovups %%ymm8, 256(%[acc])\n\t"
        "vmovups %%ymm9, 288(%[acc])\n\t"
        "vmovups %%ymm10, 320(%[acc])\n\t"
        "vmovups %%ymm11, 352(%[acc])\n\t"
        : [w0] "+r"(w0), [w1] "+r"(w1), [w2] "+r"(w2), [x0] "+r"(x0), [x1] "+r"(x1),
          [x2] "+r"(x2), [x3] "+r"(x3), [n] "+r"(chunks)
        : [high] "m"(*reinterpret_cast<const __m256i*>(kHigh)), [acc] "r"(&acc[0][0])
        : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
          "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef ATTNKIT_ROWS
#undef ATTNKIT_ROW
  }
};

}  // namespace

extern const Bf16StreamKernel kAvx2 = {"avx2", prepare_x_split<8>, run<V256>, bf16_stream_xp_dense,
                                       1};

}  // namespace attnkit::kernels::bf16_stream
#endif
