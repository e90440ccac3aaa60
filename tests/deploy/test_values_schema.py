"""values.schema.json: good values pass, bad ones fail (jsonschema and Helm agree), and the schema
follows the gateway's own settings."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from backends.registry import BACKEND_NAMES, DENSE_BACKEND_NAMES
from gateway.openai.tool_formats import TOOL_FORMATS
from gateway.settings import CacheSettings, Limits, ModelSettings, Settings
from tests.deploy.conftest import CHART, EXAMPLES, HASH, require

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
MODEL = {"name": "m", "model": "/models/m"}


def _merged(override: dict, base: dict = DEFAULTS) -> dict:
    """Helm's merge of user values over the defaults: maps merge, anything else replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            _merged(value, out[key]) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def _errors(values: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(values)]


def test_the_schema_is_a_valid_draft7_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda p: p.name if p else "values.yaml")
def test_shipped_values_pass(example):
    values = _merged(yaml.safe_load(example.read_text())) if example else DEFAULTS
    assert _errors(values) == []


BAD = {
    "plaintext api key": {"auth": {"apiKeys": ["my-secret-key"]}},
    "plaintext admin key": {"auth": {"adminKey": "hunter2"}},
    "uppercase digest": {"auth": {"apiKeys": ["sha256:" + "AB" * 32]}},
    "keys in values and a secret": {"auth": {"apiKeys": [HASH], "existingSecret": "keys"}},
    "negative gpus": {"gpu": {"count": -1}},
    "gpus as a string": {"gpu": {"count": "1"}},
    "no models": {"config": {"models": []}},
    "colon in a model name": {"config": {"models": [{**MODEL, "name": "a:b"}]}},
    "unknown backend": {"config": {"models": [{**MODEL, "backend": "tgi"}]}},
    "vllm as the dense backend": {
        "config": {"models": [{**MODEL, "backend": "vllm", "dense_backend": "vllm"}]}
    },
    "misplaced model field": {"config": {"models": [{**MODEL, "max_tokens": 10}]}},
    "removed model field": {"config": {"models": [{**MODEL, "batch_window_ms": 2}]}},
    "unknown dtype": {"config": {"models": [{**MODEL, "dtype": "fp8"}]}},
    "redis url in the config": {"config": {"cache": {"redis_url": "redis://x"}}},
    "port in the config": {"config": {"port": 9000}},
    "unknown limit": {"config": {"limits": {"max_requests": 1}}},
    "pvc without a claim": {"modelStorage": {"source": "pvc"}},
    "relative host path": {"modelStorage": {"source": "hostPath", "hostPath": "data/models"}},
    "unknown storage source": {"adapterStorage": {"source": "nfs"}},
    "in-chart and external redis": {"redis": {"externalUrl": "redis://elsewhere:6379/0"}},
    "not a redis url": {"redis": {"enabled": False, "externalUrl": "http://cache:6379"}},
    "maxmemory unit": {"redis": {"maxmemory": "2GiB"}},
    "top-level typo": {"replicas": 2},
    "port out of range": {"gateway": {"port": 70000}},
    "zero failure threshold": {"probes": {"startup": {"failureThreshold": 0}}},
    "interval without unit": {"serviceMonitor": {"interval": "30"}},
    "relative ingress path": {"ingress": {"hosts": [{"host": "h", "paths": [{"path": "v1"}]}]}},
    "bad digest": {"image": {"digest": "latest"}},
}


@pytest.mark.parametrize("override", BAD.values(), ids=BAD.keys())
def test_bad_values_fail(override, request):
    values = _merged(override)
    assert _errors(values), "jsonschema accepted it"
    helm = require("helm_python")
    with pytest.raises(helm.HelmValuesError):  # and so does Helm, at install time
        request.getfixturevalue("chart").validate_schema(values)


def _properties(*path: str) -> set[str]:
    node = SCHEMA
    for key in path:
        node = node[key]
    return set(node["properties"])


def test_the_schema_follows_the_gateway_settings():
    chart_owned = {
        "host",
        "port",
        "api_keys",
        "api_keys_file",
        "admin_key",
        "metrics_public",
        "shutdown_grace_s",
    }
    assert _properties("properties", "config") == set(Settings.__struct_fields__) - chart_owned
    assert _properties("definitions", "model") == set(ModelSettings.__struct_fields__)
    assert _properties("properties", "config", "properties", "limits") == set(Limits.__struct_fields__)
    assert _properties("properties", "config", "properties", "cache") == set(
        CacheSettings.__struct_fields__
    ) - {"redis_url"}
    model = SCHEMA["definitions"]["model"]["properties"]
    assert set(BACKEND_NAMES) <= set(model["backend"]["enum"])
    assert model["dense_backend"]["enum"] == list(DENSE_BACKEND_NAMES)
    assert model["tool_call_format"]["enum"] == [*TOOL_FORMATS, None]
