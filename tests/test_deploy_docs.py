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


def kubernetes() -> list[dict[str, Any]]:
    (docs,) = [b for b in yaml_blocks() if all(isinstance(d, dict) and "kind" in d for d in b)]
    return docs


def compose() -> dict[str, Any]:
    (doc,) = [d for b in yaml_blocks() for d in b if isinstance(d, dict) and "services" in d]
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


@pytest.mark.parametrize("section", ["## The one flag", "## Data parallel", "## Grafana", "### Kubernetes"])
def test_sections_exist(section: str) -> None:
    assert section in DEPLOY.read_text()
