#include "cpu/triangular.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

#include "cpu/simd.h"
#include "cpu/vector_ops.h"

namespace laprox::kernels::cpu {
namespace {

// Calls fn(j0, panel) for each panel of columns [j0, j0 + kTrianglePanel) of a packed factor,
// `panel` pointing at its first row (row j0).
template <typename Float, typename Fn>
void ForEachPanel(Float* packed, int64_t d, Fn&& fn) {
  for (int64_t j0 = 0; j0 < d; j0 += kTrianglePanel) {
    fn(j0, packed);
    packed += (d - j0) * kTrianglePanel;
  }
}

void TriangularSquaredNormsScalar(const float* v, int64_t ldv, int64_t rows, int64_t d,
                                  const float* packed, int64_t count, float* out,
                                  int64_t out_stride) {
  const int64_t size = PackedTriangleSize(d);
  for (int64_t f = 0; f < count; ++f) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = v + r * ldv;
      float sum = 0.f;
      ForEachPanel(packed + f * size, d, [&](int64_t j0, const float* panel) {
        float u[kTrianglePanel] = {};
        for (int64_t i = j0; i < d; ++i) {
          const float* t_row = panel + (i - j0) * kTrianglePanel;
          for (int64_t c = 0; c < kTrianglePanel; ++c) u[c] += row[i] * t_row[c];
        }
        for (float x : u) sum += x * x;
      });
      out[f * out_stride + r] = sum;
    }
  }
}

#if LAPROX_HAVE_X86
// The loops over a tile's rows (up to 12) must unroll so that the accumulators live in registers
// (GCC -O2 does not unroll them by itself and keeps the arrays on the stack: 3.5x slower for the
// AVX2 tile; the AVX-512 tile at "unroll 8" ran at half the speed of the AVX2 one).
#define LAPROX_UNROLL _Pragma("GCC unroll 16")

// Columns [j0, j0 + 16) of v T for R rows: u = sum_{i >= j0} v[., i] T[i, j0:j0+16] (T is lower
// triangular, so rows i < j0 contribute nothing), accumulated as sum u^2 into sq. The panel's
// rows are contiguous (PackTriangles). The 6 x 16 tile holds 12 accumulators, two T loads and
// one broadcast: 15 of the 16 ymm registers.
template <int R>
LAPROX_AVX2 inline void Panel(const float* v, int64_t ldv, int64_t d, int64_t j0,
                              const float* panel, __m256* sq) {
  __m256 a0[R], a1[R];
  LAPROX_UNROLL
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t i = j0; i < d; ++i, panel += kTrianglePanel) {
    const __m256 t0 = _mm256_loadu_ps(panel);
    const __m256 t1 = _mm256_loadu_ps(panel + 8);
    LAPROX_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(v + r * ldv + i);
      a0[r] = _mm256_fmadd_ps(b, t0, a0[r]);
      a1[r] = _mm256_fmadd_ps(b, t1, a1[r]);
    }
  }
  LAPROX_UNROLL
  for (int r = 0; r < R; ++r) {
    sq[r] = _mm256_fmadd_ps(a0[r], a0[r], sq[r]);
    sq[r] = _mm256_fmadd_ps(a1[r], a1[r], sq[r]);
  }
}

// ||v_r T||^2 for R rows into out[r].
template <int R>
LAPROX_AVX2 void RowTile(const float* v, int64_t ldv, int64_t d, const float* packed, float* out) {
  __m256 sq[R];
  LAPROX_UNROLL
  for (int r = 0; r < R; ++r) sq[r] = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < d; j0 += kTrianglePanel) {
    Panel<R>(v, ldv, d, j0, packed, sq);
    packed += (d - j0) * kTrianglePanel;
  }
  LAPROX_UNROLL
  for (int r = 0; r < R; ++r) out[r] = HorizontalSum(sq[r]);
}

// ||v_r T_f||^2 of every row and factor through a kernel's row tiles: tiles[R] does R rows,
// R = 1 .. tile. One factor at a time over all rows: T_f (10 KiB packed at d = 64) stays in L1
// while the rows stream.
using Tile = void (*)(const float*, int64_t, int64_t, const float*, float*);
void RunTiles(const Tile* tiles, int64_t tile, const float* v, int64_t ldv, int64_t rows, int64_t d,
              const float* packed, int64_t count, float* out, int64_t out_stride) {
  const int64_t size = PackedTriangleSize(d);
  for (int64_t f = 0; f < count; ++f) {
    const float* tf = packed + f * size;
    float* of = out + f * out_stride;
    for (int64_t r = 0; r < rows; r += tile) {
      tiles[std::min<int64_t>(tile, rows - r)](v + r * ldv, ldv, d, tf, of + r);
    }
  }
}

// Tiles of 6 rows, and one of the 1..5 rows left.
constexpr Tile kTilesAvx2[] = {nullptr,    RowTile<1>, RowTile<2>, RowTile<3>,
                               RowTile<4>, RowTile<5>, RowTile<6>};

// The same with AVX-512F: a panel's 16 columns are one zmm register, so a tile of 12 rows holds
// 12 accumulators and 12 sums of squares, with the panel row and a broadcast: 26 of the 32
// registers. Per panel row, 12 FMAs of 16 lanes against the AVX2 tile's 12 of 8.
template <int R>
LAPROX_AVX512 void RowTile512(const float* v, int64_t ldv, int64_t d, const float* packed,
                              float* out) {
  __m512 sq[R];
  LAPROX_UNROLL
  for (int r = 0; r < R; ++r) sq[r] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < d; j0 += kTrianglePanel) {
    __m512 a[R];
    LAPROX_UNROLL
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    const float* panel = packed;
    for (int64_t i = j0; i < d; ++i, panel += kTrianglePanel) {
      const __m512 t = _mm512_loadu_ps(panel);
      LAPROX_UNROLL
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(v[r * ldv + i]), t, a[r]);
    }
    LAPROX_UNROLL
    for (int r = 0; r < R; ++r) sq[r] = _mm512_fmadd_ps(a[r], a[r], sq[r]);
    packed += (d - j0) * kTrianglePanel;
  }
  LAPROX_UNROLL
  for (int r = 0; r < R; ++r) out[r] = HorizontalSum(sq[r]);
}

// Tiles of 12 rows, and one of the 1..11 rows left.
constexpr Tile kTilesAvx512[] = {nullptr,       RowTile512<1>, RowTile512<2>,  RowTile512<3>,
                                 RowTile512<4>, RowTile512<5>, RowTile512<6>,  RowTile512<7>,
                                 RowTile512<8>, RowTile512<9>, RowTile512<10>, RowTile512<11>,
                                 RowTile512<12>};

#undef LAPROX_UNROLL
#endif  // LAPROX_HAVE_X86

}  // namespace

void GramCholesky(const double* a, int64_t rows, int64_t d, std::vector<double>& gram, float* t,
                  int64_t ldt) {
  gram.assign(d * d, 0.0);
  double* g = gram.data();
  if (rows > 0) {
    cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, static_cast<int>(d), static_cast<int>(rows),
                1.0, a, static_cast<int>(d), 0.0, g, static_cast<int>(d));
  }
  double max_diagonal = 0.0;
  for (int64_t j = 0; j < d; ++j) max_diagonal = std::max(max_diagonal, g[j * d + j]);
  const double tolerance = static_cast<double>(d) * 0x1p-52 * max_diagonal;
  // Column by column, in place in the lower triangle of g: L[j][j] = sqrt(pivot) and
  // L[i][j] = (G[i][j] - sum_{k<j} L[i][k] L[j][k]) / L[j][j]. A semidefinite Gram has a pivot of
  // (nearly) 0 exactly where its column below is (nearly) 0 too, and that column of L is 0.
  for (int64_t j = 0; j < d; ++j) {
    double pivot = g[j * d + j];
    for (int64_t k = 0; k < j; ++k) pivot -= g[j * d + k] * g[j * d + k];
    if (pivot <= tolerance) {
      for (int64_t i = j; i < d; ++i) g[i * d + j] = 0.0;
      continue;
    }
    const double diagonal = std::sqrt(pivot);
    g[j * d + j] = diagonal;
    for (int64_t i = j + 1; i < d; ++i) {
      double x = g[i * d + j];
      for (int64_t k = 0; k < j; ++k) x -= g[i * d + k] * g[j * d + k];
      g[i * d + j] = x / diagonal;
    }
  }
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      t[i * ldt + j] = j <= i ? static_cast<float>(g[i * d + j]) : 0.f;
    }
  }
}

int64_t PackedTriangleSize(int64_t d) {
  int64_t size = 0;
  for (int64_t j0 = 0; j0 < d; j0 += kTrianglePanel) size += (d - j0) * kTrianglePanel;
  return size;
}

void PackTriangles(const float* t, int64_t ldt, int64_t d, int64_t count, float* packed) {
  for (int64_t f = 0; f < count; ++f) {
    const float* tf = t + f * d;
    float* out = packed + f * PackedTriangleSize(d);
    ForEachPanel(out, d, [&](int64_t j0, float* panel) {
      for (int64_t i = j0; i < d; ++i) {
        for (int64_t c = 0; c < kTrianglePanel; ++c) {
          const int64_t j = j0 + c;
          panel[(i - j0) * kTrianglePanel + c] = j < d && j <= i ? tf[i * ldt + j] : 0.f;
        }
      }
    });
  }
}

void TriangularSquaredNorms(const float* v, int64_t ldv, int64_t rows, int64_t d,
                            const float* packed, int64_t count, float* out, int64_t out_stride) {
#if LAPROX_HAVE_X86
  if (UseAvx2()) {
    const bool avx512 = UseAvx512();
    RunTiles(avx512 ? kTilesAvx512 : kTilesAvx2, avx512 ? 12 : 6, v, ldv, rows, d, packed, count,
             out, out_stride);
    return;
  }
#endif
  TriangularSquaredNormsScalar(v, ldv, rows, d, packed, count, out, out_stride);
}

}  // namespace laprox::kernels::cpu
