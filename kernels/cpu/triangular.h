// The value factor ||v W_O^h|| of the CPU backend through a triangular factor of its Gram.
//
// ||v W_O^h||^2 = v M_h v^T with M_h = W_O^h W_O^h^T (d x d). Any T with T T^T = M_h gives
// ||v W_O^h|| = ||v T||, and a lower-triangular T (a Cholesky factor) needs only the inputs
// v_i, i >= j, for output j: d(d+1)/2 multiply-adds per row instead of the d^2 of v M_h, and the
// norm is a sum of squares (never negative, no cancellation in the last step).
//
// Precision (fp32, unit roundoff u = 2^-24): each (v T)_j is a dot of at most d terms, so the
// computed ||v T|| is off by at most about d u ||v|| ||T||_F: a relative error of about
// d^1.5 u kappa for a v along W_O^h's weakest direction (kappa its condition number). The same v
// through v M_h v^T in fp32 has an error of d u ||v||^2 ||M_h|| in the square, so up to
// sqrt(d u) ||v|| ||W_O^h|| in the norm (orders of magnitude more; relative d u kappa^2, nothing
// left at kappa = 1e6). tests/kernels/triangular_test.cc checks both on a head with kappa = 1e6.
#ifndef LAPROX_KERNELS_CPU_TRIANGULAR_H_
#define LAPROX_KERNELS_CPU_TRIANGULAR_H_

#include <cstdint>
#include <vector>

namespace laprox::kernels::cpu {

// T with T T^T = A^T A for the `rows` x d matrix A (row-major fp64, row stride d): the Gram in
// fp64, then a Cholesky factorisation in fp64 that sets a column to 0 where the pivot is at most
// d * 2^-52 * max_j (A^T A)_jj (a semidefinite Gram: rank(A) < d, e.g. rows < d), so a
// rank-deficient A needs no special case. T is written lower-triangular in fp32 at t (row stride
// ldt), zeros above the diagonal included. `gram` is scratch (d * d).
void GramCholesky(const double* a, int64_t rows, int64_t d, std::vector<double>& gram, float* t,
                  int64_t ldt);

// The kernel reads each factor packed in panels of kTrianglePanel columns: panel p (columns
// [j0, j0 + 16), j0 = 16p) holds rows [j0, d) of those columns, 16 floats a row, contiguous (the
// rows above j0 are 0 in a lower triangle; columns past d - 1 are stored as 0). Contiguous panels
// stream through the cache; the rows of a factor inside the prepared model are a power-of-two
// stride apart and collide in a few L1 sets.
inline constexpr int64_t kTrianglePanel = 16;

// Floats of one packed d x d factor: sum over panels of (d - j0) * 16.
int64_t PackedTriangleSize(int64_t d);

// Packs the lower triangles of `count` factors T_f = t + f * d (row stride ldt) into `packed`
// (count * PackedTriangleSize(d) floats, factor after factor).
void PackTriangles(const float* t, int64_t ldt, int64_t d, int64_t count, float* packed);

// out[f * out_stride + r] = ||v_r T_f||^2 in fp32 for r < rows and f < count, where
// v_r = v + r * ldv (d floats) and T_f is the f-th factor in `packed` (PackTriangles). AVX-512F
// or AVX2+FMA where the CPU has them (cpu/vector_ops.h's choice: UseAvx512(), UseAvx2()); the
// versions add in different orders, so their results differ in the last bits.
void TriangularSquaredNorms(const float* v, int64_t ldv, int64_t rows, int64_t d,
                            const float* packed, int64_t count, float* out, int64_t out_stride);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_TRIANGULAR_H_
