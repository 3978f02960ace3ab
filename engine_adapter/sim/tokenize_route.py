"""The sim's ``POST /tokenize``, in vLLM's shape: a chat body's ``messages`` or a completions
``prompt`` (a string) in, ``{"count", "max_model_len", "tokens"}`` out, counted as the sim's
own chat and completions routes count the prompt they report (a chat rendered with the
generation prompt, as its chat route always renders it), or vLLM's error JSON."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from engine_adapter.sim.protocol import RequestError, request_object
from engine_adapter.sim.tokenizer import render_chat, tokenize

#: The sim has no context length; vLLM's answer names one.
MAX_MODEL_LEN = 1 << 20


def tokenize_route(model: str) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler for the sim serving ``model``."""

    async def handler(request: Request) -> Response:
        try:
            body = request_object(await request.body(), model)
            if "messages" in body:
                try:
                    ids = tokenize(render_chat(body["messages"]))
                except ValueError as exc:
                    raise RequestError(str(exc), param="messages") from None
            elif isinstance(body.get("prompt"), str):
                ids = tokenize(body["prompt"])
            else:
                raise RequestError("Field required: `prompt` (a string) or `messages`", param="prompt")
        except RequestError as exc:
            return Response(exc.body(), exc.status, media_type="application/json")
        answer = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
        return Response(orjson.dumps(answer), media_type="application/json")

    return handler
