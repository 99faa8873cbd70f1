"""Generation over HTTP: Triton's generate extension and OpenAI's completions.

  POST /v2/models/{m}[/versions/{v}]/generate         {"input_ids": [..]} or {"text_input":
                                                      ".."}, options at the top or under
                                                      "parameters": one JSON answer
  POST /v2/models/{m}[/versions/{v}]/generate_stream  the same, each token a server-sent
                                                      event (`data: {...}`) as it comes
  POST /v1/completions                                OpenAI's: {"model", "prompt" (text or
                                                      token ids, or a list of either),
                                                      "max_tokens", "temperature", "top_p",
                                                      "seed", "stop", "stream", "logprobs",
                                                      "echo", ...}
  POST /v1/chat/completions                           OpenAI's chat: {"model", "messages",
                                                      ...}: the prompt by the entry's chat
                                                      template (cuvild/serve/chat.py)
  GET  /v1/models, /v1/models/{model}                 OpenAI's model list: those that
                                                      generate or embed, with their context
  POST /v1/embeddings, /v1/rerank, /v1/score,         an encoder's: cuvild/serve/embeddings.py,
       /v1/classify (/rerank, /v2/rerank, /score,     cuvild/serve/rerank.py,
       /classify too), /pooling                       cuvild/serve/classify.py, pooling.py
  /openai/v1/...                                      the same, where KServe's model server
                                                      has them

Options: max_tokens, temperature (0: greedy), top_k, top_p, seed, stop (token ids, or strings
with a tokenizer: the text ends before the first, which is not sent), frequency_penalty,
presence_penalty and logit_bias. OpenAI's routes also give `logprobs` (a completion's count,
a chat's `logprobs` with `top_logprobs`), and a completion takes several prompts and `echo` (what
lm-evaluation-harness's loglikelihood asks: the prompt's own logprobs), and `n` choices a
prompt: the prompt run once, each choice then on its own copy of the state it left
(generation.py `share`), with `seed` choice j sampled from seed + j (vLLM's rule),
the index of prompt i's choice j i * n + j; streamed interleaved, each chunk its choice's
`index`. A request's choices generate a quarter of the HTTP threads at a time, so that
their decode steps share runs (runtimes/together.py). A stream that fails after its first
token ends with an event `{"error": ...}` (the status is sent); a caller that goes away
ends its generation (all n), and its sequence, at the next token.
OpenAI's fields this does not do are refused, not ignored; its errors are OpenAI's error
object (`error_object`), as its SDK and vLLM's clients read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import orjson
from aiohttp import web

from cuvild.core.layout import BadInput
from cuvild.serve import (
    classify,
    embeddings,
    openai_request,
    pooling,
    reasoning,
    rerank,
    tokenize_http,
)
from cuvild.serve import tools as tools_mod
from cuvild.serve.chat import options_of as chat_options_of
from cuvild.serve.detokenize import continued
from cuvild.serve.errors import STATUS, Refused, status
from cuvild.serve.generation import OPTIONS, Generation, share
from cuvild.serve.tool_stream import ToolStream

# `server` below is the RestServer (cuvild/serve/rest.py) that registered the routes: its
# `pool` runs the generation, `generator` opens it, `_body` reads a body within its limits.
RestServer = Any

# (accumulate_tokens: TensorRT-LLM's, which vLLM's serving benchmark sends: each streamed
# text_output is the whole text so far)
FIELDS = {"input_ids", "text_input", "parameters", "stream", "accumulate_tokens", *OPTIONS}
# where OpenAI's routes are: its own /v1, and KServe's model server's /openai/v1 (its
# documentation's base_url for an OpenAI client of an InferenceService)
PREFIXES = ("/v1", "/openai/v1")
_DONE = object()


def register(app: web.Application, server: RestServer) -> None:
    models = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
    for base in models:
        app.router.add_post(base + "/generate", lambda r: triton(server, r, stream=False))
        app.router.add_post(base + "/generate_stream", lambda r: triton(server, r, stream=True))
    for base in PREFIXES:
        app.router.add_post(base + "/completions", lambda r: openai(server, r))
        app.router.add_post(base + "/chat/completions", lambda r: openai(server, r, chat=True))
        app.router.add_get(base + "/models", lambda r: openai_models(server, r))
        app.router.add_get(base + "/models/{model}", lambda r: openai_models(server, r))
        app.router.add_post(base + "/embeddings",
                            lambda r: _answered(server, r, embeddings.embed))
        app.router.add_post(base + "/rerank", lambda r: _answered(server, r, rerank.rerank))
        app.router.add_post(base + "/score", lambda r: _answered(server, r, rerank.score))
        app.router.add_post(base + "/classify",
                            lambda r: _answered(server, r, classify.classify))
    answers = [*zip(tokenize_http.ROUTES, (tokenize_http.tokenize, tokenize_http.detokenize),
                    strict=True), *((path, rerank.rerank) for path in rerank.ROUTES),
               *((path, rerank.score) for path in rerank.SCORE_ROUTES),
               *((path, classify.classify) for path in classify.ROUTES),
               *((path, pooling.pool) for path in pooling.ROUTES)]
    for path, answer in answers:
        app.router.add_post(path, lambda r, answer=answer: _answered(server, r, answer))


async def _answered(server: RestServer, request: web.Request,
                    answer: Callable[[Any, Any], dict[str, Any]]) -> web.Response:
    """A request answered whole by `answer(generator, body)` on a pool thread: vLLM's
    /tokenize and /detokenize (cuvild/serve/tokenize_http.py), /v1/embeddings
    (cuvild/serve/embeddings.py), /rerank and /score (cuvild/serve/rerank.py), /classify
    (cuvild/serve/classify.py), /pooling (cuvild/serve/pooling.py)."""
    return _json(await _open(server, request, lambda doc: answer(server.generator, doc)))


def is_openai(path: str) -> bool:
    """Whether `path` is one of OpenAI's routes (its errors are OpenAI's error object)."""
    return (any(path.startswith(base + "/") for base in PREFIXES)
            or path in (*tokenize_http.ROUTES, *rerank.ROUTES, *rerank.SCORE_ROUTES,
                        *classify.ROUTES, *pooling.ROUTES))


def error_object(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error object, for the /v1 routes' errors: {"error": error_object(...)}."""
    kind = ("authentication_error" if status == 401 else "invalid_request_error"
            if status < 500 else "server_error")
    return {"message": message, "type": kind, "param": None, "code": None}


async def openai_models(server: RestServer, request: web.Request) -> web.Response:
    """OpenAI's model list, or one model (cuvild/serve/tokenize_http.py `models_listed`)."""
    return _json(tokenize_http.models_listed(server.generator, request.match_info.get("model")))


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

    def parse(doc: Any) -> tuple[Generation, bool]:
        if not isinstance(doc, dict):
            raise BadInput("expected a JSON object: {\"input_ids\": [...]} or "
                           "{\"text_input\": \"...\"}, with generation options")
        unknown = set(doc) - FIELDS
        if unknown:
            raise BadInput(f"unknown fields {sorted(unknown)}; known: {sorted(FIELDS)}")
        options = dict(doc.get("parameters") or {})
        options.pop("stream", None)
        options.update({k: doc[k] for k in OPTIONS if k in doc})
        whole = options.pop("accumulate_tokens", doc.get("accumulate_tokens", False))
        if not isinstance(whole, bool):
            raise BadInput(f"accumulate_tokens must be true or false, got {whole!r}")
        return server.generator.open(name, version, prompt=doc.get("input_ids"),
                                     text=doc.get("text_input"), options=options), whole

    gen, whole = await _open(server, request, parse)
    head = {"model_name": gen.name, "model_version": gen.version}
    if not stream:
        ids = [token for token, _ in await _all(server, gen)]
        return _json({**head, "output_ids": ids, **({"text_output": gen.text}
                                                     if gen.tokenizer else {})})
    said: list[str] = []  # (accumulate_tokens: the text so far in each event)

    def event(token: int, piece: str) -> dict[str, Any]:
        said.append(piece)
        text = "".join(said) if whole else piece
        return {**head, "output_ids": [token], **({"text_output": text} if gen.tokenizer else {})}

    return await _events(server, request, gen, event)


async def openai(server: RestServer, request: web.Request,
                 chat: bool = False) -> web.StreamResponse:
    """OpenAI's /v1/completions and (`chat`) /v1/chat/completions: the API vLLM, llama.cpp's
    server and Ollama serve."""
    answers, stream = await _open(server, request, lambda doc: _openai_open(server, doc, chat))
    if not stream:  # every prompt's choices, in the order asked
        choices = []
        for answer, made in zip(answers, await _together(server, answers), strict=True):
            choices += answer.choice(answer.gen.text, made, _finish(answer.gen),
                                     streamed=False)["choices"]
        return _json({**answers[0].head(streamed=False), "choices": choices,
                      "usage": _usage(answers)})
    if len(answers) > 1:  # n choices of one prompt
        return await _interleaved(server, request, answers)
    answer = answers[0]
    gen = answer.gen
    return await _events(server, request, gen, lambda token, piece: answer.choice(
        piece, [(token, piece)], None, first=len(gen.ids) == 1), done=answer.done, openai=True)


def _openai_open(server: RestServer, doc: Any, chat: bool) -> tuple[list[_Answer], bool]:
    """An OpenAI request checked and opened: its answers (`n` for each prompt; a completion
    may ask for several: a list of texts or of token id lists), and whether it streams."""
    n, echo, stream, usage, options = openai_request.checked(doc, chat)
    top = openai_request.top_logprobs(doc, chat)
    name, _, version = doc["model"].partition(":")
    seed = options.get("seed")
    answers: list[_Answer] = []

    def choices(**given: Any) -> list[tuple[int, Generation]]:
        """The prompt's n generations, choice j sampled from seed + j (vLLM's rule), the
        prompt run once for all (`share`)."""
        gens = [server.generator.open(name, version, options=options if seed is None or j == 0
                                      else {**options, "seed": seed + j}, **given)
                for j in range(n)]
        for gen in gens:
            gen.top_logprobs, gen.score_prompt = top, echo
        share(gens)
        return list(enumerate(gens))

    if chat:
        calls = openai_request.tools_of(doc, options)
        for j, gen in choices(messages=doc.get("messages"), tools=calls and calls.tools,
                              chat_options=chat_options_of(doc)):
            answers.append(_Answer(gen, chat, usage, index=j,
                                   id_of=answers[0] if answers else None, first=j == 0))
            answers[-1].tools = calls
        return answers, stream
    prompts = openai_request.prompts(doc.get("prompt"))
    if stream and (len(prompts) > 1 or echo):
        raise BadInput("a stream takes one prompt, without echo")
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else None
        for j, gen in choices(prompt=None if text else prompt, text=text):
            answers.append(_Answer(gen, chat, usage, index=i * n + j, echo=echo, text=text,
                                   id_of=answers[0] if answers else None, first=j == 0))
    return answers, stream


def _usage(answers: list[_Answer]) -> dict[str, Any]:
    """OpenAI's usage of a response's answers: each prompt counted once (its first choice's),
    `cached_tokens` of them held by a kept sequence (cuvild/run/prefixes.py), not run."""
    made = sum(len(a.gen.ids) for a in answers)
    prompt = sum(len(a.gen.prompt) for a in answers if a.first)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": sum(a.gen.cached for a in answers
                                                           if a.first)}}


class _Answer:
    """OpenAI's answer objects for one prompt of a request: a completion's choices (text), a
    chat's (a message, or in a stream each chunk's delta, the role in the first)."""

    def __init__(self, gen: Generation, chat: bool, usage: bool = False, index: int = 0,
                 echo: bool = False, text: str | None = None,
                 id_of: _Answer | None = None, first: bool = True) -> None:
        """`index`: the choice's (its prompt's place in the request); `echo`: a completion's
        text starts with its prompt (`text`, as given; else its ids decoded), its logprobs
        with the prompt tokens'; `id_of`: the answer whose id and time a response shares."""
        self.gen, self.chat, self.index = gen, chat, index
        self.first = first  # its prompt's first choice (the usage counts each prompt once)
        self.created = id_of.created if id_of else int(time.time())
        self.id = id_of.id if id_of else f"{'chatcmpl' if chat else 'cmpl'}-{id(gen):x}"
        self.with_usage = usage  # a stream's chunks say "usage": null, the last the usage
        self.answered = 0  # tokens answered so far (their logprobs are gen.scored's first)
        self.offset = 0  # their text's length (a completion's logprobs' text_offset)
        self.echo = (text if text is not None else self._decoded(gen.prompt)) if echo else ""
        self.prompt_due = echo  # (the prompt goes with the first choice that has tokens)
        self.tools: tools_mod.Tools | None = None  # a chat's (its answer read for calls)
        self.stream: ToolStream | None = None  # its stream's calls (cuvild/serve/tool_stream.py)
        # a reasoning model's chat (cuvild/serve/reasoning.py): whether its prompt opened it
        self.thinking: bool | None = getattr(gen, "thinking", None) if chat else None
        self.reader = None if self.thinking is None else reasoning.Reader(self.thinking)

    def _decoded(self, ids: list[int]) -> str:
        tokenizer = self.gen.tokenizer
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)

    def done(self) -> list[dict[str, Any]]:
        """A stream's last chunks: `ending`'s, and (with_usage) the usage, no choice."""
        last = self.ending()
        if self.with_usage:
            last.append({**self.head(), "choices": [], "usage": _usage([self])})
        return last

    def ending(self) -> list[dict[str, Any]]:
        """A streamed choice's last chunks: what its reasoning and its tools held back (calls
        as JSON alone, text that may have begun a call: cuvild/serve/tool_stream.py), then its
        finish reason ("tool_calls" where it made calls and stopped)."""
        finish, delta = _finish(self.gen), {}
        if self.reader is not None:
            thought, text = self.reader.end()
            delta = {**({"reasoning": thought} if thought else {}), **self._content(text)}
        if self.stream is not None:
            more, called = self.stream.end()
            finish = "tool_calls" if called and finish == "stop" else finish
            delta = _merged(delta, more)
        chunk = self.choice("", [], None)
        chunk["choices"][0]["delta"] = delta
        return [*([chunk] if delta else []), self.choice("", [], finish)]

    def head(self, streamed: bool = True) -> dict[str, Any]:
        kind = ("text_completion" if not self.chat else "chat.completion.chunk" if streamed
                else "chat.completion")
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.gen.name}

    def choice(self, text: str, made: list[tuple[int, str]], finish: str | None,
               first: bool = False, streamed: bool = True) -> dict[str, Any]:
        """A choice of `text`, made of the tokens `made` (id, the text each added)."""
        prompt, self.prompt_due = self.prompt_due and bool(made), self.prompt_due and not made
        one: dict[str, Any] = {"index": self.index, "logprobs": self._logprobs(made, prompt),
                               "finish_reason": finish}
        if not self.chat:
            one.update(text=self.echo + text if prompt else text,
                       token_ids=[token for token, _ in made])
        elif streamed:
            one["delta"] = self._streamed(text, first)
        else:
            thought, text = (None, text) if self.thinking is None else reasoning.split(
                text, self.thinking)
            one["message"] = (self.tools.message(text) if self.tools is not None
                              else {"role": "assistant", "content": text})
            if thought is not None:
                one["message"]["reasoning"] = thought
            if one["message"].get("tool_calls"):
                one["finish_reason"] = "tool_calls"
        return {**self.head(streamed), "choices": [one],
                **({"usage": None} if streamed and self.with_usage else {})}

    def _streamed(self, text: str, first: bool) -> dict[str, Any]:
        """A streamed chat's delta for its next `text`: a reasoning model's reasoning as it
        comes (cuvild/serve/reasoning.py), and its content; with tools, its content and its
        calls as they are written (cuvild/serve/tool_stream.py), each call's id and name in
        its first delta, its arguments in the next, as OpenAI and vLLM stream them."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        thought = ""
        if self.reader is not None:
            thought, text = self.reader.feed(text)
        more = {**({"reasoning": thought} if thought else {}), **self._content(text)}
        return {**delta, **({"content": ""} if first and not more else {}), **more}

    def _content(self, text: str) -> dict[str, Any]:
        """The delta of an answer's next content `text`: itself, or with tools what their
        stream lets go (cuvild/serve/tool_stream.py)."""
        if self.tools is None:
            return {"content": text} if text else {}
        if self.stream is None:
            self.stream = ToolStream(self.tools)
        return self.stream.feed(text)

    def _logprobs(self, made: list[tuple[int, str]], prompt: bool) -> dict[str, Any] | None:
        """OpenAI's logprobs of the next tokens answered (`made`; `prompt`: the prompt's
        before them, the first scored by none), None where not asked: a chat's `content`
        (each token's text, bytes, logprob and top_logprobs), a completion's tokens,
        token_logprobs, top_logprobs (text -> logprob) and text_offset."""
        if self.gen.top_logprobs is None or not made:
            return None
        rows: list[Any] = self.gen.scored[self.answered:self.answered + len(made)]
        self.answered += len(made)
        if prompt:
            made = [*self._prompt_pieces(), *made]
            rows = [None, *self.gen.prompt_scored, *rows]
        token = self._token_text
        if self.chat:
            def entry(i: int, logprob: float) -> dict[str, Any]:
                text = token(i)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**entry(i, lp), "top_logprobs": [entry(j, p) for j, p in top]}
                                for (i, _), (lp, top) in zip(made, rows, strict=True)],
                    "refusal": None}
        offsets = []
        for _, piece in made:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": [token(i) for i, _ in made],
                "token_logprobs": [row[0] if row else None for row in rows],
                "top_logprobs": [{token(j): p for j, p in row[1]} if row else None
                                 for row in rows],
                "text_offset": offsets}

    def _prompt_pieces(self) -> list[tuple[int, str]]:
        """The prompt's tokens, each with the text it adds to the echoed prompt (decoded
        behind the tokens before it, as generated text is: `continued`); the last takes what
        is left of the echoed text (a prompt given as text: its own)."""
        prompt = self.gen.prompt
        if self.gen.tokenizer is None:
            return [(t, "") for t in prompt]
        texts = [continued(self.gen.tokenizer, prompt[:i], [t]) for i, t in enumerate(prompt)]
        texts[-1] = self.echo[sum(map(len, texts[:-1])):]
        return list(zip(prompt, texts, strict=True))

    def _token_text(self, token: int) -> str:
        """A token's own text (its tokenizer's, special tokens too); without a tokenizer
        "token_id:<id>", as vLLM writes it with return_tokens_as_token_ids."""
        tokenizer = self.gen.tokenizer
        return (f"token_id:{token}" if tokenizer is None
                else tokenizer.decode([token], skip_special_tokens=False))


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two deltas as one: their contents joined, their calls one after the other."""
    out = {**a, **b}
    for key in ("content", "tool_calls"):
        if key in a and key in b:
            out[key] = a[key] + b[key]
    return out


def _finish(gen: Generation) -> str:
    return "stop" if gen.stopped else "length"


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


async def _together(server: RestServer, answers: list[_Answer]) -> list[list[tuple[int, str]]]:
    """Every answer's tokens (`_all`), a quarter of the HTTP threads of them at a time; the
    first error once all have ended (none left generating behind it)."""
    limit = asyncio.Semaphore(max(1, server.threads // 4))

    async def one(answer: _Answer) -> list[tuple[int, str]]:
        try:
            async with limit:
                return await _all(server, answer.gen)
        except asyncio.CancelledError:  # (the caller went: one not run yet never runs)
            answer.gen.abandon()
            raise

    done = await asyncio.gather(*(one(a) for a in answers), return_exceptions=True)
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        raise failed[0]
    return done  # type: ignore[return-value]


async def _interleaved(server: RestServer, request: web.Request,
                       answers: list[_Answer]) -> web.StreamResponse:
    """A prompt's n choices streamed: each choice's chunks (its `index`) as its tokens come,
    its finish chunk when it ends, then (asked for) the usage of all and `[DONE]`; they
    generate as `_together`'s do. The first token or error of any decides the status; an
    error after it ends the stream with an event `{"error": ...}`; a caller that goes away
    ends every choice's generation at its next token."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    stop = threading.Event()
    running = _pulled(server, [a.gen for a in answers], queue, stop)
    try:
        first = await queue.get()
        if isinstance(first[1], Exception):
            raise refused(first[1])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        if await _choices_sent(response, answers, queue, first) and answers[0].with_usage:
            await _send(response, {**answers[0].head(), "choices": [],
                                   "usage": _usage(answers)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:  # done, failed or the caller gone: every choice's generation ends
        stop.set()
        for task in running:  # (their errors were said, or nobody is left to hear them)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _pulled(server: RestServer, gens: list[Generation], queue: asyncio.Queue[tuple[int, Any]],
            stop: threading.Event) -> list[asyncio.Future[None]]:
    """Each generation's tokens put on `queue` as (its place, the token), then (its place,
    _DONE) or (its place, its error), a quarter of the HTTP threads of them at a time; one
    that has not started when `stop` is set never starts, one running ends at its next token."""
    loop = asyncio.get_running_loop()
    limit = asyncio.Semaphore(max(1, server.threads // 4))

    def pull(j: int, gen: Generation) -> None:  # (on a pool thread)
        tokens = gen.tokens()
        try:
            for item in tokens:
                loop.call_soon_threadsafe(queue.put_nowait, (j, item))
                if stop.is_set():
                    break
            loop.call_soon_threadsafe(queue.put_nowait, (j, _DONE))
        except Exception as e:  # noqa: BLE001 - said in the stream (or as the status)
            loop.call_soon_threadsafe(queue.put_nowait, (j, e))
        finally:
            tokens.close()  # type: ignore[attr-defined]

    async def one(j: int, gen: Generation) -> None:
        async with limit:
            if stop.is_set():
                gen.abandon()
            else:
                await loop.run_in_executor(server.pool, pull, j, gen)

    return [asyncio.ensure_future(one(j, gen)) for j, gen in enumerate(gens)]


async def _choices_sent(response: web.StreamResponse, answers: list[_Answer],
                        queue: asyncio.Queue[tuple[int, Any]], item: tuple[int, Any]) -> bool:
    """Every choice's chunks from `queue` (`item` the first), as they come; whether all
    ended (not: one failed, its error sent)."""
    sent, left = [0] * len(answers), len(answers)
    while True:
        j, got = item
        answer = answers[j]
        if isinstance(got, Exception):
            await _send(response, _error_event(got, openai=True))
            return False
        if got is _DONE:
            for chunk in answer.ending():
                await _send(response, chunk)
            left -= 1
            if not left:
                return True
        else:
            sent[j] += 1
            token, piece = got
            await _send(response, answer.choice(piece, [(token, piece)], None,
                                                first=sent[j] == 1))
        item = await queue.get()


async def _send(response: web.StreamResponse, doc: Any) -> None:
    await response.write(b"data: " + orjson.dumps(doc) + b"\n\n")


def _error_event(e: Exception, openai: bool) -> dict[str, Any]:
    """A stream's event for an error after its first token (its status already sent)."""
    said = refused(e)
    return {"error": error_object(said.http or STATUS.get(status(said), 500), str(said))
            if openai else str(said)}


async def _all(server: RestServer, gen: Generation) -> list[tuple[int, str]]:
    """Every token and the text it added, once the generation ends."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(server.pool, lambda: list(gen.tokens()))
    except Exception as e:  # noqa: BLE001 - its kind decides the status
        raise refused(e) from None


async def _events(server: RestServer, request: web.Request, gen: Generation,
                  event: Callable[[int, str], Any],
                  done: Callable[[], list[Any]] | None = None,
                  openai: bool = False) -> web.StreamResponse:
    """Each token as a server-sent event, as it comes; the first token decides the status
    (an error before it is an ordinary error answer); `done`'s events after the last."""
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
            await _send(response, event(*item))
            pending = server.pool.submit(next, tokens, _DONE)
            try:
                item = await asyncio.wrap_future(pending)
            except Exception as e:  # noqa: BLE001 - said in the stream: the status is sent
                await _send(response, _error_event(e, openai))
                break
        if done is not None and item is _DONE:
            for last in done():
                await _send(response, last)
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
