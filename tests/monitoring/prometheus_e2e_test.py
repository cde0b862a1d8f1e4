#!/usr/bin/python3
"""End to end: real laproxd processes scraped by a real Prometheus server.

    prometheus_e2e_test.py LAPROXD LAPROX_TRAFFIC REPO_ROOT

Starts two laproxd (A: a busy engine, its model's budget shares capped at 2 series so that the
dashboard is shown to work on coarse series, one per layer; B: an engine that registered its
regions up to the limit and never asks for a plan) and names a third target where nothing
listens (C: a dead sidecar),
starts Prometheus on loopback with a 1 s scrape and rule interval and the project's rules, sends
a known set of calls with laprox_traffic, and then evaluates through Prometheus's HTTP API:

  * every query of monitoring/grafana/laprox.json (variables substituted): each must return data;
  * every recording rule's expression: each must return data;
  * every alert's expression: it must select exactly the instances planted for it, and the rules
    API must show the alert pending or firing for exactly those;
  * every laprox_* metric named in the dashboard or the rules must be one laproxd exports.

It also checks the dashboard's structure (panels, targets, datasource uids, variables), that the
JSON is build_dashboard.py's output, and — to show the check can fail — that a query naming a
metric laproxd does not export is reported. Needs /usr/bin/prometheus (Debian's prometheus).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# Exported only by a laproxd on the CUDA backend (monitoring/METRICS.md); queries naming them
# must still return data on the CPU backend through their other part.
CUDA_ONLY = {"laprox_device_memory_used_bytes"}
DEADLINE_S = 90


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_laproxd(binary, tmp, name, *flags):
    log = open(os.path.join(tmp, f"laproxd-{name}.log"), "w+")
    sock = os.path.join(tmp, f"{name}.sock")
    proc = subprocess.Popen([binary, f"--socket={sock}", "--metrics_listen=127.0.0.1:0", *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(200):
        log.seek(0)
        m = re.search(r"metrics on http port (\d+)", log.read())
        if m:
            return proc, f"unix:{sock}", f"127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    log.seek(0)
    raise RuntimeError(f"laproxd {name} did not start:\n{log.read()}")


class Prometheus:
    """A Prometheus on loopback scraping `targets` (host:port) every second, with the rules file
    `rules` (None: no rules)."""

    def __init__(self, tmp, targets, rules):
        self.port = free_port()
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    + (f"rule_files:\n  - {rules}\n" if rules else "")
                    + "scrape_configs:\n  - job_name: laprox\n    static_configs:\n"
                    f"      - targets: {json.dumps(targets)}\n")
        self.log = open(os.path.join(tmp, "prometheus.log"), "w+")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        self.log.seek(0)
        raise RuntimeError(f"prometheus did not become ready:\n{self.log.read()}")

    def api(self, path, **params):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path}: {body}")
        return body["data"]

    def query(self, expr):
        """The instant vector of expr now (a list of {metric, value}); raises on a bad query."""
        return self.api("query", query=expr)["result"]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=20)


def dashboard_queries(dashboard, model):
    """(panel title, expr with the dashboard's variables substituted) of every target."""
    out = []
    for variable in dashboard["templating"]["list"]:
        q = variable.get("definition")
        if q:
            out.append((f"variable {variable['name']}", label_values_expr(q)))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$__rate_interval", "1m")
                    .replace('"$instance"', '".*"').replace("$model", model))
            out.append((panel["title"], expr))
    return out


def label_values_expr(definition):
    """label_values(selector, label) -> the selector (it must return series)."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
    if not m:
        raise AssertionError(f"unexpected variable query {definition}")
    return m.group(1).replace('"$instance"', '".*"')


def load_rules(path):
    # The rules file is plain YAML; Debian's python3-yaml reads it.
    import yaml
    with open(path) as f:
        groups = yaml.safe_load(f)["groups"]
    return [rule for g in groups for rule in g["rules"]]


def check_dashboard_structure(dashboard):
    problems = []
    if dashboard.get("schemaVersion", 0) < 36:
        problems.append("schemaVersion below 36 (Grafana 9+)")
    names = {v["name"]: v for v in dashboard["templating"]["list"]}
    if names.get("datasource", {}).get("type") != "datasource":
        problems.append("no datasource variable of type datasource")
    for name in ("instance", "model"):
        if names.get(name, {}).get("type") != "query":
            problems.append(f"no query variable {name}")
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)):
        problems.append("duplicate panel ids")
    known = {"row", "timeseries", "stat", "heatmap", "barchart", "table", "gauge", "bargauge"}
    for p in dashboard["panels"]:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        if p.get("type") not in known:
            problems.append(f"{where}: unknown type {p.get('type')}")
        g = p.get("gridPos", {})
        if not all(k in g for k in ("x", "y", "w", "h")) or g["x"] + g["w"] > 24:
            problems.append(f"{where}: bad gridPos {g}")
        if p["type"] == "row":
            continue
        if not p.get("title") or not p.get("targets"):
            problems.append(f"{where}: no title or no targets")
        for t in [p] + p["targets"]:
            if t.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
                problems.append(f"{where}: datasource is not the ${{datasource}} variable")
        refs = [t["refId"] for t in p["targets"]]
        if len(refs) != len(set(refs)):
            problems.append(f"{where}: duplicate refIds")
    return problems


def metric_names(expr):
    return set(re.findall(r"\blaprox_[a-z0-9_]+", expr))


def exported_families(metrics_text):
    families = set()
    for line in metrics_text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            name, kind = m.groups()
            families.add(name)
            if kind == "histogram":
                families |= {name + "_bucket", name + "_count", name + "_sum"}
    return families


def main(argv):
    laproxd, traffic, root = argv[1:4]
    if not os.path.exists(PROMETHEUS):
        print(f"FAIL: {PROMETHEUS} not found (Debian package prometheus; scripts/install-deps.sh)")
        return 1
    with open(os.path.join(root, "monitoring/grafana/laprox.json")) as f:
        dashboard = json.load(f)
    rules = load_rules(os.path.join(root, "monitoring/prometheus/rules.yml"))
    failures = []

    failures += [f"dashboard: {p}" for p in check_dashboard_structure(dashboard)]
    generated = subprocess.run([sys.executable, os.path.join(root, "monitoring/grafana/build_dashboard.py"),
                                "--check"], capture_output=True, text=True)
    if generated.returncode != 0:
        failures.append(f"dashboard: {generated.stdout.strip()}")

    tmp = tempfile.mkdtemp(prefix="laprox-prom-")
    procs = []
    prometheus = None
    try:
        # The traffic clients exit once they have planted regions and models; --lease_seconds=0
        # keeps what they registered (laproxd would otherwise reclaim it: service/core/leases.h).
        # The traffic model has 2 layers x 2 KV heads: at 2 series it gets one per layer.
        a, a_target, a_metrics = start_laproxd(laproxd, tmp, "a", "--lease_seconds=0",
                                               "--max_share_series_per_model=2")
        procs.append(a)
        b, b_target, b_metrics = start_laproxd(laproxd, tmp, "b", "--max_regions=4",
                                               "--lease_seconds=0")
        procs.append(b)
        c_metrics = f"127.0.0.1:{free_port()}"  # nothing listens there
        prometheus = Prometheus(tmp, [a_metrics, b_metrics, c_metrics],
                                os.path.join(root, "monitoring/prometheus/rules.yml"))

        # Traffic only after a first scrape, so that rates see it happen.
        deadline = time.time() + 30
        while time.time() < deadline:
            up = {s["metric"]["instance"]: s["value"][1] for s in prometheus.query("up")}
            if up.get(a_metrics) == "1" and up.get(b_metrics) == "1":
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"laproxd targets not up in Prometheus: {up}")
        for target, args in ((a_target, ["--plans=6", "--bad=6", "--regions=1"]),
                             (b_target, ["--plans=0", "--bad=0", "--regions=4"])):
            run = subprocess.run([traffic, f"--target={target}", *args], capture_output=True,
                                 text=True, timeout=120)
            print(run.stdout.strip(), run.stderr.strip())
            if run.returncode != 0:
                raise RuntimeError(f"laprox_traffic {args} failed")

        with urllib.request.urlopen(f"http://{a_metrics}/metrics", timeout=10) as r:
            families = exported_families(r.read().decode())

        expected_alerts = {
            "LaproxHighErrorRatio": {a_metrics},
            "LaproxHighKeepPlanLatency": set(),
            "LaproxNoSuccessfulKeepPlans": {b_metrics},
            "LaproxRegionsNearLimit": {b_metrics},
            "LaproxNotServing": {c_metrics},
        }
        checks = []  # (description, expr, kind, expected instances)
        for title, expr in dashboard_queries(dashboard, "traffic"):
            checks.append((f"dashboard {title!r}", expr, "data", None))
        checks.append(("coarse budget-share series", 'laprox_budget_share_series{model="traffic",'
                       'granularity="layer"} == 2', "data", None))
        checks.append(("a coarse head series", 'laprox_head_budget_share_ratio{model="traffic",'
                       'kv_head="all",layer="1"}', "data", None))
        for rule in rules:
            if "record" in rule:
                checks.append((f"recording rule {rule['record']}", rule["expr"], "data", None))
                checks.append((f"recorded series {rule['record']}", rule["record"], "data", None))
            else:
                if rule["alert"] not in expected_alerts:
                    failures.append(f"alert {rule['alert']} has no planted condition in this test")
                    continue
                checks.append((f"alert {rule['alert']}", rule["expr"], "instances",
                               expected_alerts[rule["alert"]]))

        for description, expr, _, _ in checks:
            for name in metric_names(expr) - families - CUDA_ONLY:
                failures.append(f"{description}: names {name}, which laproxd does not export")
        # The same check on a planted typo must fail, or the check is worthless.
        if not metric_names("rate(laprox_requests_totals[1m])") - families:
            failures.append("self-check: a misspelt metric name was not reported")

        # Rates need a few scrapes after the traffic: poll until every check holds (or time out).
        deadline = time.time() + DEADLINE_S
        while True:
            pending = []
            for description, expr, kind, expected in checks:
                result = prometheus.query(expr)
                if kind == "data":
                    if not result:
                        pending.append(f"{description}: no data for {expr}")
                else:
                    got = {s["metric"].get("instance") for s in result}
                    if got != expected:
                        pending.append(f"{description}: selects {sorted(got)}, planted "
                                       f"{sorted(expected)}")
            states = {}
            for group in prometheus.api("rules", type="alert")["groups"]:
                for rule in group["rules"]:
                    states[rule["name"]] = {al["labels"].get("instance") for al in rule["alerts"]
                                            if al["state"] in ("pending", "firing")}
            for name, expected in expected_alerts.items():
                if states.get(name) != expected:
                    pending.append(f"rules API: {name} active for {sorted(states.get(name, []))}, "
                                   f"planted {sorted(expected)}")
            if not pending or time.time() > deadline:
                break
            time.sleep(1)
        failures += pending
        print(f"evaluated {len(checks)} expressions ({sum(1 for c in checks if c[2] == 'data')} "
              f"must return data, {len(expected_alerts)} alerts on planted conditions) against "
              f"Prometheus with laproxd {a_metrics}, {b_metrics} and a dead target {c_metrics}")
    finally:
        if prometheus:
            prometheus.stop()
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if failures:
            for name in sorted(os.listdir(tmp)):
                if name.endswith(".log"):
                    with open(os.path.join(tmp, name)) as f:
                        print(f"--- {name}\n{f.read()[-3000:]}")
        shutil.rmtree(tmp, ignore_errors=True)

    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
