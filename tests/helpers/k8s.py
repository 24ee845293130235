"""Kubernetes manifests rendered offline (kubectl's kustomize) and read back: shared by
the Kubernetes overlays' tests and llm-d's."""

import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml


def render(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here (its kustomize renders the overlays): not rendered")
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def field(obj, path: str):
    for key in path.split("."):
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    return obj


def containers(objects: list[dict]):
    """(Deployment name, container) of each of flagstop's containers (its image's)."""
    for obj in objects:
        if obj["kind"] == "Deployment":
            spec = obj["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                if container["image"].startswith("flagstop:"):
                    yield obj["metadata"]["name"], container


def named(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


# The custom resources' CRDs, vendored with their sources (deploy/llm-d/schemas/).
SCHEMAS = Path(__file__).parents[2] / "deploy" / "llm-d" / "schemas"
CRDS = ["inference.networking.k8s.io_inferencepools.yaml",
        "gateway.networking.k8s.io_httproutes.yaml"]  # fmt: skip
KUBERNETES_VERSION = "1.32.0"  # the oldest release we support


def closed(schema):
    """The schema with each object's fields closed, as kubectl's strict validation
    refuses an unknown field (an object the schema leaves open stays open)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: closed(v) for k, v in schema.items()}
    open_ = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
    if "properties" in schema and not open_:
        schema["additionalProperties"] = False
    return schema


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) → a validator of each served version of the vendored CRDs."""
    validators = {}
    for name in CRDS:
        crd = yaml.safe_load((SCHEMAS / name).read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schema = closed(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = {"type": "object"}
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(
                    schema
                )
    return validators


def problems(obj: dict) -> list[str]:
    """What is wrong with one object by its published schema: Kubernetes' own kinds by
    kubernetes_validate (strict), the custom resources by their vendored CRDs."""
    key = (obj["apiVersion"], obj["kind"])
    if validator := crd_validators().get(key):
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(obj)]  # fmt: skip
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [e.message]
    return []
