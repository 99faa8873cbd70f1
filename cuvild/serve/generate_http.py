"""Generation over HTTP: Triton's generate extension and OpenAI's completions.

  POST /v2/models/{m}[/versions/{v}]/generate         {"input_ids": [..]} or {"text_input":
                                                      ".."}, options at the top or under
                                                      "parameters": one JSON answer
  POST /v2/models/{m}[/versions/{v}]/generate_stream  the same, each token a server-sent
                                                      event (`data: {...}`) as it comes
  POST /v1/completions                                OpenAI's: {"model", "prompt" (text or
                                                      token ids), "max_tokens", "temperature",
                                                      "top_p", "seed", "stop", "stream"}
  POST /v1/chat/completions                           OpenAI's chat: {"model", "messages",
                                                      ...}: the prompt by the entry's chat
                                                      template (cuvild/serve/chat.py)

Options: max_tokens, temperature (0: greedy), top_k, top_p, seed, stop (token ids, or strings
with a tokenizer: the text ends before the first, which is not sent). A stream
that fails after its first token ends with an event `{"error": ...}` (the status is sent);
a caller that goes away ends its generation, and its sequence, at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import orjson
from aiohttp import web

from cuvild.core.layout import BadInput
from cuvild.serve.errors import Refused
from cuvild.serve.generation import OPTIONS, Generation

# `server` below is the RestServer (cuvild/serve/rest.py) that registered the routes: its
# `pool` runs the generation, `generator` opens it, `_body` reads a body within its limits.
RestServer = Any

FIELDS = {"input_ids", "text_input", "parameters", "stream", *OPTIONS}
OPENAI = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "n",
          "stop", "user"}
CHAT = OPENAI - {"prompt"} | {"messages", "max_completion_tokens"}
_DONE = object()


def register(app: web.Application, server: RestServer) -> None:
    models = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
    for base in models:
        app.router.add_post(base + "/generate", lambda r: triton(server, r, stream=False))
        app.router.add_post(base + "/generate_stream", lambda r: triton(server, r, stream=True))
    app.router.add_post("/v1/completions", lambda r: openai(server, r))
    app.router.add_post("/v1/chat/completions", lambda r: openai(server, r, chat=True))


def refused(e: Exception) -> Refused:
    """A generation's error as a refusal with its kind (BadInput: invalid)."""
    return e if isinstance(e, Refused) else Refused(getattr(e, "kind", "internal"), str(e))


async def _open(server: RestServer, request: web.Request, parse: Callable[[Any], Any]) -> Any:
    """The body parsed and checked by `parse` (off the event loop)."""
    doc = await server._body(request, orjson.loads)  # noqa: SLF001 - the server's body limits
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(server.pool, parse, doc)
    except (BadInput, Refused, RuntimeError) as e:
        raise refused(e) from None


async def triton(server: RestServer, request: web.Request, stream: bool) -> web.StreamResponse:
    m = request.match_info
    name, version = m["name"], m.get("version", "")

    def parse(doc: Any) -> Generation:
        if not isinstance(doc, dict):
            raise BadInput("expected a JSON object: {\"input_ids\": [...]} or "
                           "{\"text_input\": \"...\"}, with generation options")
        unknown = set(doc) - FIELDS
        if unknown:
            raise BadInput(f"unknown fields {sorted(unknown)}; known: {sorted(FIELDS)}")
        options = dict(doc.get("parameters") or {})
        options.pop("stream", None)
        options.update({k: doc[k] for k in OPTIONS if k in doc})
        return server.generator.open(name, version, prompt=doc.get("input_ids"),
                                     text=doc.get("text_input"), options=options)

    gen = await _open(server, request, parse)
    head = {"model_name": gen.name, "model_version": gen.version}
    if not stream:
        ids = await _all(server, gen)
        return _json({**head, "output_ids": ids, **({"text_output": gen.text}
                                                     if gen.tokenizer else {})})
    return await _events(server, request, gen, lambda token, piece: {
        **head, "output_ids": [token], **({"text_output": piece} if gen.tokenizer else {})})


async def openai(server: RestServer, request: web.Request,
                 chat: bool = False) -> web.StreamResponse:
    """OpenAI's /v1/completions and (`chat`) /v1/chat/completions: the API vLLM, llama.cpp's
    server and Ollama serve."""
    gen, stream = await _open(server, request, lambda doc: _openai_open(server, doc, chat))
    answer = _Answer(gen, chat)
    if not stream:
        ids = await _all(server, gen)
        body = answer.choice(gen.text, ids, _finish(gen), streamed=False)
        body["usage"] = {"prompt_tokens": len(gen.prompt), "completion_tokens": len(ids),
                         "total_tokens": len(gen.prompt) + len(ids)}
        return _json(body)
    return await _events(server, request, gen, lambda token, piece: answer.choice(
        piece, [token], None, first=len(gen.ids) == 1), done=lambda: answer.choice(
        "", [], _finish(gen)), openai=True)


def _openai_open(server: RestServer, doc: Any, chat: bool) -> tuple[Generation, bool]:
    """An OpenAI request checked and opened; whether it streams."""
    what = "messages" if chat else "prompt"
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise BadInput(f"expected a JSON object with \"model\" and \"{what}\"")
    known = CHAT if chat else OPENAI
    unknown = set(doc) - known
    if unknown:
        raise BadInput(f"unsupported fields {sorted(unknown)}; supported: {sorted(known)}")
    if doc.get("n", 1) != 1:
        raise BadInput("n must be 1 (one completion per request)")
    options = {k: doc[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop")
               if doc.get(k) is not None}
    if doc.get("max_completion_tokens") is not None:
        options["max_tokens"] = doc["max_completion_tokens"]
    name, _, version = doc["model"].partition(":")
    if chat:
        return server.generator.open(name, version, messages=doc.get("messages"),
                                     options=options), bool(doc.get("stream"))
    prompt = doc.get("prompt")
    text = prompt if isinstance(prompt, str) else None
    return server.generator.open(name, version, prompt=None if text else prompt, text=text,
                                 options=options), bool(doc.get("stream"))


class _Answer:
    """OpenAI's answer objects for one request: a completion's choices (text), a chat's
    (a message, or in a stream each chunk's delta, the role in the first)."""

    def __init__(self, gen: Generation, chat: bool) -> None:
        self.gen, self.chat, self.created = gen, chat, int(time.time())
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{id(gen):x}"

    def choice(self, text: str, ids: list[int], finish: str | None, first: bool = False,
               streamed: bool = True) -> dict[str, Any]:
        one: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if not self.chat:
            one.update(text=text, token_ids=ids)
            kind = "text_completion"
        elif streamed:
            one["delta"] = {**({"role": "assistant"} if first else {}),
                            **({"content": text} if text or first else {})}
            kind = "chat.completion.chunk"
        else:
            one["message"] = {"role": "assistant", "content": text}
            kind = "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.gen.name, "choices": [one]}


def _finish(gen: Generation) -> str:
    return "stop" if gen.stopped else "length"


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


async def _all(server: RestServer, gen: Generation) -> list[int]:
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(server.pool, lambda: [t for t, _ in gen.tokens()])
    except Exception as e:  # noqa: BLE001 - its kind decides the status
        raise refused(e) from None


async def _events(server: RestServer, request: web.Request, gen: Generation,
                  event: Callable[[int, str], Any], done: Callable[[], Any] | None = None,
                  openai: bool = False) -> web.StreamResponse:
    """Each token as a server-sent event, as it comes; the first token decides the status
    (an error before it is an ordinary error answer)."""
    tokens: Iterator[tuple[int, str]] = gen.tokens()
    pending = server.pool.submit(next, tokens, _DONE)
    try:
        try:
            item = await asyncio.wrap_future(pending)
        except Exception as e:  # noqa: BLE001 - its kind decides the status
            raise refused(e) from None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        while item is not _DONE:
            await response.write(b"data: " + orjson.dumps(event(*item)) + b"\n\n")
            pending = server.pool.submit(next, tokens, _DONE)
            try:
                item = await asyncio.wrap_future(pending)
            except Exception as e:  # noqa: BLE001 - said in the stream: the status is sent
                await response.write(b"data: " + orjson.dumps(
                    {"error": str(refused(e))}) + b"\n\n")
                break
        if done is not None and item is _DONE:
            await response.write(b"data: " + orjson.dumps(done()) + b"\n\n")
        if openai:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:  # done, failed or the caller gone: the generation (and its sequence) ends
        server.pool.submit(_close, tokens, pending)


def _close(tokens: Iterator[Any], pending: Future[Any]) -> None:
    with contextlib.suppress(Exception):
        pending.result()  # (a step still running: the generator is closed after it)
    tokens.close()  # type: ignore[attr-defined]
