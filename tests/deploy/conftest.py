"""Fixtures for the deployment tests: the chart rendered by Helm's own Go library (helm-python-sdk
binds Helm's SDK, so this is `helm template`, not an imitation), manifests parsed strictly."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CHART = ROOT / "helm" / "logprob-gateway"
EXAMPLES = sorted((ROOT / "helm" / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "lpg", "lab"


def require(module: str | None = None, binary: str | None = None) -> Any:
    """The module (or binary path); missing: skip here, fail in CI, which installs every tool."""
    if module:
        found = importlib.util.find_spec(module)
    else:  # console scripts land next to the interpreter, which need not be on PATH
        found = shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))
    if found is None:
        what = module or binary
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing: CI installs it (see .ci/run)")
        pytest.skip(f"{what} is not installed (see docs/deploy.md, 'Tests')")
    return importlib.import_module(module) if module else found


class _StrictLoader(yaml.SafeLoader):
    """Rejects duplicate keys, which PyYAML silently collapses but Kubernetes rejects."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate keys {duplicates}", node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


class Manifests:
    """The objects of one render, by kind and name, plus NOTES.txt."""

    def __init__(self, rendered: dict[str, str]) -> None:
        self.notes = rendered.pop(f"{CHART.name}/templates/NOTES.txt", "")
        self.objects = [
            doc for text in rendered.values() for doc in yaml.load_all(text, Loader=_StrictLoader) if doc
        ]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}

    def get(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def gateway(self) -> dict:
        return self.get("Deployment", f"{RELEASE}-logprob-gateway")

    def container(self) -> dict:
        return self.gateway()["spec"]["template"]["spec"]["containers"][0]

    def env(self) -> dict[str, Any]:
        """Plain values as strings, references as their valueFrom."""
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in self.container()["env"]}

    def config_toml(self) -> str:
        return self.get("ConfigMap", f"{RELEASE}-logprob-gateway")["data"]["config.toml"]


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    helm = require("helm_python")
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart) -> Callable[..., Manifests]:
    def _render(values: dict | None = None, example: str | None = None) -> Manifests:
        import helm_python

        merged: dict = {}
        if example:  # parsed by Helm, as `helm install -f` would
            merged = helm_python.values_from_yaml((CHART.parent / "examples" / example).read_text())
        merged = _deep_merge(merged, values or {})
        return Manifests(chart.render(merged, name=RELEASE, namespace=NAMESPACE))

    return _render


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


HASH = "sha256:" + "ab" * 32  # a well-formed entry no key hashes to
