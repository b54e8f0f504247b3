"""Static checks of the deployment kit: examples/collector (OpenTelemetry Collector agent and
gateway), examples/compose and examples/kubernetes.

What validates what (nothing here runs a collector, Docker or Kubernetes - none runs on this
machine kind; tests/test_fleet_pipeline.py runs the parts that do):

* YAML: ``yamllint`` over the three folders;
* Kubernetes manifests: the Kubernetes OpenAPI JSON schemas shipped in the ``kubernetes-validate``
  package, strict (unknown fields are errors), for two Kubernetes versions;
* compose file: the Compose Specification JSON schema vendored in the ``check-jsonschema``
  package (``--builtin-schema vendor.compose-spec``), run as its CLI;
* Prometheus configurations (compose, and the one in the Kubernetes ConfigMap): ``promtool check
  config`` (Debian's prometheus package);
* collector configurations: their wiring (every pipeline component defined, every defined one
  used), every attribute, span name and enum value they reference declared in semconv/, and the
  tail-sampling thresholds equal to the replicas' LLM_OTEL_TIERS / LLM_OTEL_OUTLIER_* in the
  Kubernetes Deployment.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from support import tools
from test_ops_live import _require  # promtool: skip here, fail in CI when missing

from llm_otel._semconv_registry import load_registry
from llm_otel.config.tiers import TierTable

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
COLLECTOR = EXAMPLES / "collector"
COMPOSE_DIR = EXAMPLES / "compose"
K8S = EXAMPLES / "kubernetes"
BIN = pathlib.Path(sys.executable).parent
YAMLLINT_CONFIG = (
    "{extends: default, rules: {line-length: {max: 160}, document-start: disable, truthy: {check-keys: false}}}"
)
K8S_VERSIONS = ("1.30.0", "1.33.0")


def _load(path: pathlib.Path) -> dict:
    return yaml.safe_load(path.read_text())


def _k8s_documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def _find(docs, kind: str, name: str) -> dict:
    (doc,) = [d for _, d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


# --- YAML and schemas ---------------------------------------------------------------------------
def test_yamllint_passes_on_every_deployment_file():
    done = subprocess.run(
        [str(BIN / "yamllint"), "-f", "parsable", "-d", YAMLLINT_CONFIG, str(COLLECTOR), str(COMPOSE_DIR), str(K8S)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_yamllint_is_live(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\n")  # duplicate key
    done = subprocess.run([str(BIN / "yamllint"), "-d", YAMLLINT_CONFIG, str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "duplication" in done.stdout


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_match_the_kubernetes_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _k8s_documents()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "DaemonSet", "Service", "ConfigMap", "Namespace"}
    namespaces = {d["metadata"]["name"] for _, d in docs if d["kind"] == "Namespace"}
    assert {d["metadata"]["namespace"] for _, d in docs if d["kind"] != "Namespace"} <= namespaces
    for where, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} (Kubernetes {version}): {exc.message} at {list(exc.path)}")


def test_kubernetes_schema_check_rejects_an_unknown_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    service = _find(_k8s_documents(), "Service", "otel-gateway-headless")
    broken = {**service, "spec": {**service["spec"], "clusterIp": "None"}}  # typo of clusterIP
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def _compose_check(path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )


def test_compose_file_matches_the_compose_specification(tmp_path):
    tools.require("check-jsonschema", (BIN / "check-jsonschema").exists(), "pip install -e '.[test]'")
    done = _compose_check(COMPOSE_DIR / "compose.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "compose.yaml"  # a misspelt service key must be rejected
    broken.write_text(
        (COMPOSE_DIR / "compose.yaml").read_text().replace("    image: jaegertracing", "    imag: jaegertracing")
    )
    done = _compose_check(broken)
    assert done.returncode != 0 and "'imag' was unexpected" in done.stdout


def test_compose_mounts_exist_and_grafana_loads_the_shipped_dashboards():
    compose = _load(COMPOSE_DIR / "compose.yaml")
    mounts = {}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert (COMPOSE_DIR / source).exists(), f"{name}: mounts missing {source}"
            mounts[target] = (COMPOSE_DIR / source).resolve()
    provider = _load(EXAMPLES / "grafana" / "provisioning" / "dashboards" / "llm-otel.yml")["providers"][0]
    assert mounts[provider["options"]["path"]] == (EXAMPLES / "grafana" / "dashboards").resolve()
    assert list((EXAMPLES / "grafana" / "dashboards").glob("*.json"))
    sources = _load(COMPOSE_DIR / "grafana-datasources.yml")["datasources"]
    uids = {s["uid"] for s in sources}
    prometheus = next(s for s in sources if s["type"] == "prometheus")
    for dest in prometheus["jsonData"]["exemplarTraceIdDestinations"]:
        assert dest["datasourceUid"] in uids and dest["name"] == "trace_id"  # llm-otel's exemplar label
    # the collectors run the shipped configurations
    assert mounts["/etc/otelcol/config.yaml"] in {
        (COLLECTOR / "agent.yaml").resolve(),
        (COLLECTOR / "gateway.yaml").resolve(),
    }
    assert compose["services"]["agent"]["environment"]["GATEWAY_HOSTNAME"] in compose["services"]


def _promtool_check(config: dict, rules_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    promtool = _require("promtool")
    config = dict(config)
    rules = config.get("rule_files", [])
    for pattern in rules:  # the rules files the configuration names, from examples/prometheus
        for rules_file in (EXAMPLES / "prometheus").glob(pathlib.PurePath(pattern).name):
            shutil.copy(rules_file, rules_dir / rules_file.name)
    config["rule_files"] = [str(rules_dir / pathlib.PurePath(p).name) for p in rules]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr and "0 rules found" not in done.stdout


def test_compose_prometheus_configuration_passes_promtool(tmp_path):
    _promtool_check(_load(COMPOSE_DIR / "prometheus.yml"), tmp_path, tmp_path)


def test_kubernetes_prometheus_configuration_passes_promtool(tmp_path):
    """Debian's Prometheus is built without Kubernetes service discovery (promtool rejects
    ``kubernetes_sd_configs`` as an unknown field), so the discovery block is swapped for a file
    discovery before promtool checks the rest (relabelling regexes, rules, globals); the block
    itself is checked here for its documented shape only."""
    config_map = _find(_k8s_documents(), "ConfigMap", "prometheus-llm-otel")
    config = yaml.safe_load(config_map["data"]["prometheus.yml"])
    for job in config["scrape_configs"]:
        (sd,) = job.pop("kubernetes_sd_configs")
        assert sd == {"role": "pod"}  # relabelling reads __meta_kubernetes_pod_* labels
        assert all(
            label.startswith(("__meta_kubernetes_pod_", "__meta_kubernetes_namespace"))
            for rule in job["relabel_configs"]
            for label in rule["source_labels"]
        )
        (tmp_path / "targets.yml").write_text("[]\n")
        job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.yml")]}]
    _promtool_check(config, tmp_path, tmp_path)


# --- collector configurations -------------------------------------------------------------------
CONFIGS = {"agent": COLLECTOR / "agent.yaml", "gateway": COLLECTOR / "gateway.yaml"}


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_collector_pipelines_use_only_defined_components_and_every_component_is_used(which):
    config = _load(CONFIGS[which])
    used = {"receivers": set(), "processors": set(), "exporters": set(), "connectors": set()}
    connectors = set(config.get("connectors") or {})
    as_exporter, as_receiver = set(), set()
    for name, pipeline in config["service"]["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                if section != "processors" and component in connectors:
                    (as_exporter if section == "exporters" else as_receiver).add(component)
                    used["connectors"].add(component)
                    continue
                assert component in (config.get(section) or {}), f"{which}: pipeline {name} uses undefined {component}"
                used[section].add(component)
    for section, names in used.items():
        assert set(config.get(section) or {}) == names, f"{which}: {section} defined but unused"
    assert as_exporter == as_receiver == connectors, f"{which}: a connector must feed one pipeline from another"
    assert set(config["service"].get("extensions", [])) == set(config.get("extensions") or {})


_ATTR = re.compile(r'(?:resource\.)?attributes\["([^"]+)"\]')
_ATTR_EQ = re.compile(r'attributes\["([^"]+)"\]\s*(?:==|!=)\s*"([^"]*)"')
_ATTR_CMP = re.compile(r'attributes\["([^"]+)"\]\s*[<>]=?\s*(-?[0-9.]+)')
_SPAN_NAME = re.compile(r'\bname\s*==\s*"([^"]+)"')


def _policies(policies: list[dict]):
    """Every tail-sampling policy, sub-policies of and/composite/not/drop included."""
    for policy in policies:
        yield policy
        for key, sub in (("and", "and_sub_policy"), ("composite", "composite_sub_policy"), ("drop", "drop_sub_policy")):
            yield from _policies((policy.get(key) or {}).get(sub, []))
        if policy.get("not"):
            yield from _policies([policy["not"]["not_sub_policy"]])


def collector_references(config: dict) -> dict[str, set]:
    """Names a collector configuration references: ``attributes`` (span or resource),
    ``span_names``, ``values`` ((attribute, string value) compared or matched), ``numeric``
    (attributes compared with a number). OTTL conditions of filter processors and tail-sampling
    policies, tail-sampling attribute policies, span-metrics dimensions and resource keys,
    resource-processor keys."""
    refs = {"attributes": set(), "span_names": set(), "values": set(), "numeric": set()}
    conditions: list[str] = []
    for name, processor in (config.get("processors") or {}).items():
        processor = processor or {}
        if name.split("/")[0] == "filter":
            for signal in processor.values():
                if isinstance(signal, dict):
                    for items in signal.values():
                        conditions.extend(items)
        if name.split("/")[0] == "resource":
            refs["attributes"].update(a["key"] for a in processor.get("attributes", []))
        if name.split("/")[0] == "tail_sampling":
            for policy in _policies(processor.get("policies", [])):
                if policy["type"] == "ottl_condition":
                    for items in (
                        policy["ottl_condition"].get("span", []),
                        policy["ottl_condition"].get("spanevent", []),
                    ):
                        conditions.extend(items)
                elif policy["type"] in ("string_attribute", "numeric_attribute", "boolean_attribute"):
                    spec = policy[policy["type"]]
                    refs["attributes"].add(spec["key"])
                    if policy["type"] == "string_attribute":
                        refs["values"].update((spec["key"], v) for v in spec.get("values", []))
                    elif policy["type"] == "numeric_attribute":
                        refs["numeric"].add(spec["key"])
    for name, connector in (config.get("connectors") or {}).items():
        if name.split("/")[0] == "spanmetrics":
            refs["attributes"].update(d["name"] for d in connector.get("dimensions", []))
            refs["attributes"].update(connector.get("resource_metrics_key_attributes", []))
    for condition in conditions:
        refs["attributes"].update(_ATTR.findall(condition))
        refs["span_names"].update(_SPAN_NAME.findall(condition))
        refs["values"].update(_ATTR_EQ.findall(condition))
        refs["numeric"].update(key for key, _ in _ATTR_CMP.findall(condition))
    return refs


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_collector_configuration_references_only_names_declared_in_semconv(which):
    reg = load_registry()
    refs = collector_references(_load(CONFIGS[which]))
    undeclared = sorted(refs["attributes"] - set(reg.attributes))
    assert not undeclared, f"{which}: attributes not declared in semconv/: {undeclared}"
    unknown_spans = sorted(refs["span_names"] - set(reg.span_names()))
    assert not unknown_spans, f"{which}: span names not declared in semconv/: {unknown_spans}"
    for key, value in sorted(refs["values"]):
        attr = reg.attributes[key]
        if attr.members is not None:
            assert value in {m["value"] for m in attr.members}, f"{which}: {key} has no member {value!r}"
        else:
            assert attr.type == "string", f"{which}: {key} is {attr.type}, compared with a string"
    for key in sorted(refs["numeric"]):
        assert reg.attributes[key].type in ("int", "double"), f"{which}: {key} is not numeric"


def test_reference_extraction_sees_what_the_configurations_use():
    """The check above is not vacuous: the names the kit is built on are found."""
    agent = collector_references(_load(CONFIGS["agent"]))
    gateway = collector_references(_load(CONFIGS["gateway"]))
    assert ("llm.sampling.reason", "outlier") in agent["values"] and "llm.engine.step" in agent["span_names"]
    assert {"llm.request.tier", "gen_ai.request.model", "service.name", "deployment.environment.name"} <= agent[
        "attributes"
    ]
    assert {("llm.sampling.reason", "outlier"), ("llm.sampling.reason", "drift_boost")} <= gateway["values"]
    assert {"llm.time_to_first_token", "llm.inter_token_latency.p99"} <= gateway["numeric"]
    assert {"llm.engine.step", "llm.token_stream"} <= gateway["span_names"]
    # and it catches a name that is not declared
    broken = collector_references({"processors": {"filter/x": {"traces": {"span": ['attributes["llm.ttft"] > 1']}}}})
    assert broken["attributes"] - set(load_registry().attributes) == {"llm.ttft"}


def _ttft_thresholds(gateway: dict) -> dict[str, float]:
    policy = next(
        p for p in _policies(gateway["processors"]["tail_sampling"]["policies"]) if p["name"] == "ttft-over-tier-target"
    )
    out = {}
    for condition in policy["ottl_condition"]["span"]:
        tier = re.search(r'attributes\["llm.request.tier"\] == "([^"]+)"', condition).group(1)
        out[tier] = float(re.search(r'attributes\["llm.time_to_first_token"\] > ([0-9.]+)', condition).group(1))
    return out


def _itl_thresholds(gateway: dict) -> dict[str, float]:
    out = {}
    for policy in gateway["processors"]["tail_sampling"]["policies"]:
        if not policy["name"].startswith("itl-stall-"):
            continue
        tier_policy, itl_policy = policy["and"]["and_sub_policy"]
        (tier,) = tier_policy["string_attribute"]["values"]
        (condition,) = itl_policy["ottl_condition"]["span"]
        out[tier] = float(re.search(r'attributes\["llm.inter_token_latency.p99"\] > ([0-9.]+)', condition).group(1))
    return out


def test_tail_sampling_thresholds_equal_the_replicas_tiers_and_outlier_capture():
    """LLM_OTEL_OUTLIER_* and LLM_OTEL_TIERS of the vLLM Deployment against the gateway's policies
    (docs/deploy.md, "Head + tail sampling")."""
    deployment = _find(_k8s_documents(), "Deployment", "vllm")
    env = _env(deployment["spec"]["template"]["spec"]["containers"][0])
    table = TierTable.from_env({"LLM_OTEL_TIERS": env["LLM_OTEL_TIERS"]})
    targets = {tier.name: tier.targets for tier in table.tiers}
    gateway = _load(CONFIGS["gateway"])
    ttft = _ttft_thresholds(gateway)
    assert ttft == {name: t["ttft"] for name, t in targets.items()}
    assert float(env["LLM_OTEL_OUTLIER_TTFT_S"]) == min(ttft.values())
    assert _itl_thresholds(gateway) == {name: 2 * t["tpot"] for name, t in targets.items()}
    (slow,) = [p for p in gateway["processors"]["tail_sampling"]["policies"] if p["type"] == "latency"]
    assert slow["latency"]["threshold_ms"] == float(env["LLM_OTEL_OUTLIER_E2E_S"]) * 1000
    # the classes the tiers match on come from headers the replicas read
    assert "priority:" in env["LLM_OTEL_CLASS_HEADERS"]


def test_agents_route_to_every_gateway_pod_through_the_headless_service():
    docs = _k8s_documents()
    agent = _find(docs, "DaemonSet", "otel-agent")["spec"]["template"]["spec"]["containers"][0]
    service = _find(docs, "Service", "otel-gateway-headless")
    gateway = _find(docs, "Deployment", "otel-gateway")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert _env(agent)["GATEWAY_HOSTNAME"] == host
    resolver = _load(CONFIGS["agent"])["exporters"]["loadbalancing"]["resolver"]["dns"]
    assert int(resolver["port"]) == service["spec"]["ports"][0]["port"] == 4317
    assert "${env:GATEWAY_HOSTNAME" in resolver["hostname"]
    # replicas send to the agent on their node, and Prometheus finds their llm-otel ports
    vllm = _find(docs, "Deployment", "vllm")["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in vllm["spec"]["containers"][0]["ports"]}
    venv = _env(vllm["spec"]["containers"][0])
    assert (
        ports["otel-frontend"] == int(venv["OTEL_EXPORTER_PROMETHEUS_PORT"])
        and ports["otel-engine"] == ports["otel-frontend"] + 1
    )
    assert venv["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].endswith(":4317")
    assert {"containerPort": 4317, "hostPort": 4317}.items() <= next(
        p for p in agent["ports"] if p["name"] == "otlp-grpc"
    ).items()
    assert vllm["metadata"]["labels"]["llm-otel.dev/scrape"] == "true"
