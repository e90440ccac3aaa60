"""New weights loaded in place into a running transformers engine: its rows are then those of a
forward pass of the new weights, with nothing kept from the old (prefix keys/values), and
weights that do not fit change nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from backends.errors import WeightsError
from backends.transformers.engine import TransformersEngine
from backends.types import EngineConfig
from backends.weights_in_place import check_same_tensors
from tests.conftest import engine_rows

pytestmark = pytest.mark.slow
PREFIXES = [[504, 3575, 282, 4649, 314], [410, 2251, 30], [504, 3575, 282]]


async def rows(engine: TransformersEngine, prefixes: list[list[int]]) -> np.ndarray:
    return await engine_rows(engine, prefixes)


async def test_rows_after_an_update_are_the_new_weights_and_no_old_keys_values_are_reused(
    model_dir, scaled_dir, reference, scaled
):
    engine = TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    before = await rows(engine, PREFIXES)  # fills the prefix cache with keys/values of the old weights
    for row, ids in zip(before, PREFIXES, strict=True):
        np.testing.assert_allclose(row, reference.logprobs(ids)[-1], rtol=0, atol=1e-4)
    await engine.weights.load(str(scaled_dir))
    assert engine.info.path == str(scaled_dir)
    extended = [ids + [13] for ids in PREFIXES]  # would extend cached prefixes of the old weights
    after = await rows(engine, PREFIXES + extended)
    for row, ids in zip(after, PREFIXES + extended, strict=True):
        np.testing.assert_allclose(row, scaled.logprobs(ids)[-1], rtol=0, atol=1e-4)
    assert np.abs(after[: len(PREFIXES)] - before).max() > 0.01  # the weights did change
    scores = await engine.prompt_logprobs(PREFIXES[0], 0)
    expected = scaled.logprobs(PREFIXES[0])
    want = [expected[i, t] for i, t in enumerate(PREFIXES[0][1:])]
    np.testing.assert_allclose(scores.token_logprobs, want, rtol=0, atol=1e-4)
    await engine.aclose()


def _broken(source: Path, target: Path, change) -> Path:
    shutil.copytree(source, target)
    (weights,) = target.glob("*.safetensors")
    tensors = load_file(weights)
    change(tensors, target)
    save_file(tensors, weights, metadata={"format": "pt"})
    return target


BAD = [
    ("missing", "has no tensor 'model.layers.2.mlp.up_proj.weight'"),
    ("shape", "has shape"),
    ("architecture", "holds a MistralForCausalLM"),
    ("config", "cannot be read"),
    ("empty", "has no .safetensors weights"),
    ("no directory", "is not a directory"),
]


def bad_weights(case: str, scaled_dir: Path, tmp_path: Path) -> Path:
    """A directory of new weights that does not fit the default model, as `case` says."""

    def change(tensors: dict, target: Path) -> None:
        if case == "missing":
            del tensors["model.layers.2.mlp.up_proj.weight"]
        elif case == "shape":
            tensors["model.layers.5.self_attn.o_proj.weight"] = tensors[
                "model.layers.5.self_attn.o_proj.weight"
            ][:, :-1].contiguous()
        elif case == "architecture":
            config = json.loads((target / "config.json").read_text())
            config["architectures"] = ["MistralForCausalLM"]
            (target / "config.json").write_text(json.dumps(config))
        elif case == "config":
            (target / "config.json").write_text("{")

    if case == "empty":
        path = tmp_path / "empty"
        path.mkdir()
        shutil.copy(scaled_dir / "config.json", path)
        return path
    if case == "no directory":
        return tmp_path / "nowhere"
    return _broken(scaled_dir, tmp_path / case, change)


def test_headers_are_checked_as_the_weights_are(model_dir, scaled_dir, tmp_path):
    """vLLM's reload is checked on the headers alone, with the same refusals."""
    check_same_tensors(model_dir, scaled_dir)
    for case, words in BAD:
        with pytest.raises(WeightsError, match=words):
            check_same_tensors(model_dir, bad_weights(case, scaled_dir, tmp_path))


@pytest.mark.parametrize(("case", "words"), BAD)
async def test_weights_that_do_not_fit_change_nothing(
    model_dir, scaled_dir, reference, tmp_path, case, words
):
    path = bad_weights(case, scaled_dir, tmp_path)
    engine = TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    with pytest.raises(WeightsError, match=words):
        await engine.weights.load(str(path))
    for row, ids in zip(await rows(engine, PREFIXES), PREFIXES, strict=True):
        np.testing.assert_allclose(row, reference.logprobs(ids)[-1], rtol=0, atol=1e-4)
    assert engine.info.path != str(path)
    await engine.aclose()
