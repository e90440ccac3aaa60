"""vLLM's sampling fields that this gateway does not honour on OpenAI's routes, refused: a vLLM
client that sends one would otherwise get other output than it asked for, with no sign of it.

A field passes when it holds a value that changes nothing (vLLM's default, or its equivalent:
`top_k` -1 or 0, `best_of` equal to `n`); `top_k: 1` is greedy sampling, which is honoured
(the caller sets temperature 0). The OpenAPI document states the same (gateway/contract/). Anything else is a 400 naming the field. docs/api.md lists
every field and its state.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError
from gateway.schemas.common import GenerationRequest

# field -> the values that change nothing
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_k": (None, -1, 0, 1),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False),
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


def greedy_by_top_k(body: GenerationRequest) -> bool:
    """`top_k: 1`: only the most likely token, greedy sampling whatever the temperature."""
    return body.top_k == 1


def _refused(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{what} is not supported by this gateway: it would change the output, so it is refused "
        "rather than ignored (docs/api.md lists every sampling field)",
        param=field,
    )
