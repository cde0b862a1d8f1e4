#!/usr/bin/python3
"""Writes the Grafana dashboards: monitoring/grafana/laprox.json (laproxd) and
monitoring/grafana/laprox-vllm.json (the laprox.vllm plugin beside vLLM's own KV-cache metrics).

The dashboards are generated so that their panels stay uniform and reviewable; edit this file,
run it, and commit its outputs. tests/monitoring/prometheus_e2e_test.py checks that the JSON is
this script's output and evaluates every query of laprox.json against a real Prometheus
scraping laproxd; tests/integration/vllm/serve.py does the same for laprox-vllm.json against a
Prometheus scraping vLLM's /metrics.

    /usr/bin/python3 monitoring/grafana/build_dashboard.py          # rewrite both
    /usr/bin/python3 monitoring/grafana/build_dashboard.py --check  # exit 1 if one differs
"""

import json
import os
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}
INST = 'instance=~"$instance"'
RATE = "$__rate_interval"

_panels = []
_next_id = [1]
_y = [0]


def _target(expr, legend, ref, instant=False):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
    return t


def row(title):
    _panels.append({"type": "row", "title": title, "id": _next_id[0], "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": _y[0]}, "panels": []})
    _next_id[0] += 1
    _y[0] += 1


def panel(kind, title, description, targets, x, w, h=8, unit=None, extra=None, newline=False):
    """Adds a panel; targets are (expr, legend) pairs or (expr, legend, instant)."""
    refs = "ABCDEFGH"
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "id": _next_id[0],
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": _y[0]},
        "targets": [_target(t[0], t[1], refs[i], *(t[2:])) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {},
    }
    if unit:
        p["fieldConfig"]["defaults"]["unit"] = unit
    if extra:
        for k, v in extra.items():
            p[k] = v
    _panels.append(p)
    _next_id[0] += 1
    if newline:
        _y[0] += h


def quantiles(metric, selector, by, legend_prefix):
    return [(f'histogram_quantile({q}, sum by (le{by}) (rate({metric}{{{selector}}}[{RATE}])))',
             f"{legend_prefix}p{int(q * 100)}") for q in (0.5, 0.95, 0.99)]


def _start():
    _panels.clear()
    _next_id[0] = 1
    _y[0] = 0


def _dashboard(title, uid, description, tags, variables):
    return {
        "title": title,
        "uid": uid,
        "description": description,
        "tags": tags,
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": variables},
        "panels": list(_panels),
    }


def _variables(instance_metric, model_metric, model_label):
    """The data source, instance and model variables: instances from label_values of
    instance_metric, models from label_values of model_metric's model_label."""
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": ""},
        {"name": "instance", "label": "Instance", "type": "query", "datasource": DS,
         "query": {"query": f"label_values({instance_metric}, instance)", "refId": "instance"},
         "definition": f"label_values({instance_metric}, instance)",
         "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "hide": 0,
         "refresh": 2, "regex": "", "sort": 1},
        {"name": "model", "label": "Model", "type": "query", "datasource": DS,
         "query": {"query": f'label_values({model_metric}{{instance=~"$instance"}}, '
                            f'{model_label})', "refId": "model"},
         "definition": f'label_values({model_metric}{{instance=~"$instance"}}, {model_label})',
         "multi": False, "includeAll": False, "current": {}, "hide": 0, "refresh": 2,
         "regex": "", "sort": 1},
    ]


def build():
    """The laproxd dashboard (laprox.json)."""
    _start()
    row("Health and traffic")
    panel("timeseries", "Calls per second, by method",
          "Finished calls per second for each RPC, all status codes.",
          [(f"sum by (method) (rate(laprox_requests_total{{{INST}}}[{RATE}]))", "{{method}}")],
          x=0, w=8, unit="reqps")
    panel("timeseries", "Failed calls per second, by gRPC code",
          "Calls that ended with a code other than OK. INVALID_ARGUMENT/NOT_FOUND/OUT_OF_RANGE "
          "point at the client; RESOURCE_EXHAUSTED at limits; INTERNAL/UNKNOWN at laproxd.",
          [(f'sum by (method, code) (rate(laprox_requests_total{{{INST}, code!="OK"}}[{RATE}]))',
            "{{method}} {{code}}")],
          x=8, w=8, unit="reqps")
    panel("timeseries", "Error ratio (share of calls not OK)",
          "Failed calls divided by all calls. The LaproxHighErrorRatio alert fires above 5%.",
          [(f'sum(rate(laprox_requests_total{{{INST}, code!="OK"}}[{RATE}])) / '
            f"sum(rate(laprox_requests_total{{{INST}}}[{RATE}]))", "error ratio")],
          x=16, w=5, unit="percentunit")
    panel("stat", "Serving / ready",
          "Serving: 1 while laproxd accepts calls. Ready: 1 while a model is registered (the "
          "Kubernetes readiness probe).",
          [(f"min(laprox_serving{{{INST}}})", "serving", True),
           (f"min(laprox_ready{{{INST}}})", "ready", True)],
          x=21, w=3, newline=True)

    row("Latency")
    panel("timeseries", "Keep-plan latency p50 / p95 / p99 (ComputeKeepMask, arrival to reply)",
          "Quantiles of the time from receiving a ComputeKeepMask call to replying.",
          quantiles("laprox_request_duration_seconds_bucket", f'{INST}, method="ComputeKeepMask"',
                    "", ""),
          x=0, w=8, unit="s")
    panel("timeseries", "Keep-plan p99 by stage (queue, validate, score, select, respond)",
          "Where the time of a keep-plan goes: waiting for a worker, checking the request, "
          "scoring every token, selecting the kept set, building the reply.",
          [(f"histogram_quantile(0.99, sum by (le, stage) "
            f"(rate(laprox_keep_plan_stage_duration_seconds_bucket{{{INST}}}[{RATE}])))",
            "{{stage}} p99")],
          x=8, w=8, unit="s")
    panel("timeseries", "Latency p99 by method",
          "99th percentile of every RPC's latency (model registration prepares factors and is "
          "slower by design).",
          [(f"histogram_quantile(0.99, sum by (le, method) "
            f"(rate(laprox_request_duration_seconds_bucket{{{INST}}}[{RATE}])))",
            "{{method}} p99")],
          x=16, w=8, unit="s", newline=True)

    row("Compression")
    panel("timeseries", "KV entries per second: received and kept",
          "KV entries are (layer, KV head, position) triples: a request of n tokens brings "
          "L * Hkv * n of them.",
          [(f"sum(rate(laprox_tokens_received_total{{{INST}}}[{RATE}]))", "received"),
           (f"sum(rate(laprox_tokens_kept_total{{{INST}}}[{RATE}]))", "kept")],
          x=0, w=12, unit="short")
    panel("timeseries", "Kept ratio (kept / received)",
          "Overall: kept entries over received entries. Median: the median per-request ratio.",
          [(f"sum(rate(laprox_tokens_kept_total{{{INST}}}[{RATE}])) / "
            f"sum(rate(laprox_tokens_received_total{{{INST}}}[{RATE}]))", "overall"),
           (f"histogram_quantile(0.5, sum by (le) (rate(laprox_kept_ratio_bucket{{{INST}}}[{RATE}])))",
            "median request")],
          x=12, w=12, unit="percentunit", newline=True)

    row("Budget use of model $model")
    share = f'{INST}, model="$model"'
    panel("heatmap", "Budget share per (layer, KV head), latest request — 1 is an even split",
          "Each row is one (layer, KV head); colour is the tokens it kept divided by the even "
          "share (all kept tokens / (L * Hkv)). LaProx moves budget to the heads that need it. "
          "A model wider than --max_share_series_per_model (or registered once "
          "--max_share_series is used up) has one row per layer (H all) or per band of layers "
          "(L0-3 Hall): the mean share of the heads it covers.",
          [(f"laprox_head_budget_share_ratio{{{share}}}", "L{{layer}} H{{kv_head}}")],
          x=0, w=12, h=12,
          extra={"options": {"calculate": False, "yAxis": {"axisPlacement": "left"},
                             "color": {"mode": "scheme", "scheme": "RdBu", "reverse": True},
                             "cellGap": 1, "rowsFrame": {"layout": "auto"}}})
    panel("timeseries", "Budget share per layer over time — 1 is an even split",
          "Tokens each layer kept divided by the even share (all kept tokens / L), per request.",
          [(f"laprox_layer_budget_share{{{share}}}", "layer {{layer}}")],
          x=12, w=12, h=12, newline=True)
    panel("barchart", "Budget share per layer, latest request",
          "The latest request's per-layer share, layer by layer.",
          [(f"laprox_layer_budget_share{{{share}}}", "layer {{layer}}", True)],
          x=0, w=9)
    panel("stat", "Series of $model",
          "How many budget-share series the model has and what one covers: head (a layer and "
          "KV head), layer (all KV heads of a layer: H all) or band (a band of layers). Fixed "
          "when the model registered, by --max_share_series_per_model and --max_share_series.",
          [(f"laprox_budget_share_series{{{share}}}", "{{granularity}}", True)],
          x=9, w=3)
    panel("timeseries", "Per-layer budget share, median over requests",
          "Median of each layer's share over the requests in the interval.",
          [(f"histogram_quantile(0.5, sum by (le, layer) "
            f"(rate(laprox_layer_budget_share_distribution_bucket{{{share}}}[{RATE}])))",
            "layer {{layer}}")],
          x=12, w=12, newline=True)

    row("Resources")
    panel("timeseries", "Registered regions, by kind",
          "Shared-memory and CUDA IPC regions registered now. A count that keeps growing is a "
          "client that registers without unregistering (LaproxRegionsNearLimit).",
          [(f"sum by (kind) (laprox_registered_regions{{{INST}}})", "{{kind}} regions"),
           (f'max(laprox_limit{{{INST}, what="regions"}})', "limit")],
          x=0, w=6, unit="short")
    panel("timeseries", "Registered region bytes, by kind",
          "Bytes of the registered regions (the engine's buffers laproxd reads).",
          [(f"sum by (kind) (laprox_registered_region_bytes{{{INST}}})", "{{kind}}")],
          x=6, w=6, unit="bytes")
    panel("timeseries", "Registered models and calls in flight",
          "Models registered now, and calls received but not yet answered (queued included).",
          [(f"sum(laprox_registered_models{{{INST}}})", "models"),
           (f"sum(laprox_in_flight_requests{{{INST}}})", "in flight")],
          x=12, w=6, unit="short")
    panel("timeseries", "Backend memory: prepared models, and device memory in use (CUDA)",
          "Bytes of the registered models' prepared factors (host memory on the CPU backend, "
          "device memory on CUDA), and the GPU's memory in use where the backend is CUDA.",
          [(f'label_replace(sum by (instance) (laprox_prepared_model_bytes{{{INST}}}), '
            f'"what", "prepared models", "", "") or label_replace(sum by (instance) '
            f'(laprox_device_memory_used_bytes{{{INST}}}), "what", "device memory in use", "", "")',
            "{{instance}} {{what}}")],
          x=18, w=6, unit="bytes", newline=True)
    panel("table", "Backend and version",
          "Which laproxd runs where, and on which backend.",
          [(f"max by (instance, backend, device, description) (laprox_backend_info{{{INST}}})",
            "", True),
           (f"max by (instance, version) (laprox_build_info{{{INST}}})", "", True)],
          x=0, w=24, h=6, newline=True)

    return _dashboard(
        "laprox — KV-cache eviction sidecar", "laprox-overview",
        "laproxd health, latency, compression and per-layer/head budget use. "
        "Metrics: monitoring/METRICS.md.",
        ["laprox", "llm-serving", "kv-cache"],
        _variables("laprox_build_info", "laprox_head_budget_share_ratio", "model"))


def build_vllm():
    """The plugin's dashboard (laprox-vllm.json): vLLM's KV-cache panels and the plugin's
    decisions side by side, for one served model."""
    _start()
    sel = f'{INST}, model_name="$model"'

    def plugin(counter):
        return f"sum(rate(laprox_vllm_{counter}_total{{{sel}}}[{RATE}]))"

    row("KV cache: vLLM's pool, and what laprox gives back")
    panel("timeseries", "vLLM KV-cache usage",
          "vLLM's own gauge: the share of the KV block pool in use. With "
          "LAPROX_VLLM_TRIGGER=pressure the plugin compacts only when this pool runs short.",
          [(f"vllm:kv_cache_usage_perc{{{sel}}}", "{{instance}}")],
          x=0, w=6, unit="percentunit")
    panel("timeseries", "Requests running and waiting",
          "vLLM's scheduler: requests decoding or prefilling now, and requests waiting for "
          "blocks. Compaction lets more run at once in the same pool.",
          [(f"sum(vllm:num_requests_running{{{sel}}})", "running"),
           (f"sum(vllm:num_requests_waiting{{{sel}}})", "waiting")],
          x=6, w=6, unit="short")
    panel("timeseries", "Blocks given back and preemptions, per second",
          "KV blocks compacted sequences returned to vLLM's pool, against vLLM's preemptions "
          "(a preempted request's computed tokens are thrown away and computed again).",
          [(plugin("blocks_released"), "blocks given back"),
           (f"sum(rate(vllm:num_preemptions_total{{{sel}}}[{RATE}]))", "preemptions")],
          x=12, w=6, unit="short")
    panel("timeseries", "Time between output tokens p50 / p99 (vLLM)",
          "vLLM's inter-token latency: what compaction shortens when decode reads long "
          "caches, and what the plugin's own stages add to.",
          [(f"histogram_quantile({q}, sum by (le) (rate("
            f"vllm:inter_token_latency_seconds_bucket{{{sel}}}[{RATE}])))", f"p{int(q * 100)}")
           for q in (0.5, 0.99)],
          x=18, w=6, unit="s", newline=True)

    row("laprox decisions")
    panel("timeseries", "Sequences per second: planned, compacted, deferred, spared",
          "Planned: got a keep-plan after the prefill. Compacted: evicted entries left the "
          "cache. Deferred: kept the full cache because the pool had room (trigger "
          "pressure). Spared: deferred and never compacted. Above the floor: compacted at a "
          "budget above LAPROX_VLLM_BUDGET, which covered the shortfall. Long prompt: compacted "
          "at once for its length (LAPROX_VLLM_LONG_PROMPT). Re-plans: decode re-plans. "
          "Fenced: plans dropped because their request was aborted, preempted, its id reused "
          "or its cache compacted since.",
          [(plugin("plans"), "planned"), (plugin("compactions"), "compacted"),
           (plugin("deferred"), "deferred"), (plugin("spared"), "spared"),
           (plugin("above_floor"), "above the floor"), (plugin("long_prompt"), "long prompt"),
           (plugin("replans"), "re-plans"), (plugin("fenced"), "fenced")],
          x=0, w=8, unit="short")
    panel("timeseries", "KV entries per second: kept and evicted",
          "(layer, KV head, position) triples: the prompt entries first compactions kept, "
          "and the entries compactions and re-plans took out of the cache.",
          [(plugin("kept_entries"), "kept"), (plugin("evicted_entries"), "evicted")],
          x=8, w=8, unit="short")
    panel("timeseries", "Prompt entries kept per compaction",
          "Kept prompt entries per compaction and per (layer, KV head) would be the budget "
          "if every layer kept the same; shown as entries per compaction (divide by layers x "
          "KV heads for the per-head mean).",
          [(f"{plugin('kept_entries')} / {plugin('compactions')}", "kept per compaction")],
          x=16, w=8, unit="short", newline=True)

    row("laprox cost and failures")
    panel("timeseries", "Plan latency p50 / p95 / p99 (one ComputeKeepPlans call)",
          "From the engine's step sending the sequences that finished their prefill to "
          "laproxd's answer; past the plugin's deadline the sequences keep their full cache.",
          quantiles("laprox_vllm_stage_seconds_bucket", f'{sel}, stage="call"', "", ""),
          x=0, w=8, unit="s")
    panel("timeseries", "Plugin seconds per second, by stage",
          "Time the plugin adds to the engine's steps: capturing window queries, calling "
          "laproxd, masking decode rows.",
          [(f"sum by (stage) (rate(laprox_vllm_stage_seconds_sum{{{sel}}}[{RATE}]))",
            "{{stage}}")],
          x=8, w=8, unit="s")
    panel("timeseries", "Sequences kept full by reason, per second",
          "Failures: the sequence kept its full cache because something failed; timeouts and "
          "not ready (no registration with laproxd) are counted in failures too; not "
          "captured: a prefix-cache hit started inside the query window.",
          [(plugin("failures"), "failures"), (plugin("timeouts"), "timeouts"),
           (plugin("not_ready"), "not ready"), (plugin("not_captured"), "not captured")],
          x=16, w=8, unit="short", newline=True)

    return _dashboard(
        "laprox in vLLM — KV cache and keep-plans", "laprox-vllm",
        "The laprox.vllm plugin's decisions, evictions and costs beside vLLM's own KV-cache "
        "metrics, for one served model. Metrics: monitoring/METRICS.md.",
        ["laprox", "vllm", "llm-serving", "kv-cache"],
        _variables("vllm:num_requests_running", "vllm:num_requests_running", "model_name"))


DASHBOARDS = {"laprox.json": build, "laprox-vllm.json": build_vllm}


def render(name="laprox.json"):
    return json.dumps(DASHBOARDS[name](), indent=2, ensure_ascii=False) + "\n"


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    for name in DASHBOARDS:
        path = os.path.join(here, name)
        text = render(name)
        if "--check" in argv:
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    print(f"{path} is not the output of {__file__}; run it and commit the "
                          "result")
                    return 1
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
