#include "cpu/logits.h"

#include <algorithm>

#include "cpu/simd.h"
#include "cpu/vector_ops.h"

namespace laprox::kernels::cpu {
namespace {

// Keys per panel: one zmm register of logits per query row.
constexpr int64_t kPanel = 16;
// Query rows per tile: 12 accumulators, the panel row and a broadcast (as the triangular kernel).
constexpr int kRows = 12;

#if LAPROX_HAVE_X86
LAPROX_AVX512_BEGIN

// Panel p of `packed` holds keys [16p, 16p + 16) transposed: element (k, j) at k * 16 + j, keys
// past `count` as 0. One gather per (panel, k) reads the 16 keys' k-th values.
LAPROX_AVX512 void PackKeys(const float* keys, int64_t ldk, int64_t count, int64_t d,
                            float* packed) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(ldk)));
  for (int64_t j0 = 0; j0 < count; j0 += kPanel, packed += d * kPanel) {
    const int64_t n = std::min(kPanel, count - j0);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    const float* base = keys + j0 * ldk;
    for (int64_t k = 0; k < d; ++k) {
      const __m512 column =
          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, offsets, base + k, 4);
      _mm512_storeu_ps(packed + k * kPanel, column);
    }
  }
}

// c[r * ldc + j] for R rows of q and the panel's `n` keys.
template <int R>
LAPROX_AVX512 void Tile(const float* q, int64_t ldq, const float* panel, int64_t d, float* c,
                        int64_t ldc, __mmask16 store) {
  __m512 a[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; ++k, panel += kPanel) {
    const __m512 t = _mm512_loadu_ps(panel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * ldq + k]), t, a[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(c + r * ldc, store, a[r]);
}

// Two full panels at once: 24 accumulators, two panel rows and a broadcast used twice (27
// registers), so each query value loaded serves 32 keys.
template <int R>
LAPROX_AVX512 void TilePair(const float* q, int64_t ldq, const float* panel, int64_t d, float* c,
                            int64_t ldc) {
  __m512 a[R], b[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  const float* second = panel + d * kPanel;
  for (int64_t k = 0; k < d; ++k, panel += kPanel, second += kPanel) {
    const __m512 t0 = _mm512_loadu_ps(panel);
    const __m512 t1 = _mm512_loadu_ps(second);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * ldq + k]);
      a[r] = _mm512_fmadd_ps(x, t0, a[r]);
      b[r] = _mm512_fmadd_ps(x, t1, b[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, a[r]);
    _mm512_storeu_ps(c + r * ldc + kPanel, b[r]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, __mmask16);
constexpr TileFn kTiles[] = {nullptr, Tile<1>, Tile<2>, Tile<3>,  Tile<4>,  Tile<5>, Tile<6>,
                             Tile<7>, Tile<8>, Tile<9>, Tile<10>, Tile<11>, Tile<12>};
using PairFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
constexpr PairFn kPairs[] = {nullptr,      TilePair<1>,  TilePair<2>, TilePair<3>, TilePair<4>,
                             TilePair<5>,  TilePair<6>,  TilePair<7>, TilePair<8>, TilePair<9>,
                             TilePair<10>, TilePair<11>, TilePair<12>};

LAPROX_AVX512 void Logits(const float* q, int64_t ldq, int64_t rows, const float* keys, int64_t ldk,
                          int64_t count, int64_t d, float* c, int64_t ldc, float* packed) {
  PackKeys(keys, ldk, count, d, packed);
  // Two panels at a time (d * 128 bytes, in L1) over every row tile: the queries stay in L1 / L2
  // too; then the last panel, if any, alone.
  int64_t j0 = 0;
  for (; j0 + 2 * kPanel <= count; j0 += 2 * kPanel, packed += 2 * d * kPanel) {
    for (int64_t r = 0; r < rows; r += kRows) {
      kPairs[std::min<int64_t>(kRows, rows - r)](q + r * ldq, ldq, packed, d, c + r * ldc + j0,
                                                 ldc);
    }
  }
  for (; j0 < count; j0 += kPanel, packed += d * kPanel) {
    const int64_t n = std::min(kPanel, count - j0);
    const __mmask16 store = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t r = 0; r < rows; r += kRows) {
      kTiles[std::min<int64_t>(kRows, rows - r)](q + r * ldq, ldq, packed, d, c + r * ldc + j0, ldc,
                                                 store);
    }
  }
}

LAPROX_AVX512_END
#endif  // LAPROX_HAVE_X86

}  // namespace

bool QueryKeyLogits(const float* q, int64_t ldq, int64_t rows, const float* keys, int64_t ldk,
                    int64_t count, int64_t d, float* c, int64_t ldc, std::vector<float>& packed) {
#if LAPROX_HAVE_X86
  // The gather's offsets are 32-bit: (15 * ldk) floats of 4 bytes must fit.
  if (!UseAvx512() || ldk > (int64_t{1} << 31) / (4 * kPanel)) return false;
  const int64_t panels = (count + kPanel - 1) / kPanel;
  if (packed.size() < static_cast<size_t>(panels * d * kPanel)) packed.resize(panels * d * kPanel);
  Logits(q, ldq, rows, keys, ldk, count, d, c, ldc, packed.data());
  return true;
#else
  (void)q, (void)ldq, (void)rows, (void)keys, (void)ldk, (void)count, (void)d, (void)c, (void)ldc;
  (void)packed;
  return false;
#endif
}

}  // namespace laprox::kernels::cpu
