"""Where new weights may be loaded from at run time: a directory inside the model's `weights_root`.

As with adapters (gateway/models/adapter_checks.py), a shared service must not read arbitrary files: the
directory, after resolving symlinks, must lie inside the root, and so must every entry of it
(engines read files of the directory by name). A path outside the root, a missing one, one that
is no directory, one the filesystem refuses (no permission, a symlink loop, a name too long) and a
directory with an entry leading outside all get one and the same answer, so that the endpoint
tells nothing about the filesystem beyond the root. Weights come as safetensors, never pickles.
"""

from __future__ import annotations

from pathlib import Path

from gateway.errors import ForbiddenError, InvalidRequestError
from gateway.models.adapter_checks import leaving_entry

UNAVAILABLE = (
    "model_path must name a directory inside this model's weights_root "
    "(relative to it, or absolute), none of whose entries leads outside it"
)


def _unavailable() -> InvalidRequestError:
    return InvalidRequestError(UNAVAILABLE, param="model_path")


def weights_dir(root: str | None, given: str) -> Path:
    """`given` (relative to `root`, or absolute) resolved: a directory inside `root` whose every
    entry resolves inside it too, with a config.json and safetensors weights. ForbiddenError
    without a root (run-time loads off); otherwise InvalidRequestError, the same one for every
    path that is not such a directory inside the root, whatever the reason. Blocks on the
    filesystem: call it off the event loop."""
    if root is None:
        raise ForbiddenError(
            "loading weights at run time is disabled for this model (no weights_root)", param="model_path"
        )
    try:
        base = Path(root).resolve()
        path = (base / given).resolve()
        if not path.is_relative_to(base) or not path.is_dir():
            raise _unavailable()
        if leaving_entry(path, base) is not None:
            raise _unavailable()
        has_config = (path / "config.json").is_file()
        has_safetensors = any(file.is_file() for file in path.glob("*.safetensors"))
    except (OSError, ValueError, RuntimeError):  # RuntimeError: pathlib's report of a symlink loop
        raise _unavailable() from None
    if not has_config:
        raise InvalidRequestError("model_path has no config.json", param="model_path")
    if not has_safetensors:
        raise InvalidRequestError(
            "model_path has no .safetensors weights (pickled weights are refused)", param="model_path"
        )
    return path
