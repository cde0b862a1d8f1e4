#!/usr/bin/env python3
"""Checks rendered Kubernetes objects for what a schema cannot see: the sidecar's wiring.

Run (scripts/check-deploy.sh does, after `kubectl kustomize` of each overlay and the offline
run of the README's kubectl recipe; it needs PyYAML and jsonschema, both in its venv):

    build/deploy-venv/bin/python tests/deploy/check_rendered.py build/deploy-rendered/*.yaml

kubernetes-validate checks the built-in kinds against the upstream schemas; it has none for
custom resources, so the PodMonitor is checked here against POD_MONITOR_SCHEMA (the part of
the Prometheus Operator's monitoring.coreos.com/v1 schema these manifests use, closed to
unknown fields to catch typos). Any other custom kind fails until it gets a schema here.
For every pod template with a laproxd container it also checks: shared socket and /dev/shm
volumes mounted by every container, one user for the engine and laproxd (shared memory is
created with mode 0600), fsGroup, shareProcessNamespace, laproxd's hardening and resources,
no GPU request on laproxd, GPU visibility through runtimeClassName nvidia, ConfigMaps that
envFrom names, and a PodMonitor and a dashboard ConfigMap that match. Extend it by adding a
check to check_pod() or main(); each problem is printed and the exit status is 1.
"""

import json
import sys

import jsonschema
import yaml

CORE_API_VERSIONS = {"v1", "apps/v1"}
DURATION = (r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
            r"(([0-9]+)ms)?)$")
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"],
            "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
POD_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"any": {"type": "boolean"},
                                                     "matchNames": {"type": "array"}}},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["port"],
                    "properties": {
                        "port": {"type": "string"},
                        "portNumber": {"type": "integer"},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        "honorLabels": {"type": "boolean"},
                        "honorTimestamps": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    },
                }},
            },
        },
    },
}


class Checker:
    def __init__(self):
        self.problems = []

    def fail(self, where, message):
        self.problems.append(f"{where}: {message}")

    def check_file(self, path):
        with open(path, encoding="utf-8") as f:
            objects = [o for o in yaml.safe_load_all(f) if o is not None]
        config_maps = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ConfigMap"}
        pods = []
        for o in objects:
            where = f"{path}: {o.get('kind')}/{o.get('metadata', {}).get('name')}"
            if o.get("apiVersion") not in CORE_API_VERSIONS:
                if o.get("kind") == "PodMonitor":
                    self.check_schema(where, o, POD_MONITOR_SCHEMA)
                else:
                    self.fail(where, "custom kind without a schema in check_rendered.py")
            template = o.get("spec", {}).get("template") if o.get("kind") == "Deployment" else None
            if template and any(c.get("name") == "laproxd"
                                for c in template.get("spec", {}).get("containers", [])):
                pods.append((where, template))
                self.check_pod(where, template, config_maps)
        if not pods:
            self.fail(path, "no Deployment with a laproxd container")
        self.check_monitoring(path, objects, pods)

    def check_schema(self, where, obj, schema):
        for error in jsonschema.Draft202012Validator(schema).iter_errors(obj):
            location = ".".join(str(p) for p in error.absolute_path) or "(object)"
            self.fail(where, f"{location}: {error.message}")

    def check_pod(self, where, template, config_maps):
        spec = template["spec"]
        containers = spec["containers"]
        laproxd = next(c for c in containers if c["name"] == "laproxd")
        engines = [c for c in containers if c["name"] != "laproxd"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        pod_security = spec.get("securityContext", {})

        if spec.get("shareProcessNamespace") is not True:
            self.fail(where, "shareProcessNamespace is not true (CUDA IPC between containers)")
        if "fsGroup" not in pod_security:
            self.fail(where, "no pod fsGroup (group of the shared socket directory)")
        for name in ("laprox-run", "dshm"):
            if volumes.get(name, {}).get("emptyDir", {}).get("medium") != "Memory":
                self.fail(where, f"volume {name} is not an emptyDir with medium Memory")
        if not engines:
            self.fail(where, "no engine container beside laproxd")
        for container in containers:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            for name in mounts.values():
                if name not in volumes:
                    self.fail(where, f"container {container['name']} mounts missing volume {name}")
            for path, name in (("/run/laprox", "laprox-run"), ("/dev/shm", "dshm")):
                if mounts.get(path) != name:
                    self.fail(where, f"container {container['name']} does not mount {name} at "
                              f"{path}")
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef", {}).get("name")
                if ref is not None and ref not in config_maps:
                    self.fail(where, f"container {container['name']} reads ConfigMap {ref}, "
                              "which is not among the objects")

        security = laproxd.get("securityContext", {})
        expected = {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                    "allowPrivilegeEscalation": False}
        for key, value in expected.items():
            if security.get(key, pod_security.get(key)) != value:
                self.fail(where, f"laproxd securityContext.{key} is not {value}")
        if "ALL" not in security.get("capabilities", {}).get("drop", []):
            self.fail(where, "laproxd does not drop ALL capabilities")
        resources = laproxd.get("resources", {})
        if not resources.get("requests") or not resources.get("limits"):
            self.fail(where, "laproxd has no resource requests and limits")
        if any("nvidia.com/gpu" in resources.get(k, {}) for k in ("requests", "limits")):
            self.fail(where, "laproxd requests a GPU (the engine's request places the pod)")

        def user(container):
            return container.get("securityContext", {}).get("runAsUser",
                                                            pod_security.get("runAsUser"))
        for engine in engines:
            if user(engine) != user(laproxd):
                self.fail(where, f"container {engine['name']} runs as user {user(engine)}, "
                          f"laproxd as {user(laproxd)}: shared memory is created with mode 0600")

        image = laproxd.get("image", "")
        env = {e["name"]: e.get("value") for e in laproxd.get("env", [])}
        if image.endswith(":cuda"):
            if spec.get("runtimeClassName") != "nvidia":
                self.fail(where, "laprox:cuda without runtimeClassName nvidia")
            if env.get("NVIDIA_VISIBLE_DEVICES") is None:
                self.fail(where, "laprox:cuda without NVIDIA_VISIBLE_DEVICES")
        elif not image.endswith(":cpu"):
            self.fail(where, f"laproxd image {image!r} is neither laprox:cpu nor laprox:cuda")

    def check_monitoring(self, path, objects, pods):
        monitors = [o for o in objects if o.get("kind") == "PodMonitor"]
        if not monitors:
            self.fail(path, "no PodMonitor")
        for monitor in monitors:
            wanted = monitor.get("spec", {}).get("selector", {}).get("matchLabels", {})
            matched = [w for w, t in pods
                       if wanted.items() <= t.get("metadata", {}).get("labels", {}).items()]
            if not matched:
                self.fail(path, f"PodMonitor {monitor['metadata']['name']} selects no laproxd pod "
                          f"({wanted})")
        dashboards = [o for o in objects if o.get("kind") == "ConfigMap" and
                      o.get("metadata", {}).get("labels", {}).get("grafana_dashboard") == "1"]
        if len(dashboards) != 1:
            self.fail(path, f"{len(dashboards)} ConfigMaps labelled grafana_dashboard: \"1\", "
                      "not 1")
        for dashboard in dashboards:
            for key, text in dashboard.get("data", {}).items():
                try:
                    json.loads(text)
                except ValueError as error:
                    self.fail(path, f"dashboard {key} is not JSON: {error}")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: check_rendered.py RENDERED.yaml...")
    checker = Checker()
    for path in sys.argv[1:]:
        checker.check_file(path)
    if checker.problems:
        print("\n".join(f"check_rendered: FAIL {p}" for p in checker.problems), file=sys.stderr)
        return 1
    print(f"check_rendered: {len(sys.argv) - 1} rendered files ok (PodMonitor against "
          "check_rendered.py's schema, wiring of every laproxd pod)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
