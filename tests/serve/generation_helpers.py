"""What tests/serve/test_generation.py's tests share: the model repository they serve, the
tiny vocabulary's words, a tokenizer and chat template over them, HTTP calls, and
transformers' own greedy scores."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import lm_models
import torch

PROMPT = [5, 17, 42, 99]
# a chat template over the tiny vocabulary: "w4 w1 <user's words> w2" for one user message
CHAT_TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}w1 "
                 "{% else %}w3 {% endif %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w2{% endif %}")
WORDS = [f"w{i}" for i in range(lm_models.VOCAB)]
BYTES_CONTEXT = 1024  # the byte-level entry's context: a character a token
# the byte-level entry's: Hermes-like, the tools and earlier calls written as JSON by tojson
# (a reasoning model's, as Qwen3's: an earlier answer's thinking left out of the prompt)
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}"
    "{% endfor %}</tools>\n{% endif %}{% for m in messages %}<{{ m.role }}>"
    "{{ m.content.split('</think>')[-1] if m.content else '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


# the repository's entries that do not generate (each READY at its own time after the LMs)
ENCODERS = ("embed", "rerank", "classify")


def lm_repository(root: Path) -> dict[str, Any]:
    """A model repository under `root`: the tiny Llama (a tokenizer and chat template beside
    it), GPT-2 without one, and the Llama exported with a dynamic length ("chunked": the
    prompt in chunks); returns the transformers models by family."""
    refs = {}
    for family in ("llama", "gpt2"):
        hf = lm_models.lm(family)
        (root / family / "1").mkdir(parents=True)
        torch.export.save(lm_models.export(hf), root / family / "1" / "model.pt2")
        refs[family] = hf
    (root / "llama" / "tokenizer.json").write_text(tokenizer_json())
    (root / "llama" / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "w4"}, "eos_token": "w6", "chat_template": CHAT_TEMPLATE}))
    (root / "chunked" / "1").mkdir(parents=True)
    torch.export.save(lm_models.export(refs["llama"], dynamic=True),
                      root / "chunked" / "1" / "model.pt2")
    (root / "bytes" / "1").mkdir(parents=True)  # the Llama, with a byte-level tokenizer
    torch.export.save(lm_models.export(refs["llama"], BYTES_CONTEXT),  # (tools' JSON is long)
                      root / "bytes" / "1" / "model.pt2")
    (root / "bytes" / "tokenizer.json").write_text(byte_tokenizer_json())
    (root / "bytes" / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (root / "bytes" / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": TOOLS_TEMPLATE}))
    refs["embed"] = encoder_entry(root / "embed")
    refs["rerank"] = cross_encoder_entry(root / "rerank")
    refs["classify"] = cross_encoder_entry(root / "classify", ["negative", "neutral", "positive"])
    return refs


def encoder_entry(entry: Path, size: tuple[int, ...] = (32, 2, 2, 64), pooling: str = "cls",
                  most: tuple[int, int] = (16, 63)) -> Any:
    """A BERT exported as transformers' AutoModel is (input_ids and attention_mask, its batch
    and length dynamic up to `most`), the byte-level tokenizer and sentence-transformers'
    pooling files (`pooling`: "cls" or "mean"; normalized) beside it: /v1/embeddings' model
    (cuvild/serve/embeddings.py). `size`: hidden width, layers, heads, MLP width (tiny by
    default; the bench's is MiniLM's: tests/bench/bench_embeddings.py)."""
    import transformers

    from partitioner.annotate import export

    torch.manual_seed(0)
    hidden, layers, heads, mlp = size
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=lm_models.VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=mlp,
        max_position_embeddings=most[1] + 1, pad_token_id=0)).eval()
    ids = torch.arange(5, 21).reshape(2, 8)
    rows, seq = torch.export.Dim("rows", max=most[0]), torch.export.Dim("seq", min=2,
                                                                        max=most[1])
    (entry / "1").mkdir(parents=True)
    torch.export.save(export(bert, (), kwargs={"input_ids": ids, "attention_mask": ids * 0 + 1},
                             dynamic_shapes={"input_ids": {0: rows, 1: seq},
                                             "attention_mask": {0: rows, 1: seq}}),
                      entry / "1" / "model.pt2")
    (entry / "tokenizer.json").write_text(byte_tokenizer_json())
    (entry / "1_Pooling").mkdir()
    (entry / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean"}))
    (entry / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    return bert


def cross_encoder_entry(entry: Path, labels: list[str] | None = None,
                        size: tuple[int, ...] = (32, 2, 2, 64), most: int = 16) -> Any:
    """A tiny cross-encoder (transformers' BertForSequenceClassification with one label,
    its three inputs' batch and length dynamic) and the byte-level tokenizer writing a pair
    as BERT's post-processor does ("<s> query </s> document </s>", the document's type 1):
    /rerank's model (cuvild/serve/rerank.py); with `labels`, a classifier of those labels,
    its config.json beside it (/classify's: cuvild/serve/classify.py). `size` as
    encoder_entry's; `most` the rows a run takes."""
    import transformers
    from tokenizers import Tokenizer, processors

    from partitioner.annotate import export

    torch.manual_seed(1)
    hidden, layers, heads, mlp = size
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=lm_models.VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=mlp, max_position_embeddings=128,
        pad_token_id=0,
        num_labels=len(labels or [None]), id2label=dict(enumerate(labels or ["LABEL_0"])))
        ).eval()
    ids = torch.arange(5, 21).reshape(2, 8)
    rows, seq = torch.export.Dim("rows", max=most), torch.export.Dim("seq", min=2, max=127)
    names = ("input_ids", "attention_mask", "token_type_ids")
    (entry / "1").mkdir(parents=True)
    torch.export.save(export(model, (), kwargs=dict(zip(names, (ids, ids * 0 + 1, ids * 0),
                                                         strict=True)),
                             dynamic_shapes={n: {0: rows, 1: seq} for n in names}),
                      entry / "1" / "model.pt2")
    tokenizer = Tokenizer.from_str(byte_tokenizer_json())
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", 0), ("</s>", 1)])
    (entry / "tokenizer.json").write_text(tokenizer.to_str())
    if labels:
        model.config.to_json_file(entry / "config.json")
    return model


def all_ready(target: str, names: tuple[str, ...], timeout: float = 300) -> None:
    """Once the daemon at `target` serves every model of `names`."""
    from cuvild.client import Client

    with Client(target) as client:
        deadline = time.monotonic() + timeout
        while any({m["name"]: m["state"] for m in client.models()}.get(n) != "ready"
                  for n in names):
            assert time.monotonic() < deadline, client.models()
            time.sleep(0.1)


def tokenizer_json() -> str:
    """A word-level tokenizer over the tiny vocabulary: "w5 w17" <-> [5, 17]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return tok.to_str()


def byte_tokenizer_json() -> str:
    """A byte-level BPE tokenizer (GPT-2's kind, which llguidance reads) of one token a
    printable ASCII character: "<s>" 0, "</s>" 1 (end of sequence), "!" .. "~" 2 .. 95, a
    space 96, a newline 97 (of the model's 128 logits, 98 .. 127 are no token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{chr(b): b - 31 for b in range(33, 127)},
             "\u0120": 96, "\u010a": 97}  # (the byte-level alphabet's space and newline)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok.to_str()


def post(address: str, path: str, doc: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def events(body: bytes) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != b"[DONE]" else "[DONE]"
            for line in body.split(b"\n") if line.startswith(b"data: ")]


def transformers_greedy(hf: Any, prompt: list[int], new: int, frequency: float = 0.0,
                        presence: float = 0.0, bias: dict[int, float] | None = None,
                        ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' model run whole on the tokens so far at each step, greedy on its last
    logits plus OpenAI's logit `bias` less its penalties for the tokens generated before:
    the tokens and each step's log-probabilities (the softmax of its raw logits)."""
    ids, made, scores = list(prompt), [], []
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(made, dtype=torch.long),
                                    minlength=logits.numel()).double()
            added = torch.zeros_like(logits)
            for t, b in (bias or {}).items():
                added[t] = b
            token = int(torch.argmax(logits + added - frequency * counts
                                     - presence * (counts > 0)))
            scores.append(torch.log_softmax(logits, -1))
            ids.append(token)
            made.append(token)
    return made, scores


def transformers_loglikelihood(hf: Any, context: list[int],
                               continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context by transformers' logits, and
    whether each of its tokens is its position's likeliest (lm-eval's `is_greedy`)."""
    ids = context + continuation
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    at = range(len(context), len(ids))
    return (float(sum(scores[i - 1, ids[i]] for i in at)),
            all(int(scores[i - 1].argmax()) == ids[i] for i in at))
