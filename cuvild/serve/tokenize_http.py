"""vLLM's `/tokenize` and `/detokenize` over HTTP: a served language model's prompt (or an
encoder's input: cuvild/serve/embeddings.py) as the daemon makes it, for clients that count
or build prompts in tokens (an RL trainer's rollouts, a context-window check before a
request, a RAG chunker) without a tokenizer of their own that could differ.

    POST /tokenize    {"model", "prompt": text, "add_special_tokens": true,
                       "return_token_strs": false}
                   or {"model", "messages": [...], "tools": [...], "add_generation_prompt":
                       true, "add_special_tokens": false, "return_token_strs": false}
                   -> {"count", "max_model_len", "tokens": [ids], "token_strs": [..] | null}
    POST /detokenize  {"model", "tokens": [ids]} -> {"prompt": text}

The messages are rendered by the entry's chat template as /v1/chat/completions renders them
(cuvild/serve/chat.py), its tools too; the text is tokenized by the entry's tokenizer.json,
the special tokens added as vLLM adds them by default (a prompt's yes, a chat's no: its
template writes them). Detokenized, special tokens stay in the text (the ids round-trip).
Errors are OpenAI's error objects, as vLLM's.
"""

from __future__ import annotations

from typing import Any

from cuvild.core.layout import BadInput
from cuvild.serve import chat, embeddings, tools
from cuvild.serve.errors import Refused, find
from cuvild.serve.generation import TOKENIZER, Generator, generates
from cuvild.serve.openai_request import named

ROUTES = ("/tokenize", "/detokenize")
TOKENIZE = {"model", "prompt", "messages", "tools", "add_special_tokens", "return_token_strs",
            *chat.OPTIONS}
MAX_IDS = 1 << 20


def tokenize(generator: Generator, doc: Any) -> dict[str, Any]:
    """/tokenize's answer to a request `doc` (on a pool thread: a template renders)."""
    served, tokenizer = _model(generator, doc, TOKENIZE)
    messages = doc.get("messages")
    if (messages is None) == (doc.get("prompt") is None):
        raise BadInput("give either \"prompt\" (text) or \"messages\" (a chat's)")
    special = _flag(doc, "add_special_tokens", messages is None)
    if messages is None:
        text = doc["prompt"]
        if not isinstance(text, str):
            raise BadInput(f"prompt must be text, got {type(text).__name__}")
    else:
        template = generator.chat_template(served.record.name, served.record.version)
        if template is None:
            raise Refused("invalid", f"model {served.key} has no chat template "
                          f"({chat.TEMPLATE_FILE}, or chat_template in {chat.CONFIG_FILE}): "
                          "tokenize a prompt instead of messages")
        asked = tools.asked({"tools": doc.get("tools")}) if doc.get("tools") else None
        text = template.render(chat.messages_of(messages), asked and asked.tools,
                               **chat.options_of(doc))
    encoded = tokenizer.encode(text, add_special_tokens=special)
    return {"count": len(encoded.ids), "max_model_len": max_model_len(generator, served),
            "tokens": list(encoded.ids),
            "token_strs": list(encoded.tokens) if _flag(doc, "return_token_strs", False)
            else None}


def max_model_len(generator: Generator, served: Any) -> int | None:
    """The most tokens a served model takes (vLLM's max_model_len): a language model's
    context, an encoder's bound (cuvild/serve/embeddings.py); None for any other model."""
    if generates(served.loaded):
        return served.loaded.state.context
    return embeddings.embeds(generator, served)


def models_listed(generator: Generator, wanted: str | None) -> dict[str, Any]:
    """OpenAI's model list (GET /v1/models), or model `wanted` of it (GET
    /v1/models/{model}): the served models that generate or embed (`name`, and
    `name:version` for each version), each with its `max_model_len`. Another model is not
    found."""
    listed = {}
    for served in sorted(generator.models.all(), key=lambda m: m.record.created_at):
        most = (max_model_len(generator, served)
                if served.state == "READY" and served.loaded is not None else None)
        if most:
            one = {"object": "model", "created": int(served.record.created_at),
                   "owned_by": "cuvild", "max_model_len": most}
            listed[served.record.name] = {"id": served.record.name, **one}  # (the newest)
            listed[served.key] = {"id": served.key, **one}
    if wanted is None:
        return {"object": "list", "data": list(listed.values())}
    if wanted not in listed:
        raise Refused("not_found", f"no model {wanted!r} that generates or embeds is served")
    return listed[wanted]


def detokenize(generator: Generator, doc: Any) -> dict[str, Any]:
    """/detokenize's answer: the ids' text, special tokens kept."""
    _, tokenizer = _model(generator, doc, {"model", "tokens"})
    ids, size = doc.get("tokens"), tokenizer.get_vocab_size()
    if (not isinstance(ids, list) or len(ids) > MAX_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise BadInput(f"tokens must be a list of at most {MAX_IDS} token ids (integers)")
    wrong = [t for t in ids if not 0 <= t < size]
    if wrong:
        raise BadInput(f"token ids {wrong[:8]} are not in the tokenizer's vocabulary "
                       f"(0..{size - 1})")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def _model(generator: Generator, doc: Any, fields: set[str]) -> tuple[Any, Any]:
    """The served model a request names (it generates, or embeds: cuvild/serve/
    embeddings.py) and its entry's tokenizer."""
    name, version = named(doc, fields)
    served = find(generator.models, name, version)
    if not generates(served.loaded):
        embeddings.bounds(generator, served)  # (refused where it takes no token ids)
    tokenizer = generator.tokenizer(served.record.name, served.record.version)
    if tokenizer is None:
        raise Refused("invalid", f"model {served.key} has no tokenizer ({TOKENIZER} in its "
                      "model repository entry)")
    return served, tokenizer


def _flag(doc: dict[str, Any], name: str, default: bool) -> bool:
    value = doc.get(name, default)
    if not isinstance(value, bool):
        raise BadInput(f"{name} must be true or false, got {value!r}")
    return value
