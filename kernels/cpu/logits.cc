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

// maxima[r * 16 + l] = max(itself, v[l]) for the lanes l in `mask` (no-op without maxima).
LAPROX_AVX512 inline void UpdateMaxima(float* maxima, __mmask16 mask, __m512 v) {
  if (maxima == nullptr || mask == 0) return;
  const __m512 m = _mm512_loadu_ps(maxima);
  _mm512_storeu_ps(maxima, _mm512_mask_max_ps(m, mask, m, v));
}

// c[r * ldc + j] for R rows of q and the panel's `n` keys; the lanes `max` of the row maxima.
template <int R>
LAPROX_AVX512 void Tile(const float* q, int64_t ldq, const float* panel, int64_t d, float* c,
                        int64_t ldc, __mmask16 store, float* maxima, __mmask16 max) {
  __m512 a[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; ++k, panel += kPanel) {
    const __m512 t = _mm512_loadu_ps(panel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * ldq + k]), t, a[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, store, a[r]);
    UpdateMaxima(maxima == nullptr ? nullptr : maxima + r * kPanel, max, a[r]);
  }
}

// Two full panels at once: 24 accumulators, two panel rows and a broadcast used twice (27
// registers), so each query value loaded serves 32 keys.
template <int R>
LAPROX_AVX512 void TilePair(const float* q, int64_t ldq, const float* panel, int64_t d, float* c,
                            int64_t ldc, float* maxima, __mmask16 max0, __mmask16 max1) {
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
    if (maxima != nullptr) {  // both panels' keys fall in the same lanes (j % 16)
      UpdateMaxima(maxima + r * kPanel, max0, a[r]);
      UpdateMaxima(maxima + r * kPanel, max1, b[r]);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, __mmask16,
                        float*, __mmask16);
constexpr TileFn kTiles[] = {nullptr, Tile<1>, Tile<2>, Tile<3>,  Tile<4>,  Tile<5>, Tile<6>,
                             Tile<7>, Tile<8>, Tile<9>, Tile<10>, Tile<11>, Tile<12>};
using PairFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, float*,
                        __mmask16, __mmask16);
constexpr PairFn kPairs[] = {nullptr,      TilePair<1>,  TilePair<2>, TilePair<3>, TilePair<4>,
                             TilePair<5>,  TilePair<6>,  TilePair<7>, TilePair<8>, TilePair<9>,
                             TilePair<10>, TilePair<11>, TilePair<12>};

// The first `n` of 16 lanes, n clamped to [0, 16].
inline __mmask16 FirstLanes(int64_t n) {
  return n <= 0 ? 0 : n >= kPanel ? 0xffff : static_cast<__mmask16>((1u << n) - 1u);
}

LAPROX_AVX512 void Logits(const float* q, int64_t ldq, int64_t rows, const float* keys, int64_t ldk,
                          int64_t count, int64_t d, float* c, int64_t ldc, float* packed,
                          float* maxima, int64_t max_end) {
  PackKeys(keys, ldk, count, d, packed);
  max_end = std::min(max_end, count);  // the lanes past `count` hold the padding's zero logits
  const auto row_maxima = [&](int64_t r) {
    return maxima == nullptr ? nullptr : maxima + r * kPanel;
  };
  // Two panels at a time (d * 128 bytes, in L1) over every row tile: the queries stay in L1 / L2
  // too; then the last panel, if any, alone.
  int64_t j0 = 0;
  for (; j0 + 2 * kPanel <= count; j0 += 2 * kPanel, packed += 2 * d * kPanel) {
    const __mmask16 max0 = FirstLanes(max_end - j0), max1 = FirstLanes(max_end - j0 - kPanel);
    for (int64_t r = 0; r < rows; r += kRows) {
      kPairs[std::min<int64_t>(kRows, rows - r)](q + r * ldq, ldq, packed, d, c + r * ldc + j0, ldc,
                                                 row_maxima(r), max0, max1);
    }
  }
  for (; j0 < count; j0 += kPanel, packed += d * kPanel) {
    const __mmask16 store = FirstLanes(count - j0), max = FirstLanes(max_end - j0);
    for (int64_t r = 0; r < rows; r += kRows) {
      kTiles[std::min<int64_t>(kRows, rows - r)](q + r * ldq, ldq, packed, d, c + r * ldc + j0, ldc,
                                                 store, row_maxima(r), max);
    }
  }
}

LAPROX_AVX512_END
#endif  // LAPROX_HAVE_X86

}  // namespace

bool QueryKeyLogits(const float* q, int64_t ldq, int64_t rows, const float* keys, int64_t ldk,
                    int64_t count, int64_t d, float* c, int64_t ldc, std::vector<float>& packed,
                    float* maxima, int64_t max_end) {
#if LAPROX_HAVE_X86
  // The gather's offsets are 32-bit: (15 * ldk) floats of 4 bytes must fit.
  if (!UseAvx512() || ldk > (int64_t{1} << 31) / (4 * kPanel)) return false;
  const int64_t panels = (count + kPanel - 1) / kPanel;
  if (packed.size() < static_cast<size_t>(panels * d * kPanel)) packed.resize(panels * d * kPanel);
  Logits(q, ldq, rows, keys, ldk, count, d, c, ldc, packed.data(), maxima, max_end);
  return true;
#else
  (void)q, (void)ldq, (void)rows, (void)keys, (void)ldk, (void)count, (void)d, (void)c, (void)ldc;
  (void)packed, (void)maxima, (void)max_end;
  return false;
#endif
}

}  // namespace laprox::kernels::cpu
