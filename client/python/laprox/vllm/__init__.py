"""laprox inside vLLM: compress each sequence's KV cache after its prefill through laproxd.

Installed with the package (entry point `laprox = laprox.vllm:register` in the group
`vllm.general_plugins`); vLLM calls register() in every process it starts. The plugin does
nothing unless LAPROX_VLLM_TARGET names a laproxd and the engine loads laprox's KV connector
(laprox.vllm.connector, KV_TRANSFER_CONFIG), e.g.

    LAPROX_VLLM_TARGET=unix:/run/laprox/laproxd.sock LAPROX_VLLM_BUDGET=256 \\
        VLLM_CPU_KVCACHE_SPACE=1 vllm serve MODEL --enforce-eager --kv-transfer-config \\
        '{"kv_connector": "LaproxConnector", "kv_connector_module_path": "laprox.vllm.connector", "kv_role": "kv_producer"}'

(offline: LLM(MODEL, ..., kv_transfer_config=laprox.vllm.kv_transfer_config())). Without the
connector the plugin stays off and says so once.

Configuration (environment, read once per process; see Config):
    LAPROX_VLLM_TARGET    laproxd address (unset: the plugin is off)
    LAPROX_VLLM_BUDGET    kept tokens per KV head (int) or a compression ratio (float < 1)
    LAPROX_VLLM_POLICY    policy options as JSON, e.g. {"kind": "laprox", "window": 32}
    LAPROX_VLLM_WINDOW    post-RoPE query rows captured per layer (default 32)
    LAPROX_VLLM_MODEL     the model's name in laproxd's metrics (default: vLLM's model name)
    LAPROX_VLLM_MODE      compact (default): evicted entries leave the cache and the blocks
                          they free go back to vLLM (plans are asked for with plan_shape
                          layer_uniform and max_layer_share 1.25, and LAPROX with pooling avg
                          and sinks 1, the scoring bench/quality/JOINT.md chose for that shape,
                          unless LAPROX_VLLM_POLICY sets them; null unsets); mask: they stay
                          and decode leaves them out (laproxd's defaults)
    LAPROX_VLLM_TRIGGER   compact mode: always (default): every planned sequence is compacted
                          right after its prefill; pressure: it keeps its full cache (deferred)
                          until vLLM's pool (with the blocks compactions under way give back)
                          has fewer free blocks than the running requests and the first waiting
                          one need two steps on, and then the fewest deferred sequences
                          that cover the shortfall are compacted to the budget (a floor: never
                          deeper); a sequence the pool never needed ends uncompressed (spared)
    LAPROX_VLLM_PRESSURE_BUDGETS
                          with the pressure trigger and a budget in tokens: budgets above
                          LAPROX_VLLM_BUDGET, comma-separated (e.g. 1024,2048); each sequence
                          is also planned at each of them (one laproxd call, a plan per
                          budget), and a compacted sequence gets the largest budget that still
                          covers the shortfall (default: none, the budget only)
    LAPROX_VLLM_LONG_PROMPT
                          with the pressure trigger: a sequence whose prompt has at least this
                          many tokens is compacted at once, pool short or not (default 0: none)
    LAPROX_VLLM_DECODE_BUFFER
                          N > 0 (compact mode, an int budget): a compacted sequence is
                          re-planned through laproxd and compacted again whenever its cache
                          reaches budget + N entries per head on average, so that a long
                          generation stays within it (default 0: planned once, after the prefill)
    LAPROX_VLLM_DEADLINE_SECONDS
                          how long a step waits for its plans (default 2; per call
                          laprox.client.plan_deadline: as much again per 32K prompt tokens);
                          past it the sequences keep their full cache (laprox_vllm_timeouts_total)
    LAPROX_VLLM_REGISTER_DEADLINE_SECONDS
                          deadline of each registration call (default 30), made on a thread of
                          the plugin's, never in a step; also the longest the engine's start-up
                          waits for the first registration

What it does (vLLM 0.32, CPU attention backend; see DESIGN.md in this directory):
  - the KV block pool lives in one POSIX shared-memory object of the engine's, registered with
    laproxd (again after laproxd starts late or restarts), so laproxd reads every layer's keys
    and values in place through each sequence's block table;
  - the post-RoPE queries of the last w prompt positions are captured per layer during the
    prefill (chunked prefill included: each chunk adds its rows);
  - when a sequence's prefill completes, one ComputeKeepPlans call covers every sequence that
    completed in that step, and the plans are kept per request (`plans()`);
  - compact mode: the next step moves each layer's kept entries to the front of the sequence's
    private blocks and gives the other blocks back to vLLM's pool; from then on each layer's
    attention reads only its kept entries and the generated ones (DESIGN.md, section 6);
  - mask mode (and a sequence not compacted): the evicted prompt entries take no part in
    decode attention (its rows are recomputed with them masked, as laprox.hf does);
  - no step waits on laproxd longer than the plan deadline, nor on the disk: the registrations
    (and reading o_proj from the checkpoint) happen on the plugin's own thread; a sequence whose
    prefill ends while they are not made, or whose plan call times out, keeps its full cache
    (counted), and a laproxd that timed out is checked in the background until it answers;
  - its counters and stage times are on vLLM's /metrics (`laprox_vllm_*`, see _metrics.py) and
    in `metrics()`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

# The --kv-transfer-config (LLM(kv_transfer_config=...)) that makes vLLM load laprox's KV
# connector (laprox.vllm.connector), without which the plugin stays off.
KV_TRANSFER_CONFIG: Dict[str, Any] = {"kv_connector": "LaproxConnector",
                                      "kv_connector_module_path": "laprox.vllm.connector",
                                      "kv_role": "kv_producer"}

# The vLLM releases the plugin was tested with: its hooks patch their internals.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def register() -> None:
    """The vllm.general_plugins entry point: installs the hooks when LAPROX_VLLM_TARGET is
    set (idempotent: vLLM may call it more than once per process)."""
    if not os.environ.get("LAPROX_VLLM_TARGET"):
        return
    import vllm

    from . import _metrics

    if vllm.__version__ not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"laprox.vllm supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; this is vLLM "
            f"{vllm.__version__}. Unset LAPROX_VLLM_TARGET to run without laprox.")
    from . import _runner

    _metrics.ensure_directory()
    _metrics.export()
    _runner.install(_runner.Config.from_env())


def kv_transfer_config() -> Optional[Dict[str, Any]]:
    """The kv_transfer_config of an engine that runs the plugin: KV_TRANSFER_CONFIG when
    LAPROX_VLLM_TARGET is set, None (vLLM without it) otherwise."""
    return dict(KV_TRANSFER_CONFIG) if os.environ.get("LAPROX_VLLM_TARGET") else None


def plans():
    """The keep-plans computed in this process so far, by vLLM request id."""
    from . import _runner

    return dict(_runner.STATE.plans)


def metrics():
    """The plugin's counters summed over every process of this vLLM engine (the engine core may
    run in a process of its own): plans made, failures (the sequence kept its full cache),
    prefill steps seen, prefills not captured, timeouts and not_ready (failures for want of an
    answer from laproxd within the deadline, or of the registrations), and the seconds spent
    capturing queries, calling laproxd and applying plans in decode (`capture_seconds`,
    `call_seconds`, `apply_seconds`; `stage(name)` gives a stage's histogram)."""
    from . import _metrics, _runner

    total = _metrics.Metrics()
    for counted in _metrics.read_all().values():
        total.values += counted.values
    if not _runner.STATE.metrics.in_directory:
        total.values += _runner.STATE.metrics.values  # this process's, not in the directory
    return total
