// The window logits kernel (cpu/logits.h) against fp64 dots, with canaries around every tile: key
// counts with only pairs of panels (32), a pair and a panel (48), a partial panel alone (1-17).
#include "cpu/logits.h"

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/vector_ops.h"

namespace laprox::kernels::cpu {
namespace {

TEST(LogitsTest, MatchFp64DotsAtEveryShape) {
  if (!UseAvx512()) GTEST_SKIP() << "no AVX-512F on this CPU: the backend calls sgemm";
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> packed;
  for (int64_t d : {1, 3, 16, 64, 80, 128}) {
    for (int64_t rows : {1, 11, 12, 13, 96}) {
      for (int64_t count : {1, 15, 16, 17, 32, 48, 1000}) {
        const int64_t ldq = d + 1, ldk = d + 3, ldc = count + 5;
        std::vector<float> q(rows * ldq), keys(count * ldk);
        for (float& x : q) x = normal(rng);
        for (float& x : keys) x = normal(rng);
        std::vector<float> c(rows * ldc + 7, -3.f);
        ASSERT_TRUE(
            QueryKeyLogits(q.data(), ldq, rows, keys.data(), ldk, count, d, c.data(), ldc, packed));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < count; ++j) {
            double want = 0.0, magnitude = 0.0;
            for (int64_t k = 0; k < d; ++k) {
              want += double{q[r * ldq + k]} * keys[j * ldk + k];
              magnitude += std::abs(double{q[r * ldq + k]} * keys[j * ldk + k]);
            }
            ASSERT_NEAR(c[r * ldc + j], want, static_cast<double>(d) * 0x1p-24 * magnitude)
                << "d " << d << " rows " << rows << " count " << count << " at " << r << ", " << j;
          }
          // Only the count columns of each row are written.
          for (int64_t j = count; j < ldc && r * ldc + j < static_cast<int64_t>(c.size()); ++j) {
            ASSERT_EQ(c[r * ldc + j], -3.f) << "d " << d << " rows " << rows << " count " << count
                                            << " wrote column " << j << " of row " << r;
          }
        }
        for (size_t i = rows * ldc; i < c.size(); ++i) ASSERT_EQ(c[i], -3.f);
      }
    }
  }
}

TEST(LogitsTest, WithoutAvx512TheCallerUsesSgemm) {
  const ScopedAvx2Limit avx2;
  std::vector<float> q(4, 1.f), keys(4, 1.f), c(1, -3.f), packed;
  EXPECT_FALSE(QueryKeyLogits(q.data(), 4, 1, keys.data(), 4, 1, 4, c.data(), 1, packed));
  EXPECT_EQ(c[0], -3.f);
}

}  // namespace
}  // namespace laprox::kernels::cpu
