// The triangular value factor (cpu/triangular.h) against fp64 definitions: the kernel's norms,
// the factor's reconstruction of the Gram (rank-deficient included), and the precision claim on
// an o_proj head with condition number 1e6, where the Gram form v M v^T in fp32 is far worse.
#include "cpu/triangular.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/vector_ops.h"

namespace laprox::kernels::cpu {
namespace {

enum class Kernel { kPortable, kAvx2, kAvx512 };

// Runs the test body with each kernel the CPU can run: the AVX-512 one, the AVX2 one and the
// portable one.
class TriangularTest : public ::testing::TestWithParam<Kernel> {
 protected:
  void SetUp() override {
    ForcePortableVectorOps(GetParam() == Kernel::kPortable);
    LimitVectorOpsToAvx2(GetParam() == Kernel::kAvx2);
    if (GetParam() == Kernel::kAvx2 && !UseAvx2()) GTEST_SKIP() << "no AVX2+FMA on this CPU";
    if (GetParam() == Kernel::kAvx512 && !UseAvx512()) GTEST_SKIP() << "no AVX-512F on this CPU";
  }
  void TearDown() override {
    ForcePortableVectorOps(false);
    LimitVectorOpsToAvx2(false);
  }
};

INSTANTIATE_TEST_SUITE_P(Kernels, TriangularTest,
                         ::testing::Values(Kernel::kPortable, Kernel::kAvx2, Kernel::kAvx512),
                         [](const ::testing::TestParamInfo<Kernel>& param) {
                           switch (param.param) {
                             case Kernel::kPortable:
                               return "Portable";
                             case Kernel::kAvx2:
                               return "Avx2";
                             case Kernel::kAvx512:
                               break;
                           }
                           return "Avx512";
                         });

// ||v T||^2 in fp64 from the fp32 inputs, reading only the lower triangle.
double NormSquaredFp64(const float* v, int64_t d, const float* t, int64_t ldt) {
  double sum = 0.0;
  for (int64_t j = 0; j < d; ++j) {
    double u = 0.0;
    for (int64_t i = j; i < d; ++i) u += double{v[i]} * t[i * ldt + j];
    sum += u * u;
  }
  return sum;
}

TEST_P(TriangularTest, SquaredNormsMatchFp64AtEveryShape) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int64_t d : {1, 3, 8, 15, 16, 17, 31, 48, 64, 80, 128}) {
    for (int64_t rows : {1, 5, 6, 7, 11, 12, 13, 25}) {
      for (int64_t count : {1, 3}) {
        const int64_t ldv = d + 3, ldt = count * d + 5, out_stride = rows + 2;
        std::vector<float> v(rows * ldv), t(d * ldt, 0.f);
        for (float& x : v) x = normal(rng);
        for (int64_t f = 0; f < count; ++f) {
          for (int64_t i = 0; i < d; ++i) {
            for (int64_t j = 0; j <= i; ++j) t[i * ldt + f * d + j] = normal(rng);
          }
        }
        // Canaries after each factor's rows: the kernel writes rows entries per factor only.
        // Canaries after the packed factors too: PackTriangles writes exactly the size it states.
        const int64_t packed_size = count * PackedTriangleSize(d);
        std::vector<float> packed(packed_size + 4, -2.f);
        PackTriangles(t.data(), ldt, d, count, packed.data());
        for (int64_t k = packed_size; k < packed_size + 4; ++k) EXPECT_EQ(packed[k], -2.f);
        std::vector<float> out(count * out_stride, -1.f);
        TriangularSquaredNorms(v.data(), ldv, rows, d, packed.data(), count, out.data(),
                               out_stride);
        for (int64_t f = 0; f < count; ++f) {
          for (int64_t r = 0; r < rows; ++r) {
            const double want = NormSquaredFp64(v.data() + r * ldv, d, t.data() + f * d, ldt);
            // Sums of at most d products and d squares in fp32.
            EXPECT_NEAR(out[f * out_stride + r], want,
                        4.0 * static_cast<double>(d) * 0x1p-24 * want)
                << "d " << d << " rows " << rows << " factor " << f << " row " << r;
          }
          for (int64_t r = rows; r < out_stride; ++r) EXPECT_EQ(out[f * out_stride + r], -1.f);
        }
      }
    }
  }
}

// A^T A - T T^T, largest |entry|, in fp64.
double GramResidual(const std::vector<double>& a, int64_t rows, int64_t d, const float* t,
                    int64_t ldt) {
  double worst = 0.0;
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      double gram = 0.0, product = 0.0;
      for (int64_t r = 0; r < rows; ++r) gram += a[r * d + i] * a[r * d + j];
      for (int64_t k = 0; k < d; ++k) product += double{t[i * ldt + k]} * t[j * ldt + k];
      worst = std::max(worst, std::abs(gram - product));
    }
  }
  return worst;
}

TEST(GramCholeskyTest, ReproducesTheGramAndIsLowerTriangular) {
  std::mt19937 rng(11);
  std::normal_distribution<double> normal;
  const int64_t d = 16, ldt = 21;
  // Full rank (rows > d); fewer rows than d (rank 5); two equal columns (rank d - 1).
  for (int64_t rows : {48, 5, 40}) {
    std::vector<double> a(rows * d);
    for (double& x : a) x = static_cast<float>(normal(rng));  // fp32 weights
    if (rows == 40) {
      for (int64_t r = 0; r < rows; ++r) a[r * d + 9] = a[r * d + 4];
    }
    std::vector<double> gram;
    std::vector<float> t(d * ldt, 7.f);
    GramCholesky(a.data(), rows, d, gram, t.data(), ldt);
    double max_diagonal = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      double s = 0.0;
      for (int64_t r = 0; r < rows; ++r) s += a[r * d + j] * a[r * d + j];
      max_diagonal = std::max(max_diagonal, s);
    }
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = i + 1; j < d; ++j) EXPECT_EQ(t[i * ldt + j], 0.f) << i << "," << j;
      for (int64_t j = d; j < ldt; ++j) EXPECT_EQ(t[i * ldt + j], 7.f) << "wrote past d";
    }
    // T is rounded to fp32: the residual is a few units of fp32 roundoff of the Gram's scale.
    EXPECT_LT(GramResidual(a, rows, d, t.data(), ldt), 1e-6 * max_diagonal) << rows << " rows";
  }
}

// Random orthogonal n x n (Gram-Schmidt of a Gaussian matrix, fp64), row-major.
std::vector<double> Orthogonal(int64_t n, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  std::vector<double> q(n * n);
  for (double& x : q) x = normal(rng);
  for (int64_t c = 0; c < n; ++c) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t p = 0; p < c; ++p) {
        double dot = 0.0;
        for (int64_t r = 0; r < n; ++r) dot += q[r * n + c] * q[r * n + p];
        for (int64_t r = 0; r < n; ++r) q[r * n + c] -= dot * q[r * n + p];
      }
    }
    double norm = 0.0;
    for (int64_t r = 0; r < n; ++r) norm += q[r * n + c] * q[r * n + c];
    for (int64_t r = 0; r < n; ++r) q[r * n + c] /= std::sqrt(norm);
  }
  return q;
}

TEST_P(TriangularTest, IllConditionedHeadKeepsTheDigitsTheGramFormLoses) {
  // o_proj head A = U diag(s) V^T, D = 96 rows, d = 64, s from 1 down to 1e-6 (condition number
  // 1e6), rounded to fp32 as a checkpoint's weights are.
  const int64_t D = 96, d = 64;
  std::mt19937 rng(5);
  const std::vector<double> U = Orthogonal(D, rng), V = Orthogonal(d, rng);
  std::vector<double> s(d);
  for (int64_t k = 0; k < d; ++k) s[k] = std::pow(10.0, -6.0 * static_cast<double>(k) / (d - 1));
  std::vector<double> a(D * d);
  for (int64_t r = 0; r < D; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      double x = 0.0;
      for (int64_t k = 0; k < d; ++k) x += U[r * D + k] * s[k] * V[c * d + k];
      a[r * d + c] = static_cast<float>(x);
    }
  }
  std::vector<double> gram_scratch;
  std::vector<float> t(d * d);
  GramCholesky(a.data(), D, d, gram_scratch, t.data(), d);
  std::vector<float> packed(PackedTriangleSize(d));
  PackTriangles(t.data(), d, d, 1, packed.data());
  double t_frobenius = 0.0;
  for (float x : t) t_frobenius += double{x} * x;
  t_frobenius = std::sqrt(t_frobenius);
  // The Gram M = A^T A in fp32, as the previous value factor used it.
  std::vector<float> m(d * d);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      double x = 0.0;
      for (int64_t r = 0; r < D; ++r) x += a[r * d + i] * a[r * d + j];
      m[i * d + j] = static_cast<float>(x);
    }
  }

  // Values along the weakest right singular vectors (||A v|| ~ 1e-6 ||v||) and random ones.
  std::normal_distribution<double> normal;
  double worst_gram_error = 0.0, worst_error = 0.0;
  for (int trial = 0; trial < 24; ++trial) {
    std::vector<float> v(d);
    for (int64_t c = 0; c < d; ++c) {
      v[c] = static_cast<float>(trial < 16 ? V[c * d + (d - 1 - trial % 4)] + 1e-7 * normal(rng)
                                           : normal(rng));
    }
    double exact = 0.0, v_norm = 0.0;  // ||A v|| in fp64 from the fp32 inputs
    for (int64_t r = 0; r < D; ++r) {
      double x = 0.0;
      for (int64_t c = 0; c < d; ++c) x += a[r * d + c] * v[c];
      exact += x * x;
    }
    for (float x : v) v_norm += double{x} * x;
    exact = std::sqrt(exact), v_norm = std::sqrt(v_norm);

    // Errors of the norm relative to the scale of the head's value factors, ||v|| ||T||_F.
    const double scale = v_norm * t_frobenius;
    float q = 0.f;
    TriangularSquaredNorms(v.data(), d, 1, d, packed.data(), 1, &q, 1);
    const double error = std::abs(std::sqrt(double{q}) - exact) / scale;
    // triangular.h: at most about d u (for the kernel's sums and for T's own rounding).
    EXPECT_LE(error, 2.0 * d * 0x1p-24) << "trial " << trial << ": ||Av|| = " << exact;
    if (trial < 16) {
      worst_error = std::max(worst_error, error);
      // ||A v|| is about 1e-6 ||v|| here, and still has its leading digits.
      EXPECT_LT(error * scale / exact, 0.05) << "trial " << trial;
    }

    float gram_form = 0.f;  // v . (v M) in fp32
    for (int64_t i = 0; i < d; ++i) {
      float row = 0.f;
      for (int64_t j = 0; j < d; ++j) row += m[i * d + j] * v[j];
      gram_form += v[i] * row;
    }
    const double gram_value = std::sqrt(std::max(double{gram_form}, 0.0));
    if (trial < 16) {
      worst_gram_error = std::max(worst_gram_error, std::abs(gram_value - exact) / scale);
    }
  }
  // The reason for the factor: along the weak directions the norm from v M v^T in fp32 is off by
  // about the square root of the error of the square, far more than the factor's.
  EXPECT_GT(worst_gram_error, 1000.0 * worst_error)
      << "triangular " << worst_error << ", Gram form " << worst_gram_error;
  std::printf("weak directions, error / (||v|| ||T||_F): triangular %.3g, Gram form %.3g\n",
              worst_error, worst_gram_error);
}

}  // namespace
}  // namespace laprox::kernels::cpu
