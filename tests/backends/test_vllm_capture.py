"""The vLLM internals the dense-row capture relies on, and its batch bookkeeping, with vLLM's own
classes (no model). When vLLM moves these interfaces, this file fails first and says where."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

from tests.conftest import require_engine_library

require_engine_library("vllm")

import vllm  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from backends.vllm.capture import CAPTURE_KEY, SUPPORTED_VLLM, DenseRowCapture  # noqa: E402

pytestmark = pytest.mark.vllm
VOCAB = 50


def test_installed_vllm_is_in_the_supported_range():
    assert vllm.__version__ in SpecifierSet(",".join(SUPPORTED_VLLM)), (
        f"vLLM {vllm.__version__} is outside {SUPPORTED_VLLM}: re-check backends/vllm/capture.py"
    )


def test_the_logits_processor_interface_is_the_one_capture_implements():
    assert LogitsProcessor.__abstractmethods__ == {"__init__", "apply", "is_argmax_invariant", "update_state"}
    assert [f.name for f in dataclasses.fields(BatchUpdate)] == ["batch_size", "removed", "added", "moved"]
    assert {m.name for m in MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}
    assert "logits_processors" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert SamplingParams(max_tokens=1, extra_args={CAPTURE_KEY: ["x", 0]}).extra_args[CAPTURE_KEY] == [
        "x",
        0,
    ]
    # Non-argmax-invariant processors see the float32 logits of every step, greedy or not.
    assert "non_argmax_invariant" in inspect.getsource(Sampler.apply_logits_processors)


def tagged(path, row):
    return SamplingParams(max_tokens=1, extra_args={CAPTURE_KEY: [str(path), row]})


def update(added=(), removed=(), moved=(), size=3):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def output_file(path, rows):
    np.full((rows, VOCAB), np.nan, np.float32).tofile(path)
    return lambda: np.fromfile(path, np.float32).reshape(rows, VOCAB)


def test_rows_follow_their_requests_through_adds_moves_swaps_and_removals(tmp_path):
    capture = DenseRowCapture(None, torch.device("cpu"), False)
    read_a, read_b = output_file(tmp_path / "a", 2), output_file(tmp_path / "b", 1)
    capture.update_state(
        update(
            added=[
                (0, tagged(tmp_path / "a", 0), [1], []),
                (1, SamplingParams(), [2], []),
                (2, tagged(tmp_path / "a", 1), [3], []),
            ]
        )
    )
    logits = torch.randn(3, VOCAB)
    assert capture.apply(logits) is logits  # passes the logits through untouched
    want = torch.log_softmax(logits, -1).numpy()
    assert np.allclose(read_a(), want[[0, 2]], atol=1e-6)

    # Request 0 leaves, request 2 moves into slot 0, a new tagged request takes slot 1.
    capture.update_state(
        update(
            removed=[0],
            added=[(1, tagged(tmp_path / "b", 0), [4], [])],
            moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)],
            size=2,
        )
    )
    logits = torch.randn(2, VOCAB)
    capture.apply(logits)
    want = torch.log_softmax(logits, -1).numpy()
    assert np.allclose(read_a()[1], want[0], atol=1e-6) and np.allclose(read_b()[0], want[1], atol=1e-6)

    capture.update_state(update(moved=[(0, 1, MoveDirectionality.SWAP)], size=2))
    logits = torch.randn(2, VOCAB)
    capture.apply(logits)
    want = torch.log_softmax(logits, -1).numpy()
    assert np.allclose(read_a()[1], want[1], atol=1e-6) and np.allclose(read_b()[0], want[0], atol=1e-6)

    # An untagged request reusing a slot is not captured, and finished files are let go.
    capture.update_state(update(removed=[0], added=[(1, SamplingParams(), [5], [])], size=1))
    before = read_a()
    capture.apply(torch.randn(2, VOCAB))
    assert np.array_equal(read_a(), before, equal_nan=True)
    assert capture._targets == {} and capture._arrays == {}
