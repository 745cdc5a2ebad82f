"""The deploy files as shipped: the Kubernetes manifests valid against the API's schema and consistent with one another
and with the server (flags the real parser takes, probe paths a real server answers, a grace period the drain fits
in, selectors that select, a state-store URL that names the Redis Service), and nginx.conf accepted by `nginx -t`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from server.__main__ import build_parser
from server.server import ABORT_GRACE_S
from server.worker.engine_client import DEFAULT_SHUTDOWN_TIMEOUT_S

from helpers.nginx_proxy import SHIPPED_CONFIG, nginx_command
from helpers.running_server import start_server, stop_server

K8S_DIR = Path(__file__).resolve().parent.parent / "tools" / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests are for (preStop's sleep action is on from 1.30)
MIN_STARTUP_BUDGET_S = 600  # a large checkpoint's load takes minutes
MARGIN_S = 3  # what the grace period leaves beyond the drain and the worker's stop
GPU = "nvidia.com/gpu"


def load(file_name: str) -> list[dict]:
    with open(K8S_DIR / file_name) as file:
        return [doc for doc in yaml.safe_load_all(file) if doc]


def find(file_name: str, kind: str) -> dict:
    docs = [doc for doc in load(file_name) if doc["kind"] == kind]
    assert len(docs) == 1, f"expected one {kind} in {file_name}, found {len(docs)}"
    return docs[0]


def pagedserve_container() -> dict:
    containers = find("deployment.yaml", "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["pagedserve"], containers
    return containers[0]


def parse_container_args(capsys) -> object:
    """The pagedserve container's args through the server's own argument parser."""
    args = pagedserve_container()["args"]
    assert all(isinstance(arg, str) for arg in args), f"every arg must be a string (quote numbers), got {args}"
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"pagedserve rejects the Deployment's args {args}: {capsys.readouterr().err}")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def port_named(container: dict, name: str) -> dict:
    ports = [port for port in container["ports"] if port["name"] == name]
    assert len(ports) == 1, f"expected one container port named {name!r}, got {container['ports']}"
    return ports[0]


# ---------------------------------------------------------------------------------------------- the schema


@pytest.mark.parametrize("file_name", sorted(path.name for path in K8S_DIR.glob("*.yaml")))
def test_manifest_is_valid_against_the_kubernetes_schema(file_name):
    docs = load(file_name)
    assert docs, f"{file_name} holds no manifest"
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_schema_check_catches_a_misspelt_field():
    deployment = find("deployment.yaml", "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_manifests_hold_every_part_of_the_deployment():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for path in K8S_DIR.glob("*.yaml") for doc in load(path.name)}
    assert {("Deployment", "pagedserve"), ("Service", "pagedserve"), ("PodDisruptionBudget", "pagedserve"),
            ("StatefulSet", "pagedserve-redis"), ("Service", "pagedserve-redis")} <= kinds


# ---------------------------------------------------------------------------------------------- the server's side


def test_container_args_are_flags_pagedserve_takes(capsys):
    args = parse_container_args(capsys)
    assert args.host == "0.0.0.0", "a pod must listen on its own address, not only on loopback"
    assert port_named(pagedserve_container(), "http")["containerPort"] == args.port
    assert find("deployment.yaml", "Deployment")["spec"]["replicas"] >= 2


def test_probes_use_health_for_readiness_and_livez_for_liveness(capsys):
    container, args = pagedserve_container(), parse_container_args(capsys)
    probes = {name: container[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {name: probe["path"] for name, probe in probes.items()} == {
        "startupProbe": "/health", "readinessProbe": "/health", "livenessProbe": "/livez"}
    assert all(probe["port"] == "http" for probe in probes.values()), probes
    startup = container["startupProbe"]
    budget = startup["failureThreshold"] * startup["periodSeconds"]
    assert budget >= MIN_STARTUP_BUDGET_S, f"the startup probe allows {budget} s for the model load"
    assert budget >= args.worker_start_timeout, (
        f"the startup probe gives up after {budget} s, before the server's own --worker-start-timeout "
        f"{args.worker_start_timeout:g} s")


def test_probe_paths_answer_on_a_real_server(tmp_path):
    container = pagedserve_container()
    paths = {container[name]["httpGet"]["path"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    server = start_server(tmp_path, None, "--device", "cpu", "--num-kv-blocks", "64")
    try:
        assert {path: server.get(path)[0] for path in sorted(paths)} == {path: 200 for path in sorted(paths)}
    finally:
        stop_server(server)


def test_the_grace_period_covers_pre_stop_the_drain_and_the_worker_stop(capsys):
    pod = find("deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    args = parse_container_args(capsys)
    pre_stop_s = pagedserve_container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop_s >= 5, "endpoint removal needs a few seconds to reach every proxy before SIGTERM"
    needed = pre_stop_s + args.shutdown_timeout + ABORT_GRACE_S + DEFAULT_SHUTDOWN_TIMEOUT_S + MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed, (
        f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} must cover preStop {pre_stop_s} s + "
        f"--shutdown-timeout {args.shutdown_timeout:g} s + the worker's stop + a margin: {needed:g} s")


def test_each_replica_asks_for_one_gpu():
    resources = pagedserve_container()["resources"]
    assert resources["limits"][GPU] == 1 and resources["requests"].get(GPU, 1) == 1, resources


# ---------------------------------------------------------------------------------------------- labels and names


def test_selectors_select_the_pagedserve_pods():
    deployment = find("deployment.yaml", "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    service = find("service.yaml", "Service")
    assert selects(service["spec"]["selector"], pod_labels), "the Service must route to the pagedserve pods"
    assert service["spec"]["type"] == "ClusterIP"
    for port in service["spec"]["ports"]:
        port_named(pagedserve_container(), port["targetPort"])
    assert selects(find("pdb.yaml", "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    anti_affinity = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    terms = [term.get("podAffinityTerm", term) for rule in anti_affinity.values() for term in rule]
    assert any(term["topologyKey"] == "kubernetes.io/hostname" and
               selects(term["labelSelector"]["matchLabels"], pod_labels) for term in terms), terms
    redis_pod_labels = find("redis.yaml", "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert not selects(service["spec"]["selector"], redis_pod_labels), "the pagedserve Service must not reach Redis"


def test_the_state_store_url_names_the_redis_service(capsys):
    url = urlparse(parse_container_args(capsys).state_store)
    service = find("redis.yaml", "Service")
    assert url.scheme == "redis" and url.hostname == service["metadata"]["name"], url
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"], f"the state store URL's port {url.port} is not the Service's {port['port']}"
    redis = find("redis.yaml", "StatefulSet")
    assert selects(service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"])
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    port_named(container, port["targetPort"])


def test_redis_persists_to_an_append_only_file_on_its_volume():
    redis = find("redis.yaml", "StatefulSet")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    options = dict(zip(container["args"][1::2], container["args"][2::2]))
    assert container["args"][0] == "redis-server" and options["--appendonly"] == "yes", container["args"]
    (mount,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == options["--dir"]]
    claims = [claim["metadata"]["name"] for claim in redis["spec"]["volumeClaimTemplates"]]
    assert mount["name"] in claims, f"Redis writes to {options['--dir']}, which must be on a persistent volume"


def test_redis_refuses_writes_before_its_container_is_oom_killed():
    (container,) = find("redis.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    options = dict(zip(container["args"][1::2], container["args"][2::2]))
    assert options["--maxmemory-policy"] == "noeviction", "evicting would silently drop stored conversations"
    maxmemory, limit = options["--maxmemory"], container["resources"]["limits"]["memory"]
    assert maxmemory.endswith("mb") and limit.endswith("Gi"), (maxmemory, limit)
    assert int(maxmemory[:-2]) * 2**20 <= 0.8 * int(limit[:-2]) * 2**30, (
        f"--maxmemory {maxmemory} must leave room under the {limit} limit (fork for the AOF rewrite, buffers)")


# ---------------------------------------------------------------------------------------------- nginx


def test_nginx_accepts_the_shipped_config(tmp_path):
    result = subprocess.run(nginx_command(tmp_path, SHIPPED_CONFIG, "-t"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "test is successful" in result.stderr, result.stderr
