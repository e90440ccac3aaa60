"""The Response object of /v1/responses, whole or as its stream's events carry it: the request's
fields echoed, the answer's status, output items and usage."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.schemas.chat import TokenLogprob
from gateway.schemas.common import Usage
from gateway.schemas.responses import (
    IncompleteDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputTextPart,
    PlainTextFormat,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)


def item_id(prefix: str) -> str:
    """An id as OpenAI spells them: `resp_…`, `msg_…`, `fc_…`, `call_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def ending(finish_reason: str | None) -> tuple[ItemStatus, IncompleteDetails | None]:
    """The response's status by its generation's finish reason: cut by max_output_tokens (or the
    context), or aborted for a weights update, is "incomplete"."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish_reason == "abort":
        return "incomplete", IncompleteDetails(reason=None)
    return "completed", None


def message_item(
    message_id: str, text: str, status: ItemStatus, logprobs: list[TokenLogprob] | None = None
) -> OutputMessage:
    part = OutputTextPart(text=text, logprobs=logprobs or [])
    return OutputMessage(id=message_id, status=status, content=[part])


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


@dataclass(frozen=True)
class ResponseShape:
    """What every Response object of one request holds: its id, its time, the request's fields
    echoed; `logprobs`: whether its text carries them."""

    body: ResponsesRequest
    logprobs: bool
    id: str
    created_at: int

    def response(
        self,
        status: str,
        output: list[OutputItem],
        usage: Usage | None = None,
        incomplete: IncompleteDetails | None = None,
    ) -> ResponseObject:
        body = self.body
        text = body.text or TextConfig()
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            incomplete_details=incomplete,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=body.model,
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=body.reasoning,
            temperature=body.temperature,
            text=TextConfig(format=text.format or PlainTextFormat(), verbosity=text.verbosity),
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            top_p=body.top_p,
            top_logprobs=body.top_logprobs,
            usage=response_usage(usage) if usage is not None else None,
            user=body.user,
            metadata=body.metadata or {},
        )
