"""The plugin's counters and stage times, and their export on vLLM's own /metrics endpoint.

vLLM runs the model, and so the plugin's hooks, in its engine-core process (or in worker
processes), and serves /metrics from the API-server process. The counters therefore live in a
small file per process that runs hooks, mapped into memory and updated in place (no system call
per update): `<dir>/<pid>.f64`, float64 values in the order of LAYOUT, with `<dir>/<pid>.json`
naming the model and the layout. `<dir>` is $LAPROX_VLLM_METRICS_DIR; register() makes a
temporary one in the first process that loads the plugin (vLLM's front end, before it starts the
engine, whose processes inherit the variable) and removes it when that process exits. Every
process that loaded the plugin adds a collector to prometheus_client's default registry, which
sums the files by model at scrape time:

  laprox_vllm_plans_total{model_name}          sequences that got a keep-plan
  laprox_vllm_failures_total{model_name}       sequences that kept their full cache because
                                               something failed (and failed set-up steps)
  laprox_vllm_prefill_steps_total{model_name}  (sequence, step) pairs of prefill seen
  laprox_vllm_not_captured_total{model_name}   prefills a prefix-cache hit started inside the
                                               query window (no plan)
  laprox_vllm_timeouts_total{model_name}       sequences whose ComputeKeepPlans call ran past
                                               the plugin's deadline (in failures too)
  laprox_vllm_not_ready_total{model_name}      sequences whose prefill ended while the plugin
                                               was not registered with laproxd, or was checking
                                               it after a timeout (in failures too)
  laprox_vllm_compactions_total{model_name}    planned sequences whose evicted entries left
                                               the cache (LAPROX_VLLM_MODE=compact)
  laprox_vllm_blocks_released_total{model_name} KV blocks they gave back to vLLM's pool
  laprox_vllm_replans_total{model_name}        decode re-plans of compacted sequences
                                               (LAPROX_VLLM_DECODE_BUFFER)
  laprox_vllm_deferred_total{model_name}       planned sequences left with their full cache
                                               because the pool had room for what the
                                               engine's requests need (LAPROX_VLLM_TRIGGER=
                                               pressure; compacted later if it runs short)
  laprox_vllm_spared_total{model_name}         deferred sequences that ended (or were
                                               preempted) without ever being compacted
  laprox_vllm_evicted_entries_total{model_name} KV entries ((layer, KV head, position)
                                               triples, as laproxd's laprox_tokens_*_total)
                                               that compactions and re-plans took out of the
                                               cache
  laprox_vllm_kept_entries_total{model_name}   prompt entries that first compactions kept;
                                               over compactions_total and layers x KV heads,
                                               the mean kept per head against the budget
  laprox_vllm_above_floor_total{model_name}    deferred sequences compacted at a budget above
                                               LAPROX_VLLM_BUDGET, which covered the pool's
                                               shortfall (LAPROX_VLLM_PRESSURE_BUDGETS)
  laprox_vllm_long_prompt_total{model_name}    sequences compacted at once under the pressure
                                               trigger because their prompt reached
                                               LAPROX_VLLM_LONG_PROMPT tokens
  laprox_vllm_fenced_total{model_name}         plans and window captures dropped because
                                               their request ended, was preempted, its id
                                               reused or its cache compacted since they were
                                               made (the fence, _compact.current)
  laprox_vllm_stage_seconds{model_name,stage}  histogram per engine step of the time spent
      capturing window queries (stage="capture"), calling laproxd (stage="call", one per
      ComputeKeepPlans call) and recomputing masked decode rows (stage="apply")

A process that died keeps its file, so its counts stay in the sums (counters do not go back).

With vLLM's --api-server-count > 1 vLLM sets PROMETHEUS_MULTIPROC_DIR, and its /metrics reads
only prometheus_client's multiprocess files there, not the default registry. In that layout
every process that counts also mirrors each update into prometheus_client Counters and one
Histogram of the same names (prometheus_client writes them to its file in that directory, as it
does vLLM's own), and vLLM's /metrics sums them with its own.
"""

from __future__ import annotations

import atexit
import bisect
import json
import logging
import os
import shutil
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

logger = logging.getLogger("laprox.vllm")

DIR_VARIABLE = "LAPROX_VLLM_METRICS_DIR"
COUNTERS = ("plans", "failures", "prefill_steps", "not_captured", "timeouts", "not_ready",
            "compactions", "blocks_released", "replans", "deferred", "spared",
            "evicted_entries", "kept_entries", "above_floor", "long_prompt", "fenced")
STAGES = ("capture", "call", "apply")
# Upper bounds of the stage histograms' buckets, seconds (the last bucket, +Inf, is the count).
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STAGE_SIZE = 2 + len(BUCKETS)  # count, sum, then the observations per bucket (not cumulative)
SIZE = len(COUNTERS) + len(STAGES) * _STAGE_SIZE
LAYOUT = {"counters": list(COUNTERS), "stages": list(STAGES), "buckets": list(BUCKETS)}


HELP = {
    "plans": "Sequences that got a laprox keep-plan",
    "failures": "Sequences that kept their full KV cache because the laprox plugin or laproxd "
                "failed (and failed set-up steps)",
    "prefill_steps": "(sequence, step) pairs of prefill the laprox plugin saw",
    "not_captured": "Prefills a prefix-cache hit started inside the query window (no plan)",
    "timeouts": "Sequences whose laproxd call ran past the laprox plugin's deadline (they kept "
                "their full KV cache; counted in failures too)",
    "not_ready": "Sequences that kept their full KV cache because the laprox plugin was not "
                 "registered with laproxd (or was checking it after a timeout); counted in "
                 "failures too",
    "compactions": "Planned sequences whose evicted entries left vLLM's KV cache (the others "
                   "decode masked, or with their full cache when deferred)",
    "blocks_released": "KV blocks compacted sequences gave back to vLLM's pool",
    "replans": "Decode re-plans of compacted sequences whose cache reached budget + "
               "LAPROX_VLLM_DECODE_BUFFER",
    "deferred": "Planned sequences left with their full KV cache because vLLM's pool had room "
                "for what its requests need (LAPROX_VLLM_TRIGGER=pressure)",
    "spared": "Deferred sequences that ended or were preempted without ever being compacted",
    "evicted_entries": "KV entries, (layer, KV head, position) triples, that compactions and "
                       "decode re-plans took out of vLLM's KV cache",
    "kept_entries": "Prompt KV entries, (layer, KV head, position) triples, that first "
                    "compactions kept",
    "above_floor": "Deferred sequences compacted at a budget above LAPROX_VLLM_BUDGET because "
                   "that covered the pool's shortfall (LAPROX_VLLM_PRESSURE_BUDGETS)",
    "long_prompt": "Sequences compacted at once, not deferred, because their prompt reached "
                   "LAPROX_VLLM_LONG_PROMPT tokens (LAPROX_VLLM_TRIGGER=pressure)",
    "fenced": "Plans (and window captures) dropped because their request was aborted, "
              "preempted or replaced by another of the same id, or its cache compacted, "
              "since they were made",
}
STAGE_HELP = ("Seconds per engine step the laprox plugin spent capturing window queries "
              "(capture), calling laproxd (call, per call) and masking decode rows (apply)")


class _Mirror:
    """prometheus_client metrics of the same names, in prometheus_client's multiprocess mode
    (PROMETHEUS_MULTIPROC_DIR), that the process's updates are copied to."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import Counter, Histogram

        # registry=None: the values live in prometheus_client's multiprocess files, which
        # vLLM's /metrics reads; nothing in this process serves them.
        self.counters = [Counter(f"laprox_vllm_{name}", HELP[name], ["model_name"],
                                 registry=None).labels(model_name) for name in COUNTERS]
        stages = Histogram("laprox_vllm_stage_seconds", STAGE_HELP, ["model_name", "stage"],
                           registry=None, buckets=BUCKETS)
        self.stages = [stages.labels(model_name, stage) for stage in STAGES]


class Metrics:
    """The plugin's counts and stage times in one process, over a float64 array (in memory, or
    mapped from this process's file once attach() found a directory), copied to a _Mirror too
    in prometheus_client's multiprocess mode."""

    def __init__(self, values: Optional[np.ndarray] = None,
                 mirror: Optional[_Mirror] = None) -> None:
        self.values = np.zeros(SIZE) if values is None else values
        self.mirror = mirror

    @property
    def in_directory(self) -> bool:
        """Whether the values are this process's file in the metrics directory."""
        return isinstance(self.values, np.memmap)

    def _stage(self, stage: str) -> int:
        return len(COUNTERS) + STAGES.index(stage) * _STAGE_SIZE

    def observe(self, stage: str, seconds: float) -> None:
        if self.mirror is not None:
            self.mirror.stages[STAGES.index(stage)].observe(seconds)
        base = self._stage(stage)
        self.values[base] += 1
        self.values[base + 1] += seconds
        bucket = bisect.bisect_left(BUCKETS, seconds)
        if bucket < len(BUCKETS):
            self.values[base + 2 + bucket] += 1

    def stage(self, stage: str) -> Tuple[int, float, List[int]]:
        """(observations, seconds in all, cumulative counts per bucket of BUCKETS)."""
        base = self._stage(stage)
        block = self.values[base:base + _STAGE_SIZE]
        return int(block[0]), float(block[1]), [int(c) for c in np.cumsum(block[2:])]

    @property
    def capture_seconds(self) -> float:
        return self.stage("capture")[1]

    @property
    def call_seconds(self) -> float:
        return self.stage("call")[1]

    @property
    def apply_seconds(self) -> float:
        return self.stage("apply")[1]

    def __repr__(self) -> str:
        counts = ", ".join(f"{name}={getattr(self, name)}" for name in COUNTERS)
        times = ", ".join(f"{s}_seconds={self.stage(s)[1]:.4f}" for s in STAGES)
        return f"Metrics({counts}, {times})"


def _counter_property(index: int) -> property:
    def get(self: Metrics) -> int:
        return int(self.values[index])

    def set_(self: Metrics, value: int) -> None:
        if self.mirror is not None and value > self.values[index]:
            self.mirror.counters[index].inc(value - self.values[index])
        self.values[index] = value

    return property(get, set_)


for _index, _name in enumerate(COUNTERS):
    setattr(Metrics, _name, _counter_property(_index))


def ensure_directory() -> str:
    """$LAPROX_VLLM_METRICS_DIR, made (and removed at exit) by the first process that needs it;
    the processes it starts inherit the variable."""
    path = os.environ.get(DIR_VARIABLE)
    if not path:
        path = tempfile.mkdtemp(prefix="laprox-vllm-metrics-")
        os.environ[DIR_VARIABLE] = path
        atexit.register(shutil.rmtree, path, True)
    return path


def attach(metrics: Metrics, model_name: str) -> Metrics:
    """A Metrics over this process's file in the metrics directory, holding what `metrics`
    counted so far, and mirrored into prometheus_client's multiprocess files when
    PROMETHEUS_MULTIPROC_DIR is set; `metrics` itself when it is attached already (the scheduler
    and the model runner may share a process) or there is no directory or it cannot be written.
    Stage times observed before attaching are not mirrored (they are observed in steps, after
    the model loaded)."""
    path = os.environ.get(DIR_VARIABLE)
    if not path or metrics.in_directory:
        return metrics
    base = os.path.join(path, str(os.getpid()))
    try:
        values = np.memmap(base + ".f64", dtype=np.float64, mode="w+", shape=(SIZE,))
        values[:] = metrics.values
        with open(base + ".json.tmp", "w") as f:
            json.dump({"model_name": model_name, "layout": LAYOUT}, f)
        os.replace(base + ".json.tmp", base + ".json")
    except OSError as e:
        logger.warning("laprox: cannot write the plugin's metrics under %s (%s); they stay in "
                       "this process (laprox.vllm.metrics())", path, e)
        return metrics
    mirror = None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        try:
            mirror = _Mirror(model_name)
        except Exception as e:  # noqa: BLE001 - prometheus_client missing or refusing
            logger.warning("laprox: the plugin's metrics are not in prometheus_client's "
                           "multiprocess files (%r); laprox.vllm.metrics() has them", e)
        else:
            for counter, value in zip(mirror.counters, values[:len(COUNTERS)]):
                if value:
                    counter.inc(float(value))
    return Metrics(values, mirror)


def read_all(path: Optional[str] = None) -> Dict[str, Metrics]:
    """The sums of every process's file in the metrics directory, by model name. Files of
    another layout (another laprox version) or torn by a process still writing them are
    skipped."""
    path = path or os.environ.get(DIR_VARIABLE)
    sums: Dict[str, Metrics] = {}
    if not path or not os.path.isdir(path):
        return sums
    for name in sorted(os.listdir(path)):
        if not name.endswith(".json"):
            continue
        base = os.path.join(path, name[:-len(".json")])
        try:
            with open(base + ".json") as f:
                meta = json.load(f)
            values = np.fromfile(base + ".f64", dtype=np.float64)
        except (OSError, ValueError):
            continue
        if meta.get("layout") != LAYOUT or values.shape != (SIZE,):
            continue
        model = str(meta.get("model_name", ""))
        sums.setdefault(model, Metrics()).values += values
    return sums


class _Collector:
    """prometheus_client collector of the sums of read_all()."""

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        sums = read_all()
        for counter in COUNTERS:
            family = CounterMetricFamily(f"laprox_vllm_{counter}", HELP[counter],
                                         labels=["model_name"])
            for model, metrics in sums.items():
                family.add_metric([model], getattr(metrics, counter))
            yield family
        family = HistogramMetricFamily("laprox_vllm_stage_seconds", STAGE_HELP,
                                       labels=["model_name", "stage"])
        for model, metrics in sums.items():
            for stage in STAGES:
                count, total, cumulative = metrics.stage(stage)
                buckets = [(repr(le), c) for le, c in zip(BUCKETS, cumulative)]
                buckets.append(("+Inf", count))
                family.add_metric([model, stage], buckets, total)
        yield family


_REGISTERED = False


def export() -> None:
    """Adds the collector to prometheus_client's default registry, once per process (vLLM's
    single API server serves that registry on /metrics); nothing without prometheus_client."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    REGISTRY.register(_Collector())
    _REGISTERED = True
