"""vLLM's sampling fields that this gateway does not honour on OpenAI's routes, refused: a vLLM
client that sends one would otherwise get other output than it asked for, with no sign of it.

A field passes when it holds a value that changes nothing (vLLM's default, or its equivalent:
`best_of` equal to `n`); anything else is a 400 naming the field. The OpenAPI document states the
same (gateway/contract/). vLLM's other fields are honoured (gateway/openai/serving.py).
docs/api.md lists every field and its state.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError
from gateway.schemas.common import GenerationRequest

# field -> the values that change nothing
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
}


def refuse_unhonoured(body: GenerationRequest) -> None:
    """InvalidRequestError naming the first field of vLLM's that asks for what is not done."""
    for field, neutral in NEUTRAL.items():
        if getattr(body, field) not in neutral:
            accepted = ", ".join(repr(v) for v in neutral if v is not None)
            raise _refused(field, f"{field} other than {accepted}" if accepted else field)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidRequestError("best_of is not supported unless it equals n", param="best_of")


def _refused(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{what} is not supported by this gateway: it would change the output, so it is refused "
        "rather than ignored (docs/api.md lists every sampling field)",
        param=field,
    )
