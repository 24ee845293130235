"""The Kubernetes manifests, proven offline: every overlay (and deploy/llm-d) renders
with kustomize, every object validates against the Kubernetes schemas and the custom
resources against their vendored CRDs, and every command and variable is one our code
takes."""

import pytest
from pydantic import BaseModel

from tests.helpers.compose import PARSERS
from tests.helpers.k8s import containers, problems
from tests.helpers.k8s import render as render_directory
from tools.stack import ROOT

pytestmark = pytest.mark.processes  # every test here runs processes

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "tp", "gateway", "pd"]
# Each overlay, and the deployment that llm-d routes (docs/llm-d.md).
DIRECTORIES = {**{name: K8S / "overlays" / name for name in OVERLAYS},
               "llm-d": ROOT / "deploy" / "llm-d"}  # fmt: skip


def render(overlay: str) -> list[dict]:
    return render_directory(DIRECTORIES[overlay])


@pytest.mark.parametrize("overlay", DIRECTORIES)
def test_every_object_validates(overlay):
    """Kubernetes' kinds by its schemas, the custom resources by their CRDs."""
    objects = render(overlay)
    for obj in objects:
        errors = problems(obj)
        assert not errors, f"{overlay}: {obj['kind']} {obj['metadata']['name']}: {errors}"
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds


@pytest.mark.parametrize("overlay", DIRECTORIES)
def test_every_command_and_variable_is_one_our_code_takes(overlay, monkeypatch):
    for name, container in containers(render(overlay)):
        command = container["command"]
        assert command[:2] == ["python", "-m"], name
        parse, prefix = PARSERS[command[2]]
        # A value the kubelet fills in (the Pod's IP) stands as an address here.
        env = {e["name"]: e.get("value", "10.0.0.1") for e in container.get("env", [])}
        ours = {k: v for k, v in env.items() if prefix and k.startswith(prefix)}
        # POD_IP: what the KV events' topic names the Pod by (kv@${POD_IP}@${MODEL}).
        assert set(env) - set(ours) <= {"OTEL_SERVICE_NAME", "POD_IP"}, f"{name}: {sorted(env)}"
        with monkeypatch.context() as patch:
            for variable, value in ours.items():
                patch.setenv(variable, value)
            parsed = parse(command[3:])
        for variable, value in ours.items():
            assert applied(getattr(parsed, variable.removeprefix(prefix).lower()), value)


@pytest.mark.parametrize("overlay", DIRECTORIES)
def test_probes_ask_the_health_entries_on_the_ports_served(overlay):
    for name, container in containers(render(overlay)):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        ports = {v for k, v in env.items() if k.endswith("_PORT")}
        for probe, entry in [("livenessProbe", "liveness"), ("readinessProbe", "readiness")]:
            if probe in container:
                assert container[probe]["grpc"]["service"] == entry, (name, probe)
                assert str(container[probe]["grpc"]["port"]) in ports, (name, probe)


def applied(parsed, value: str) -> bool:
    """A setting as parsed is the variable's value: a JSON one (a nested config such
    as --speculative-config) compared as the config it makes, an empty one unset."""
    if isinstance(parsed, BaseModel):
        return parsed == type(parsed).model_validate_json(value)
    return str(parsed) == value or (parsed is None and value == "")


def test_the_routers_find_the_replicas_through_the_headless_service():
    objects = render("cpu")
    service = next(o for o in objects if o["metadata"]["name"] == "flagstop-replica"
                   and o["kind"] == "Service")  # fmt: skip
    assert service["spec"]["clusterIP"] == "None"
    port = service["spec"]["ports"][0]["port"]
    router = next(c for name, c in containers(objects)
                  if name == "flagstop-router" and c["name"] == "router")  # fmt: skip
    env = {e["name"]: e["value"] for e in router["env"]}
    assert env["FLAGSTOP_ROUTER_SCHEDULER"] == f"dns:flagstop-replica:{port}"


def test_the_disaggregated_pools_are_one_service_apart_by_role():
    """Prefill and decode Pods are both the headless Service's (every router finds
    both) and each Deployment selects only its own; each executor takes its role and
    is reached at its Pod's IP."""
    objects = render("pd")
    service = next(o for o in objects if o["kind"] == "Service"
                   and o["metadata"]["name"] == "flagstop-replica")  # fmt: skip
    roles = {}
    for obj in objects:
        if obj["kind"] != "Deployment" or obj["metadata"]["name"] == "flagstop-router":
            continue
        selector = obj["spec"]["selector"]["matchLabels"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        executor = next(c for c in obj["spec"]["template"]["spec"]["containers"]
                        if c["name"] == "executor")  # fmt: skip
        env = {e["name"]: e for e in executor["env"]}
        role = env["FLAGSTOP_EXECUTOR_KV_ROLE"]["value"]
        assert (
            selector["app.kubernetes.io/component"] == role == labels["app.kubernetes.io/component"]
        )
        host = env["FLAGSTOP_EXECUTOR_KV_TRANSFER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert host == "status.podIP"
        roles[obj["metadata"]["name"]] = role
    assert roles == {"flagstop-replica": "decode", "flagstop-replica-prefill": "prefill"}
