"""POST /v1/responses: OpenAI's Responses API on the chat route's generation.

A Responses request is turned into the chat request that makes its answer
(gateway/openai/response_input.py) and admitted, templated, checked and generated as the chat
route does it, under the same limits; only the answer's shape is this route's: the Response object
(gateway/openai/response_output.py), or its events (gateway/openai/response_stream.py). Responses
are not stored: `store` is answered false, and `previous_response_id` is refused.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Response, post

from gateway.contract.operation import OPENAPI, Operation
from gateway.errors import InvalidRequestError
from gateway.generation import choices as gen
from gateway.openai.chat import ChatRun, finished_message, start_chat, token_logprobs
from gateway.openai.response_input import chat_request, refusal, renamed, wants_logprobs
from gateway.openai.response_output import ResponseShape, ending, item_id, message_item
from gateway.openai.response_stream import ResponseEvents, response_events
from gateway.openai.serving import admit_body
from gateway.requests import decode_json
from gateway.responses import json_response, now, sse_response
from gateway.schemas.responses import FunctionCallItem, OutputItem, ResponseObject, ResponsesRequest

# The stream's events (OpenAPI 3.1: the schema of one event).
RESPONSE_EVENTS = {
    "type": "object",
    "description": "Server-sent events, each an `event: <type>` line and a `data: <event JSON>` line: "
    "response.created, response.in_progress, response.output_item.added, response.content_part.added, "
    "response.output_text.delta, response.output_text.done, response.content_part.done, "
    "response.function_call_arguments.delta, response.function_call_arguments.done, "
    "response.output_item.done, then response.completed or response.incomplete; an `error` event "
    "where generation fails midway. Each carries its `sequence_number`.",
    "properties": {
        "event": {"type": "string", "description": "The event's type."},
        "data": {"type": "string", "description": "The event's JSON."},
    },
    "required": ["event", "data"],
}


@post(
    "/v1/responses",
    status_code=200,
    summary="Create a response",
    description="OpenAI's Responses API through the model's chat template, as chat completions make "
    "it; with `stream: true`, OpenAI's Responses events. Responses are not stored.",
    tags=["OpenAI"],
    opt={
        OPENAPI: Operation(
            request=ResponsesRequest,
            content={"application/json": ResponseObject, "text/event-stream": RESPONSE_EVENTS},
            example={
                "model": "smollm2-135m",
                "instructions": "Answer briefly.",
                "input": "Hi",
                "max_output_tokens": 16,
            },
        )
    },
)
async def create_response(request: Request) -> Response:
    try:
        body = await decode_json(request, ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise refusal(exc) from None
    try:
        run = await start_chat(admit_body(request, chat_request(body)), "responses")
    except InvalidRequestError as exc:
        raise renamed(exc) from None
    shape = ResponseShape(body, wants_logprobs(body), item_id("resp"), now())
    if body.stream:
        events = ResponseEvents(shape)
        return sse_response(response_events(run, events), error_event=events.error, ending=b"")
    return json_response(await _whole(run, shape))


async def _whole(run: ChatRun, shape: ResponseShape) -> ResponseObject:
    """The answer once generated: the message (its text, where there is one) and the calls."""
    piece = await gen.collect(run.streams[0])
    run.usage.add(piece.steps)
    message, finish = finished_message(run.calls, piece.text, piece.finish_reason)
    status, incomplete = ending(finish)  # calls that ended: "tool_calls", complete
    output: list[OutputItem] = []
    if message.content is not None and (message.content or not message.tool_calls):
        logprobs = token_logprobs(run.served, piece.steps) if shape.logprobs and run.calls is None else None
        output.append(message_item(item_id("msg"), message.content, "completed", logprobs))
    for call in message.tool_calls or []:
        name, arguments = call.function.name, call.function.arguments
        output.append(
            FunctionCallItem(
                id=item_id("fc"), call_id=item_id("call"), name=name, arguments=arguments, status="completed"
            )
        )
    if output:  # the item the generation was making when it ended
        output[-1].status = status
    return shape.response(status, output, run.usage.usage(), incomplete)
