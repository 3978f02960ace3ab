"""docs/DEPLOY.md's examples are complete and consistent, read by a YAML parser (PyYAML).

A user copies these files as they are: every object parses, every selector finds its
pods, every port named in a router flag, a probe or a scrape target is one a container
listens on, and the middleware's import path is the class that exists.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest
import yaml

from tests.servers import ROOT

DEPLOY = ROOT / "docs" / "DEPLOY.md"
README = ROOT / "README.md"
MIDDLEWARE = "proxy.vllm_middleware.CachetallyMiddleware"


def yaml_blocks() -> list[list[Any]]:
    text = DEPLOY.read_text()
    return [list(yaml.safe_load_all(b)) for b in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)]


def kubernetes(deployment: str = "vllm") -> list[dict[str, Any]]:
    """The Kubernetes example that deploys ``deployment`` (the fleet's, or P/D's ``vllm-prefill``)."""
    (docs,) = [
        b for b in yaml_blocks()
        if all(isinstance(d, dict) and "kind" in d for d in b)
        and any(d["kind"] == "Deployment" and d["metadata"]["name"] == deployment for d in b)
    ]
    return docs


def compose(service: str = "vllm-1") -> dict[str, Any]:
    """The compose example with ``service`` (the fleet's, or P/D's ``prefill``)."""
    (doc,) = [d for b in yaml_blocks() for d in b if isinstance(d, dict) and service in d.get("services", {})]
    return doc


def flag(args: list[str], name: str) -> list[str]:
    """The values after ``name`` up to the next flag."""
    at = args.index(name) + 1
    values = []
    while at < len(args) and not str(args[at]).startswith("--"):
        values.append(str(args[at]))
        at += 1
    return values


def test_the_middleware_path_in_the_docs_is_the_class() -> None:
    module, _, name = MIDDLEWARE.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))
    for path in (DEPLOY, README):  # the line a user copies
        assert re.search(rf"^vllm serve \S+ .*--middleware {re.escape(MIDDLEWARE)}\b", path.read_text(), re.M), path


def test_kubernetes_objects_are_complete_and_consistent() -> None:
    objects = kubernetes()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        assert obj["apiVersion"] and obj["metadata"]["name"], obj
        by_kind.setdefault(obj["kind"], []).append(obj)
    assert {"Deployment", "Service", "PodMonitor", "Role", "RoleBinding", "ServiceAccount"} <= set(by_kind)

    ports: dict[str, dict[str, int]] = {}  # app label -> port name -> container port
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    for name, deployment in deployments.items():
        spec = deployment["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        named = {p["name"]: p["containerPort"] for c in spec["template"]["spec"]["containers"] for p in c["ports"]}
        ports[labels["app"]] = named
        for container in spec["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "startupProbe"):
                if probe in container:
                    assert container[probe]["httpGet"]["port"] in named, (name, probe)
            args = [str(a) for a in container["args"]]
            assert flag(args, "--port") == [str(named["http"])], name

    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        declared = {v["name"] for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= declared

    vllm = deployments["vllm"]["spec"]
    assert vllm["replicas"] >= 2
    vllm_args = vllm["template"]["spec"]["containers"][0]["args"]
    assert flag(vllm_args, "--middleware") == [MIDDLEWARE]
    annotations = vllm["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["vllm"]["http"]

    for service in by_kind["Service"]:
        app = service["spec"]["selector"]["app"]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports[app], service["metadata"]["name"]

    router = deployments["vllm-router"]["spec"]["template"]["spec"]
    router_args = [str(a) for a in router["containers"][0]["args"]]
    assert flag(router_args, "--policy") == ["cache_aware"]
    assert "--disable-retries" in router_args, "a retry on another replica is a second billed request"
    assert flag(router_args, "--selector") == [f"app={vllm['selector']['matchLabels']['app']}"]
    assert flag(router_args, "--service-discovery-port") == [str(ports["vllm"]["http"])]
    assert flag(router_args, "--prometheus-port") == [str(ports["vllm-router"]["metrics"])]
    (binding,) = by_kind["RoleBinding"]
    assert binding["subjects"][0]["name"] == router["serviceAccountName"]
    assert binding["roleRef"]["name"] == by_kind["Role"][0]["metadata"]["name"]
    assert {"list", "watch"} <= set(by_kind["Role"][0]["rules"][0]["verbs"])

    (monitor,) = by_kind["PodMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"] == vllm["selector"]["matchLabels"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports["vllm"]


def test_compose_services_ports_and_scrape_targets_agree() -> None:
    doc = compose()
    services = doc["services"]
    replicas = {name: s for name, s in services.items() if MIDDLEWARE in map(str, s.get("command", []))}
    assert len(replicas) >= 2, "N replicas, each with the middleware"
    replica_ports = {name: int(flag(s["command"], "--port")[0]) for name, s in replicas.items()}

    router = services["router"]
    urls = flag(router["command"], "--worker-urls")
    assert sorted(urls) == sorted(f"http://{n}:{p}" for n, p in replica_ports.items())
    assert flag(router["command"], "--policy") == ["cache_aware"]
    assert "--disable-retries" in router["command"], "a retry on another replica is a second billed request"
    assert set(router["depends_on"]) == set(replicas)
    router_port = flag(router["command"], "--port")[0]
    assert any(str(p).endswith(f":{router_port}") for p in router["ports"])

    prometheus = services["prometheus"]
    (config_ref,) = prometheus["configs"]
    assert prometheus["command"] == [f"--config.file={config_ref['target']}"]
    config = yaml.safe_load(doc["configs"][config_ref["source"]]["content"])
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert sorted(targets["vllm"]) == sorted(f"{n}:{p}" for n, p in replica_ports.items())
    assert targets["vllm-router"] == [f"router:{flag(router['command'], '--prometheus-port')[0]}"]

    for name, replica in replicas.items():
        assert f"127.0.0.1:{replica_ports[name]}/health" in " ".join(replica["healthcheck"]["test"])
    devices = [tuple(s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) for s in replicas.values()]
    assert len(set(devices)) == len(devices), "one GPU per replica"
    for volume in (v.split(":")[0] for s in services.values() for v in s.get("volumes", [])):
        assert volume in doc.get("volumes", {}), volume


def test_the_pd_examples_pair_a_prefill_and_a_decode_instance_with_pd_legs_on_both() -> None:
    """Both examples: the middleware and CACHETALLY_PD_LEGS on each instance, NIXL's producer
    on prefill and consumer on decode, each advertising its own address for the transfer,
    and the router in P/D mode pointing at exactly those."""
    import json

    def check(args: list[str], env: dict[str, Any], role: str) -> None:
        assert flag(args, "--middleware") == [MIDDLEWARE]
        config = json.loads(flag(args, "--kv-transfer-config")[0])
        assert config == {"kv_connector": "NixlConnector", "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role]}
        assert env["CACHETALLY_PD_LEGS"] == "true"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]

    services = compose("prefill")["services"]
    for role in ("prefill", "decode"):
        check(services[role]["command"], services[role]["environment"], role)
        assert services[role]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == role  # its compose name
    router = services["router"]["command"]
    assert "--vllm-pd-disaggregation" in router
    for role in ("prefill", "decode"):
        assert flag(router, f"--{role}") == [f"http://{role}:{flag(services[role]['command'], '--port')[0]}"]
    config = yaml.safe_load(compose("prefill")["configs"]["prometheus"]["content"])
    (vllm_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "vllm"]
    assert sorted(vllm_job["static_configs"][0]["targets"]) == ["decode:8000", "prefill:8000"]

    objects = kubernetes("vllm-prefill")
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    router_args = [str(a) for a in deployments["vllm-pd-router"]["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert "--vllm-pd-disaggregation" in router_args
    for role in ("prefill", "decode"):
        spec = deployments[f"vllm-{role}"]["spec"]
        (container,) = spec["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        check([str(a) for a in container["args"]], env, role)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["nixl"] == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert flag(router_args, f"--{role}-selector") == [f"app={spec['selector']['matchLabels']['app']}"]
        assert flag(router_args, "--service-discovery-port") == [str(ports["http"])]
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["name"] == deployments["vllm-pd-router"]["spec"]["template"]["spec"]["serviceAccountName"]


@pytest.mark.parametrize("section", ["## The one flag", "## Data parallel", "## Grafana", "### Kubernetes",
                                     "## Disaggregated prefill and decode"])
def test_sections_exist(section: str) -> None:
    assert section in DEPLOY.read_text()
