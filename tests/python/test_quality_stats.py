"""The paired statistics of bench/quality (stats.py) against answers computed another way."""

import importlib.util
import itertools
import math
import os
import unittest

import numpy as np

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "quality",
                     "stats.py")
_spec = importlib.util.spec_from_file_location("quality_stats", _PATH)
stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stats)


class QualityStatsTest(unittest.TestCase):
    def test_known_answers(self):
        self.assertEqual(stats.self_check(), [])

    def test_mcnemar_is_the_two_sided_sign_test_of_the_discordant_pairs(self):
        # Brute force: every sign pattern of the n discordant pairs as likely as any other; p =
        # the share of patterns at least as unbalanced as the observed one.
        for wa, wb in [(0, 0), (1, 0), (3, 1), (5, 5), (7, 2), (0, 9)]:
            n = wa + wb
            a = [True] * wa + [False] * wb + [True, False] * 3   # concordant pairs added
            b = [False] * wa + [True] * wb + [True, False] * 3
            got = stats.mcnemar_exact(a, b)
            extreme = abs(wa - wb)
            count = sum(1 for signs in itertools.product((0, 1), repeat=n)
                        if abs(2 * sum(signs) - n) >= extreme)
            expected = count / 2 ** n if n else 1.0
            self.assertEqual(got[:2], (wa, wb))
            self.assertAlmostEqual(got[2], expected, places=12, msg=(wa, wb))

    def test_bootstrap_interval_matches_the_normal_interval_on_a_large_sample(self):
        rng = np.random.default_rng(3)
        a = rng.normal(1.0, 2.0, 2000)
        b = a - rng.normal(0.1, 0.5, 2000)
        d, lo, hi, p = stats.paired_bootstrap(a, b)
        diff = a - b
        se = diff.std(ddof=1) / math.sqrt(diff.size)
        self.assertAlmostEqual(d, diff.mean(), places=12)
        self.assertAlmostEqual(lo, diff.mean() - 1.96 * se, delta=0.15 * se)
        self.assertAlmostEqual(hi, diff.mean() + 1.96 * se, delta=0.15 * se)
        self.assertLess(p, 1e-3)
        # no true difference (zero-mean noise): the interval holds 0 and p is not small
        _, lo, hi, p = stats.paired_bootstrap(a, a + rng.normal(0.0, 0.5, 2000))
        self.assertTrue(lo <= 0.0 <= hi, (lo, hi))
        self.assertGreater(p, 0.05)
        # identical pairs: a zero-width interval at 0
        self.assertEqual(stats.paired_bootstrap(a, a)[:3], (0.0, 0.0, 0.0))

    def test_holm_never_below_the_raw_p_and_monotone_in_it(self):
        p = {"a": 0.001, "b": 0.2, "c": 0.01, "d": 0.03}
        h = stats.holm(p)
        self.assertAlmostEqual(h["a"], 0.004)
        self.assertAlmostEqual(h["c"], 0.03)
        self.assertAlmostEqual(h["d"], 0.06)
        self.assertAlmostEqual(h["b"], 0.2)
        for key in p:
            self.assertGreaterEqual(h[key], p[key])


if __name__ == "__main__":
    unittest.main()
