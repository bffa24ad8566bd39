"""deploy/kubernetes/: every object validates against its schema (built-in kinds against the
Kubernetes OpenAPI schemas kubernetes-validate ships, strict: unknown fields fail; the
InferencePool, HTTPRoute, endpoint-picker and metrics-adapter configs against the schemas in
deploy/kubernetes/schemas/, written from their published CRDs and docs), the objects agree with
each other (selectors, ports, names), and every metric they name is one our server exports."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inferlab.engine.outputs import SchedulerStats
from inferlab.server.metrics import ServerMetrics

DIR = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"
SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}


def schema(name: str) -> dict:
    return json.loads((DIR / "schemas" / name).read_text())


def objects() -> list[dict]:
    docs = []
    for path in sorted(DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def validate(obj: dict) -> None:
    """Raise on an invalid object (kubernetes_validate.ValidationError or jsonschema's)."""
    custom = SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if custom is not None:
        jsonschema.Draft202012Validator(schema(custom)).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    if obj.get("kind") == "ConfigMap":  # the configs inside, each against its own schema
        for key, text in obj.get("data", {}).items():
            inner = yaml.safe_load(text)
            if key == "epp-config.yaml":
                jsonschema.Draft202012Validator(schema("endpointpickerconfig-v1alpha1.json")).validate(inner)
            elif obj["metadata"]["name"].startswith("prometheus-adapter"):
                jsonschema.Draft202012Validator(schema("prometheus-adapter-config.json")).validate(inner)


def test_every_manifest_validates():
    kinds = sorted(o["kind"] for o in objects())
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "InferencePool", "HTTPRoute", "ConfigMap"} <= set(kinds)
    for obj in objects():
        validate(obj)


def _set(obj: dict, path: str, value) -> dict:
    obj = copy.deepcopy(obj)
    *head, last = path.split(".")
    node = obj
    for k in head:
        node = node[int(k)] if k.isdigit() else node[k]
    node[int(last) if last.isdigit() else last] = value
    return obj


@pytest.mark.parametrize("kind,name,path,value", [
    ("Deployment", "inferlab", "spec.replicas", "two"),
    ("Deployment", "inferlab", "spec.template.spec.containers.0.ports.0.containerPort", "8000/tcp"),
    ("Deployment", "inferlab", "spec.template.spec.containers.0.readinessProbe.httpGet.pth", "/health"),  # typo'd field
    ("Service", "inferlab", "spec.ports.0.port", "http"),
    ("HorizontalPodAutoscaler", "inferlab", "spec.metrics.0.pods.metric", {"metricName": "x"}),
    ("HorizontalPodAutoscaler", "inferlab", "spec.minReplicas", "one"),
    ("InferencePool", "inferlab", "spec.targetPorts", []),
    ("InferencePool", "inferlab", "spec.endpointPickerRef.failureMode", "Sometimes"),
    ("InferencePool", "inferlab", "spec.extensionRef", {"name": "inferlab-epp"}),  # the pre-v1 field
    ("HTTPRoute", "inferlab", "spec.rules.0.timeouts.request", "five minutes"),
])  # fmt: skip
def test_a_broken_manifest_fails(kind, name, path, value):
    (obj,) = by_kind(kind, name)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(_set(obj, path, value))


def test_a_pool_without_its_picker_port_fails():
    (pool,) = by_kind("InferencePool")
    broken = copy.deepcopy(pool)
    del broken["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_a_broken_epp_config_fails():
    (cm,) = by_kind("ConfigMap", "inferlab-epp-config")
    cfg = yaml.safe_load(cm["data"]["epp-config.yaml"])
    cfg["schedulingProfiles"][0]["plugins"][0] = {"plugin": "queue-scorer"}
    with pytest.raises(jsonschema.ValidationError):
        validate({**cm, "data": {"epp-config.yaml": yaml.safe_dump(cfg)}})


def test_the_objects_point_at_each_other():
    (dep,) = by_kind("Deployment", "inferlab")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (svc,) = by_kind("Service", "inferlab")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    (pool,) = by_kind("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == ports["http"] and ann["prometheus.io/path"] == "/metrics"
    assert "--metrics-public" in container["args"]  # the picker and Prometheus carry no API key
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inferlab"}
    # the picker: the Service the pool names, on the port it names, running for this pool
    ref = pool["spec"]["endpointPickerRef"]
    (epp_svc,) = by_kind("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    (epp,) = by_kind("Deployment", ref["name"])
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    (route,) = by_kind("HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    # every plugin a profile refers to is declared
    (cm,) = by_kind("ConfigMap", "inferlab-epp-config")
    cfg = yaml.safe_load(cm["data"]["epp-config.yaml"])
    declared = {p.get("name", p["type"]) for p in cfg["plugins"]}
    assert {r["pluginRef"] for prof in cfg["schedulingProfiles"] for r in prof["plugins"]} <= declared


def exported_metrics() -> str:
    class Engine:
        model_name = "m"
        max_model_len = 64
        speculative_config = None

        def get_stats(self):
            return SchedulerStats()

    m = ServerMetrics()
    m.on_ready(Engine())
    return m.render().decode()


def test_every_metric_named_is_one_we_export():
    text = exported_metrics()
    gauges = set(re.findall(r"^# TYPE (\S+) gauge$", text, re.M))
    named: set[str] = set()
    (epp,) = by_kind("Deployment", "inferlab-epp")
    for arg in epp["spec"]["template"]["spec"]["containers"][0]["args"]:
        m = re.fullmatch(r"--[a-z-]+-metric=(.*)", arg)
        if m and m.group(1):
            named.add(m.group(1))
    (adapter,) = by_kind("ConfigMap", "prometheus-adapter-inferlab")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    adapter_series = {re.match(r"[^{]+", r["seriesQuery"].strip("'\"")).group(0) for r in rules}
    named |= adapter_series
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= named
    assert named <= gauges, f"not exported as gauges: {sorted(named - gauges)}"
    assert re.search(r'^vllm:cache_config_info\{.*block_size="\d+"', text, re.M)  # the picker's optional BlockSize
    # the HPA's metric is the adapter's name for vllm:num_requests_waiting
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    wanted = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    served = {r["name"]["as"]: re.match(r"[^{]+", r["seriesQuery"].strip("'\"")).group(0) for r in rules}
    assert served[wanted] == "vllm:num_requests_waiting"
