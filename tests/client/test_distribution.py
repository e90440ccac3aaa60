"""The client's own distribution (client/): installed alone into a fresh venv, without torch or the
server, it reads the same rows and vocabulary from the real gateway as this process does."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.slow

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
PREFIXES = [[1, 2, 3], [504, 3136, 314]]

# Runs inside the venv, from a directory outside the repository, so only the installed package imports.
SCRIPT = """
import sys

import msgspec
import numpy as np

import logprob_gateway_client
from logprob_gateway_client import AsyncGatewayLM

base_url, model, prefixes, out = sys.argv[1], sys.argv[2], msgspec.json.decode(sys.argv[3]), sys.argv[4]
with AsyncGatewayLM(base_url, model) as lm:
    rows = np.stack([np.asarray(row) for row in lm.batch_next_token_logprobs_sync(prefixes)])
    answer = {
        "package": logprob_gateway_client.__file__,
        "rows": rows.astype("<f4").tobytes(),
        "shape": list(rows.shape),
        "byte_vocab": [bytes(token) for token in lm.byte_vocab],
    }
with open(out, "wb") as f:
    f.write(msgspec.msgpack.encode(answer))
"""


class _Answer(msgspec.Struct):
    package: str
    rows: bytes
    shape: list[int]
    byte_vocab: list[bytes]


def _clean_env() -> dict[str, str]:
    """This process's environment without what would let the venv see the working tree's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("client-venv")
    venv = root / "venv"
    # Built from a copy: pip's in-tree build would leave build/ and egg-info in the working tree.
    source = shutil.copytree(
        CLIENT_DIR, root / "client", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_clean_env())
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
        check=True,
        env=_clean_env(),
        cwd=venv,
        timeout=600,
    )
    return python


def test_the_client_distribution_installs_without_torch_or_the_server(client_venv: Path):
    for module in ("torch", "gateway", "litestar", "transformers"):
        found = subprocess.run(
            [
                str(client_venv),
                "-c",
                f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is not None)",
            ],
            env=_clean_env(),
            cwd=client_venv.parent,
        )
        assert found.returncode == 0, f"{module} is importable in the client's venv"


def test_the_installed_client_reads_the_rows_and_vocabulary_this_process_reads(
    client_venv: Path, gateway, http: httpx.Client, tmp_path: Path
):
    out = tmp_path / "answer.msgpack"
    subprocess.run(
        [
            str(client_venv),
            "-c",
            SCRIPT,
            gateway.base_url,
            MODEL,
            msgspec.json.encode(PREFIXES).decode(),
            str(out),
        ],
        check=True,
        env=_clean_env(),
        cwd=tmp_path,
        timeout=300,
    )
    answer = msgspec.msgpack.decode(out.read_bytes(), type=_Answer)
    assert Path(answer.package).is_relative_to(client_venv.parents[1])  # the venv's copy, not the tree's

    response = http.post(
        "/v1/next_token_logprobs",
        json={"model": MODEL, "input": PREFIXES, "encoding_format": "base64", "layout": "matrix"},
    )
    response.raise_for_status()
    document = response.json()
    expected = np.frombuffer(base64.b64decode(document["logprobs"]), dtype="<f4")
    assert answer.shape == [len(PREFIXES), document["vocab_size"]]
    assert answer.rows == expected.tobytes()

    vocabulary = http.get(f"/v1/models/{MODEL}/vocabulary").json()
    assert answer.byte_vocab == [base64.b64decode(token) for token in vocabulary["tokens"]]


def test_the_genlm_extra_brings_what_the_docs_genlm_example_needs(client_venv: Path):
    api = (CLIENT_DIR.parent / "docs" / "api.md").read_text()
    example = api[api.index("```python\nfrom logprob_gateway_client import AsyncGatewayLM") :]
    example = example[: example.index("```\n", 10)]
    assert (
        "from genlm.control import" in example and "llm.tokenizer" in example
    )  # genlm-control, transformers
    assert 'pip\ninstall "./client[genlm]"' in api or 'pip install "./client[genlm]"' in api
    declared = subprocess.run(
        [
            str(client_venv),
            "-c",
            "import importlib.metadata as m, json; print(json.dumps(m.requires('logprob-gateway-client')))",
        ],
        env=_clean_env(),
        cwd=client_venv.parent,
        capture_output=True,
        text=True,
        check=True,
    )
    requires = json.loads(declared.stdout)
    genlm = {re.match(r"[\w.-]+", r).group(0) for r in requires if re.search(r"extra == .genlm.", r)}
    assert {"genlm-control", "transformers"} <= genlm
