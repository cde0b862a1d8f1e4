"""laprox.vllm's metrics (laprox/vllm/_metrics.py) without vLLM: counts made in other processes
reach prometheus_client's text exposition of a registry in this one, summed by model, with the
stage histograms' buckets cumulative; files of another layout are skipped; with
PROMETHEUS_MULTIPROC_DIR set (vLLM's --api-server-count > 1) the same counts reach
prometheus_client's own multiprocess collector, sample for sample."""

import multiprocessing
import os
import shutil
import tempfile
import unittest

import support

support.prepare_package()

from laprox.vllm import _metrics  # noqa: E402

try:
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # Debian's python3-prometheus-client (scripts/install-deps.sh)
    prometheus_client = None


def engine_process(directory, model, plans, failures, seconds):
    """What an engine-core process does: attach, then count while running."""
    os.environ[_metrics.DIR_VARIABLE] = directory
    early = _metrics.Metrics()
    early.failures += min(failures, 1)  # counted before the model loaded: carried to the file
    metrics = _metrics.attach(early, model)
    assert metrics.in_directory
    metrics.plans += plans
    metrics.failures += failures - min(failures, 1)
    for s in seconds:
        metrics.observe("call", s)
    metrics.observe("apply", 0.003)
    metrics.values.flush()


def run(*args):
    process = multiprocessing.get_context("spawn").Process(target=engine_process, args=args)
    process.start()
    process.join(60)
    assert process.exitcode == 0, process.exitcode


def samples(text):
    """{(name, sorted label items): value} of an exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class VllmMetricsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="laprox-vllm-metrics-test-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.old = os.environ.get(_metrics.DIR_VARIABLE)
        os.environ[_metrics.DIR_VARIABLE] = self.dir
        self.addCleanup(self.restore)

    def restore(self):
        if self.old is None:
            os.environ.pop(_metrics.DIR_VARIABLE, None)
        else:
            os.environ[_metrics.DIR_VARIABLE] = self.old

    def test_counts_of_other_processes_are_summed_by_model(self):
        run(self.dir, "m1", 3, 2, [0.0004, 0.07, 0.07])
        run(self.dir, "m1", 5, 1, [20.0])
        run(self.dir, "m2", 7, 0, [0.001])
        sums = _metrics.read_all()
        self.assertEqual(sorted(sums), ["m1", "m2"])
        m1 = sums["m1"]
        self.assertEqual((m1.plans, m1.failures, m1.prefill_steps, m1.not_captured), (8, 3, 0, 0))
        count, total, cumulative = m1.stage("call")
        self.assertEqual(count, 4)
        self.assertAlmostEqual(total, 20.1404)
        # 0.0004 <= 0.0005; 0.07 <= 0.1 twice; 20 only in +Inf.
        expected = [sum(1 for s in (0.0004, 0.07, 0.07, 20.0) if s <= le)
                    for le in _metrics.BUCKETS]
        self.assertEqual(cumulative, expected)
        self.assertEqual(m1.stage("apply")[:2], (2, 0.006))
        self.assertEqual(sums["m2"].plans, 7)

    def test_a_file_of_another_layout_is_skipped(self):
        run(self.dir, "m1", 3, 0, [])
        with open(os.path.join(self.dir, "1.json"), "w") as f:
            f.write('{"model_name": "m1", "layout": {"counters": ["plans"]}}')
        with open(os.path.join(self.dir, "1.f64"), "wb") as f:
            f.write(b"\0" * 8 * _metrics.SIZE)
        with open(os.path.join(self.dir, "2.json"), "w") as f:
            f.write("{not json")
        self.assertEqual(_metrics.read_all()["m1"].plans, 3)

    def test_without_a_directory_the_counts_stay_in_the_process(self):
        os.environ.pop(_metrics.DIR_VARIABLE)
        metrics = _metrics.Metrics()
        metrics.plans += 2
        self.assertIs(_metrics.attach(metrics, "m"), metrics)
        self.assertFalse(metrics.in_directory)
        os.environ[_metrics.DIR_VARIABLE] = os.path.join(self.dir, "absent", "deeper")
        self.assertIs(_metrics.attach(metrics, "m"), metrics)  # cannot write: logged, kept
        self.assertEqual(metrics.plans, 2)

    @unittest.skipIf(prometheus_client is None, "prometheus_client is not installed")
    def test_exposition_on_a_registry(self):
        run(self.dir, "smollm2", 3, 2, [0.0004, 0.07, 0.07])
        registry = prometheus_client.CollectorRegistry()
        registry.register(_metrics._Collector())
        got = samples(prometheus_client.generate_latest(registry).decode())

        def value(name, **labels):
            return got[(name, tuple(sorted(dict(labels, model_name="smollm2").items())))]

        self.assertEqual(value("laprox_vllm_plans_total"), 3)
        self.assertEqual(value("laprox_vllm_failures_total"), 2)
        self.assertEqual(value("laprox_vllm_not_captured_total"), 0)
        self.assertEqual(value("laprox_vllm_stage_seconds_count", stage="call"), 3)
        self.assertAlmostEqual(value("laprox_vllm_stage_seconds_sum", stage="call"), 0.1404)
        for le, count in [("0.0005", 1), ("0.05", 1), ("0.1", 3), ("+Inf", 3)]:
            self.assertEqual(value("laprox_vllm_stage_seconds_bucket", stage="call", le=le),
                             count, le)
        self.assertEqual(value("laprox_vllm_stage_seconds_count", stage="capture"), 0)

    @unittest.skipIf(prometheus_client is None, "prometheus_client is not installed")
    def test_multiprocess_files_hold_the_same_samples(self):
        from prometheus_client import multiprocess

        shared = os.path.join(self.dir, "prometheus")
        os.mkdir(shared)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared  # the spawned processes inherit it
        try:
            run(self.dir, "m1", 3, 2, [0.0004, 0.07, 0.07])
            run(self.dir, "m1", 5, 1, [20.0])
            run(self.dir, "m2", 7, 0, [0.001])
        finally:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR")
        ours = prometheus_client.CollectorRegistry()
        ours.register(_metrics._Collector())
        theirs = prometheus_client.CollectorRegistry()  # what vLLM's /metrics serves then
        multiprocess.MultiProcessCollector(theirs, path=shared)
        expected = samples(prometheus_client.generate_latest(ours).decode())
        got = {k: v for k, v in samples(prometheus_client.generate_latest(theirs).decode())
               .items() if k[0].startswith("laprox_vllm_")}
        # Every family of every model, zero counts included (the mirror makes each series when
        # it attaches, so a rate over it is 0, not absent).
        self.assertEqual(got, expected)
        self.assertEqual(got[("laprox_vllm_failures_total", (("model_name", "m1"),))], 3)
        self.assertEqual(got[("laprox_vllm_stage_seconds_bucket",
                              (("le", "0.1"), ("model_name", "m1"), ("stage", "call")))], 3)

    def test_attaching_twice_keeps_the_file(self):
        metrics = _metrics.attach(_metrics.Metrics(), "m")
        metrics.plans += 4
        self.assertIs(_metrics.attach(metrics, "m"), metrics)  # the scheduler's process too
        metrics.plans += 1
        self.assertEqual(_metrics.read_all()["m"].plans, 5)

if __name__ == "__main__":
    unittest.main()
