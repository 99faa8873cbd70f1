"""Embeddings on this host (a `make bench` section): a BERT of all-MiniLM-L6-v2's shape (384
wide, 6 layers, 12 heads; random weights, the tests' byte-level tokenizer), mean-pooled and
normalized as its sentence-transformers files say, on 32 texts of 28-32 tokens:

    python tests/bench/bench_embeddings.py [--json]

- the peers, each on the 32 texts as one batch padded to 32 tokens (what sentence-
  transformers' `encode` does at its batch_size 32), tokenizing and pooling included: torch
  eager (torch's threads: every core) and OpenVINO (`ov.convert_model` of the same model,
  compiled for the CPU at its defaults, which run bf16 where the CPU has it and check
  nothing, and held to fp32);
- cuvild's `/v1/embeddings` over HTTP, base64 as OpenAI's SDK asks (the daemon on one CPU
  device, every runtime `auto` may pick, batching at its defaults, as a user runs it): the
  32 texts in one request; 32 clients sending one text each at once (merged by the model's
  batcher); the 32 texts one request after another; and the one request again on the same
  model under a checked error budget of 1e-2 (`precision: auto`, the entry's config.yaml);
- reranking: a cross-encoder of ms-marco-MiniLM-L6-v2's shape scoring a short query against
  the same 32 texts: the peers on the pairs padded to the longest (sentence-transformers'
  CrossEncoder), cuvild's `/rerank` in one request (its pairs padded to a power of two), at
  fp32 and under the budget.

Each figure: texts (or pairs)/s, the median of ROUNDS rounds (each round all 32 texts), every shape
warmed first (cuvild builds a bucket per shape on first use); the largest difference of
cuvild's vectors from eager's; ratios against the fastest peer.
"""

from __future__ import annotations

import base64
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))
sys.path.insert(2, str(ROOT / "tests" / "serve"))
sys.path.insert(3, str(ROOT / "tests" / "models"))
from daemons import DaemonProcess, daemon_config, free_port, one_cpu  # noqa: E402
from generation_helpers import (  # noqa: E402
    all_ready,
    byte_tokenizer_json,
    cross_encoder_entry,
    encoder_entry,
)

from cuvild.client import Client  # noqa: E402

MINILM = (384, 6, 12, 1536)  # hidden, layers, heads, MLP width
PEERS = ("torch eager", "OpenVINO (its defaults)", "OpenVINO, fp32")
TEXTS, WIDTH, ROUNDS = 32, 32, 5
BUDGET = 1e-2  # the auto row's error budget


def texts() -> list[str]:
    """TEXTS texts of 28-32 tokens (a character a token, with <s> and </s>)."""
    words = "the quick brown fox jumps over a lazy dog near river bank at dawn".split()
    out = []
    for i in range(TEXTS):
        text = " ".join(words[(i + k) % len(words)] for k in range(8))
        out.append(text[:26 + i % 5])
    return out


def peer(encode: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[list[str]],
                                                                             np.ndarray]:
    """A peer's pipeline: tokenize, pad to WIDTH, run `encode`, mean-pool the attended
    tokens, normalize (sentence-transformers' steps)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(byte_tokenizer_json())

    def run(batch: list[str]) -> np.ndarray:
        ids = [e.ids for e in tokenizer.encode_batch(batch)]
        padded = np.array([i + [0] * (WIDTH - len(i)) for i in ids], dtype=np.int64)
        mask = np.array([[1] * len(i) + [0] * (WIDTH - len(i)) for i in ids], dtype=np.int64)
        hidden = encode(padded, mask)
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return run


def peers(bert: torch.nn.Module) -> dict[str, Callable[[list[str]], np.ndarray]]:
    import openvino as ov

    def eager(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return bert(input_ids=torch.from_numpy(ids),
                        attention_mask=torch.from_numpy(mask))[0].numpy()

    example = {"input_ids": torch.ones(2, 8, dtype=torch.long),
               "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    converted = ov.convert_model(bert, example_input=example)

    def openvino(hint: dict[str, str]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        compiled = ov.Core().compile_model(converted, "CPU", hint)
        return lambda ids, mask: compiled({"input_ids": ids, "attention_mask": mask})[0]

    return {"torch eager": peer(eager), "OpenVINO (its defaults)": peer(openvino({})),
            "OpenVINO, fp32": peer(openvino({"INFERENCE_PRECISION_HINT": "f32"}))}


def post(http: str, batch: list[str], model: str = "minilm") -> list[np.ndarray]:
    """The vectors of `batch`, asked as OpenAI's SDK asks them (base64)."""
    body = json.dumps({"model": model, "input": batch, "encoding_format": "base64"}).encode()
    request = urllib.request.Request(f"http://{http}/v1/embeddings", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32)
                for d in json.loads(reply.read())["data"]]


def served(http: str) -> dict[str, Callable[[list[str]], np.ndarray]]:
    def one_request(batch: list[str]) -> np.ndarray:
        return np.array(post(http, batch))

    def at_once(batch: list[str]) -> np.ndarray:
        got: list[Any] = [None] * len(batch)
        start = threading.Barrier(len(batch))

        def ask(i: int) -> None:
            start.wait()
            got[i] = post(http, [batch[i]])[0]
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(batch))]
        for t in askers:
            t.start()
        for t in askers:
            t.join()
        return np.array(got)

    def one_by_one(batch: list[str]) -> np.ndarray:
        return np.array([post(http, [text])[0] for text in batch])

    return {"cuvild, one request of 32": one_request,
            f"cuvild, {TEXTS} clients at once": at_once,
            "cuvild, 32 requests one by one": one_by_one,
            f"cuvild, one request, auto {BUDGET:.0e}": lambda batch: np.array(
                post(http, batch, "minilm-auto"))}


QUERY = "is it cold"


def rerank_peers(model: torch.nn.Module, root: Path) -> dict[str, Callable[[list[str]],
                                                                           np.ndarray]]:
    """The cross-encoder's scores of (QUERY, document) for each document, as sentence-
    transformers' CrossEncoder computes them (the pairs padded to the longest, the sigmoid of
    the logit), on torch eager and OpenVINO (its defaults, and fp32)."""
    import openvino as ov
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str((root / "rerank" / "tokenizer.json").read_text())

    def pairs(documents: list[str]) -> dict[str, np.ndarray]:
        encoded = [tokenizer.encode(QUERY, d) for d in documents]
        width = max(len(e.ids) for e in encoded)
        pad = [width - len(e.ids) for e in encoded]
        return {"input_ids": np.array([e.ids + [0] * k for e, k in zip(encoded, pad,
                                                                        strict=True)]),
                "attention_mask": np.array([[1] * len(e.ids) + [0] * k
                                            for e, k in zip(encoded, pad, strict=True)]),
                "token_type_ids": np.array([e.type_ids + [0] * k
                                            for e, k in zip(encoded, pad, strict=True)])}

    def eager(documents: list[str]) -> np.ndarray:
        with torch.no_grad():
            logits = model(**{k: torch.from_numpy(v) for k, v in pairs(documents).items()})
        return torch.sigmoid(logits.logits[:, 0]).numpy()

    example = {k: torch.ones(2, 8, dtype=torch.long) for k in ("input_ids", "attention_mask",
                                                               "token_type_ids")}
    converted = ov.convert_model(model, example_input=example)

    def openvino(hint: dict[str, str]) -> Callable[[list[str]], np.ndarray]:
        compiled = ov.Core().compile_model(converted, "CPU", hint)
        return lambda documents: 1 / (1 + np.exp(-compiled(pairs(documents))[0][:, 0]))

    return {"rerank: torch eager": eager, "rerank: OpenVINO (its defaults)": openvino({}),
            "rerank: OpenVINO, fp32": openvino({"INFERENCE_PRECISION_HINT": "f32"})}


def reranked(http: str, documents: list[str], model: str = "rerank") -> np.ndarray:
    """cuvild's /rerank scores of QUERY and `documents`, in their order."""
    body = json.dumps({"model": model, "query": QUERY, "documents": documents,
                       "return_documents": False}).encode()
    request = urllib.request.Request(f"http://{http}/rerank", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        results = json.loads(reply.read())["results"]
    return np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])])


def timed(run: Callable[[list[str]], np.ndarray], batch: list[str]) -> tuple[float, np.ndarray]:
    """texts/s (the median of ROUNDS rounds, after two warm-up rounds) and the vectors."""
    for _ in range(2):
        out = run(batch)
    seconds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        out = run(batch)
        seconds.append(time.perf_counter() - t0)
    return len(batch) / statistics.median(seconds), out


def cpu() -> str:
    """The host's CPU model and the flags that decide the peers' precisions."""
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "?")
    flags = set(next((line for line in info.splitlines() if line.startswith("flags")),
                     "").split())
    wanted = ["avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx512_fp16"]
    return (f"CPU: {model}, {' '.join(f for f in wanted if f in flags) or 'none'} of "
            f"{' '.join(wanted)}")


def entries(root: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The repository: the encoder and the cross-encoder, each also under the budget (its
    "-auto" copy); the two models."""
    bert = encoder_entry(root / "minilm", MINILM, pooling="mean", most=(64, 127))
    cross = cross_encoder_entry(root / "rerank", size=MINILM, most=64)
    for name in ("minilm", "rerank"):
        shutil.copytree(root / name, root / f"{name}-auto")
        (root / f"{name}-auto" / "config.yaml").write_text(
            f"precision: auto\nmax_error: {BUDGET}\n")
    return bert, cross


def peer_rows(bert: torch.nn.Module, cross: torch.nn.Module, root: Path,
              batch: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """The peers' rows, and torch eager's outputs (embeddings', rerank's) to check by."""
    rows: dict[str, dict[str, Any]] = {}
    eager: dict[str, np.ndarray] = {}
    for name, run in [*peers(bert).items(), *rerank_peers(cross, root).items()]:
        rate, out = timed(run, batch)
        kind = "rerank" if name.startswith("rerank") else "embed"
        eager.setdefault(kind, out)
        rows[name] = {"texts_per_s": rate, "max_diff_vs_eager": float(
            np.abs(out - eager[kind]).max())}
    return rows, eager


def served_rows(daemon: DaemonProcess, http: str, batch: list[str],
                eager: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """cuvild's rows, with how the [32, 32] bucket runs and how the batcher merged rows."""
    rows: dict[str, dict[str, Any]] = {}
    runs = [*((name, run, "embed") for name, run in served(http).items()),
            *((row, lambda documents, m=model: reranked(http, documents, m), "rerank")
              for model, row in (("rerank", "rerank: cuvild, one request of 32"),
                                 ("rerank-auto",
                                  f"rerank: cuvild, one request, auto {BUDGET:.0e}")))]
    for name, run, kind in runs:
        rate, out = timed(run, batch)
        rows[name] = {"texts_per_s": rate,
                      "max_diff_vs_eager": float(np.abs(out - eager[kind]).max())}
    with Client(daemon.target) as control:
        batching = next(m for m in control.models() if m["name"] == "minilm")["batching"]
        rows[f"cuvild, {TEXTS} clients at once"]["runs_by_rows"] = batching["sizes"]
        for model, row in (("minilm", "cuvild, one request of 32"),
                           ("minilm-auto", f"cuvild, one request, auto {BUDGET:.0e}")):
            rows[row]["runs_as"] = [
                f"{p['device']} {p.get('runtime')} {p.get('precision')}"
                for b in control.plan(model)["plan"]["buckets"]
                if b["shapes"][0] == [TEXTS, WIDTH] for p in b.get("parts", [])]
    return rows


def main() -> None:
    work, sock = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(dir="/tmp"))
    root = work / "models"
    bert, cross = entries(root)
    batch = texts()
    rows, eager = peer_rows(bert, cross, root, batch)
    http = f"127.0.0.1:{free_port()}"
    config = daemon_config(work, work / "state", sock, log_level="info",
                           model_repository=str(root),
                           listen={"http": http, "insecure_loopback": True})
    config["devices"] = one_cpu()  # (replaced whole: daemon_config merges sections)
    daemon = DaemonProcess(work, config).start()
    try:
        all_ready(daemon.target, ("minilm", "minilm-auto", "rerank", "rerank-auto"),
                  timeout=900)
        rows.update(served_rows(daemon, http, batch, eager))
    finally:
        daemon.close()
    for kind, peers_of in (("", PEERS), ("rerank", [f"rerank: {n}" for n in PEERS])):
        best = max(rows[name]["texts_per_s"] for name in peers_of)
        for name, row in rows.items():
            if name.startswith("rerank") == bool(kind):
                row["vs_fastest_peer"] = row["texts_per_s"] / best
    if "--json" in sys.argv:
        print(json.dumps({"cpu": cpu(), "torch": torch.__version__, "texts": TEXTS,
                          "width": WIDTH, "rows": rows}, indent=1))
        return
    print(f"{cpu()}\nMiniLM-shaped BERT (random weights), {TEXTS} texts of 28-32 tokens, padded to "
          f"{WIDTH}; texts (pairs) a second, median of {ROUNDS} rounds; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    for name, row in rows.items():
        print(f"  {name:44s} {row['texts_per_s']:8.1f}/s  {row['vs_fastest_peer']:5.2f}x "
              f"the fastest peer   max |diff| vs eager {row['max_diff_vs_eager']:.1e}"
              + (f"   runs as {row['runs_as']}" if "runs_as" in row else "")
              + (f"   runs by rows {row['runs_by_rows']}" if "runs_by_rows" in row else ""))


if __name__ == "__main__":
    main()
