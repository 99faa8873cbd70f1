"""Generation on this host: a Llama-architecture model sized for it (random weights, ~200M
parameters), a 128-token prompt and 128 generated tokens, batch 1, greedy, one run of each
in turn on the same weights:

    python tests/bench/bench_generation.py [--json] [--quick]

- transformers' `generate` (torch eager, its static cache: the same cache the export holds);
- cuvild, the model exported as a user would (transformers' TorchExportableModuleForDecoder
  OnlyLM, with a dynamic length: the prompt goes in chunks, 128 tokens in one) and served by
  a daemon on one CPU device, once warmed (its first request builds its buckets): through the Python
  client (gRPC streaming) and HTTP generate_stream (server-sent events);
- cuvild with 4 and 8 sequences at once (4, 8 clients) against 1, at fp32 and under the
  budget (where the decode step runs below fp32, several sequences' steps run on its fp32
  twin where that measures faster: docs/GENERATION.md);
- cuvild's prefix cache: a conversation's second turn to its first token, against a cold
  prompt as long.

Each figure: time to first token (TTFT: request sent to first token back; the median of
TTFT_RUNS requests, each on a prompt of its own, as every row takes it), decode tokens/s
(tokens after the first over their time), and the generated tokens' agreement with
transformers' (greedy at fp32: identical is expected); OpenVINO GenAI's LLMPipeline on the
same weights at its defaults and held to fp32, where `make genai-env` made its environment
(tests/bench/genai_row.py; else its row says so). `--quick`: 32 + 32 tokens.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))
sys.path.insert(2, str(ROOT / "tests" / "models"))

PROMPT, NEW = 128, 128
CONTEXT = 320
BUDGET = 1e-2  # the auto rows' error budget (engine.max_error)
TTFT_RUNS = 5  # a TTFT is the median of this many requests (one run's spread here: +-10%)


def variant(prompt: list[int], i: int) -> list[int]:
    """The prompt with every token moved by `i`: as long, not seen before (OpenVINO GenAI
    caches prefixes across requests)."""
    return [(t + i) % 32000 for t in prompt]


def median_ttft(ttft: Any, prompt: list[int], first: int) -> dict[str, Any]:
    """TTFT_RUNS TTFTs (`ttft(prompt)`) of prompts never seen (variants `first` on: each row
    its own), their median (a prompt seen before begins with tokens a kept sequence holds:
    cuvild's prefix cache, GenAI's)."""
    runs = [ttft(variant(prompt, first + i)) for i in range(TTFT_RUNS)]
    return {"ttft_s": round(statistics.median(runs), 3), "ttft_runs_s": [round(t, 3)
                                                                       for t in runs]}


def llama() -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=4, max_position_embeddings=CONTEXT)
    model = tf.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # variance-preserving weights: logits far apart, greedy stable
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    model.generation_config.cache_implementation = "static"
    return model


def transformers_row(model: Any, prompt: list[int], new: int) -> dict[str, Any]:
    """transformers' generate, eager, static cache: TTFT from 1-token generates (the median of
    TTFT_RUNS), decode from the whole run's time less that."""
    import torch

    x = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(x, max_new_tokens=2, do_sample=False, min_new_tokens=2, pad_token_id=0)
        runs = []
        for i in range(TTFT_RUNS):
            t0 = time.perf_counter()
            model.generate(torch.tensor([variant(prompt, 100 + i)]), max_new_tokens=1,
                           do_sample=False, min_new_tokens=1, pad_token_id=0)
            runs.append(time.perf_counter() - t0)
        ttft = statistics.median(runs)
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                             pad_token_id=0)
        total = time.perf_counter() - t0
    ids = out[0, len(prompt):].tolist()
    return {"ttft_s": round(ttft, 3), "ttft_runs_s": [round(t, 3) for t in runs],
            "decode_tok_s": round((new - 1) / (total - ttft), 2), "ids": ids}


def client_row(target: str, name: str, prompt: list[int], new: int) -> dict[str, Any]:
    from cuvild.client import Client

    with Client(target, timeout=3600) as client:
        t0 = time.perf_counter()
        stamps, ids = [], []
        for token in client.generate(name, prompt, max_tokens=new):
            stamps.append(time.perf_counter())
            ids.append(token["token_id"])
    return _row(t0, stamps, ids)


def http_row(address: str, name: str, prompt: list[int], new: int) -> dict[str, Any]:
    body = json.dumps({"input_ids": prompt, "max_tokens": new}).encode()
    request = urllib.request.Request(f"http://{address}/v2/models/{name}/generate_stream",
                                     data=body, headers={"Content-Type": "application/json"})
    stamps, ids = [], []
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as reply:
        for line in reply:
            if line.startswith(b"data: "):
                stamps.append(time.perf_counter())
                ids.append(json.loads(line[6:])["output_ids"][0])
    return _row(t0, stamps, ids)


def _row(t0: float, stamps: list[float], ids: list[int]) -> dict[str, Any]:
    decode = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return {"ttft_s": round(stamps[0] - t0, 3), "decode_tok_s": round(1 / decode, 2),
            "ids": ids}


def concurrent_row(target: str, name: str, prompt: list[int], new: int,
                   clients: int) -> dict[str, Any]:
    """`clients` sequences at once, each on a prompt of its own never seen: tokens/s of them
    all."""
    from cuvild.client import Client

    counts = [0] * clients

    def one(i: int) -> None:
        with Client(target, timeout=3600) as client:
            for _ in client.generate(name, variant(prompt, 200 + 10 * clients + i),
                                     max_tokens=new):
                counts[i] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "tokens": sum(counts), "tok_s": round(sum(counts) / wall, 2),
            "wall_s": round(wall, 1)}


GENAI_PYTHON = ROOT / ".venv-genai" / "bin" / "python"


def genai_rows(home: Path, prompt: list[int], new: int, reference: list[int]) -> dict[str, Any]:
    """OpenVINO GenAI's LLMPipeline on the same weights (tests/bench/genai_row.py, in its
    own environment: `make genai-env`), at its defaults and held to fp32."""
    import subprocess

    if not GENAI_PYTHON.exists():
        return {"skipped": f"{GENAI_PYTHON.parent.parent.name} is not there: `make genai-env` "
                           "makes it (optimum-intel needs an older transformers)"}
    (home / "genai").mkdir()
    done = subprocess.run([str(GENAI_PYTHON), str(Path(__file__).with_name("genai_row.py")),
                           str(home / "hf"), str(home / "genai"), json.dumps(prompt), str(new)],
                          capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        return {"skipped": f"genai_row.py failed: {done.stderr.strip()[-800:]}"}
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("default", "f32"):
        rows[name]["same_tokens_as_transformers"] = round(statistics.mean(
            a == b for a, b in zip(rows[name].pop("ids"), reference, strict=True)), 3)
    return rows


def served(home: Path, label: str, engine: dict[str, Any], prompt: list[int], new: int,
           reference: list[int], concurrent: bool) -> dict[str, Any]:
    """One daemon on one CPU device serving the repository's model under `engine`'s
    precision policy: its load, first request (its buckets built: under a budget each
    searches its precision), the client and HTTP rows, and (`concurrent`) 4 and 8 sequences
    vs 1."""
    from daemons import DaemonProcess, daemon_config, free_port, one_cpu

    from cuvild.client import Client

    report: dict[str, Any] = {}
    (home / label).mkdir()
    http = f"127.0.0.1:{free_port()}"
    config = daemon_config(home / label, home / label / "state", home,
                           model_repository=str(home / "repo"),
                           listen={"http": http, "insecure_loopback": True})
    config["devices"] = one_cpu()
    config["log_level"] = "info"
    config.setdefault("engine", {}).update(engine)
    daemon = DaemonProcess(home / label, config).start()
    try:
        t0 = time.perf_counter()
        with Client(daemon.target, timeout=3600) as control:  # the repository's entry
            while {m["name"]: m["state"] for m in control.models()}.get("llama") != "ready":
                if time.perf_counter() - t0 > 3600:
                    raise RuntimeError(f"llama not ready: {control.models()}")
                time.sleep(0.2)
        report["load_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()  # its buckets (the prompt's chunk, decode steps of 1)
        client_row(daemon.target, "llama", prompt, 2)
        report["first_request_s"] = round(time.perf_counter() - t0, 1)
        # its decode step compiles in the background from that request on
        # (runtimes/compiled_step.py): the rows are measured once it is compiled (and timed
        # by the next request's first step)
        decided(daemon.log_path)
        # a second one, not counted: the first request after a search measured ~0.1 s
        # slower to its first token (the losing variants' weights let go of meanwhile)
        report["second_request_ttft_s"] = client_row(daemon.target, "llama", prompt, 2)[
            "ttft_s"]
        with Client(daemon.target, timeout=3600) as control:
            buckets = control.plan("llama")["plan"].get("buckets", [])
        report["buckets"] = {"x".join(map(str, b["shapes"][0])): {
            "precision": b["parts"][0]["precision"], "why": b.get("precision", [])}
            for b in buckets}
        for k, (row_label, row) in enumerate((
                ("client", lambda p, n: client_row(daemon.target, "llama", p, n)),
                ("http_stream", lambda p, n: http_row(http, "llama", p, n)))):
            got = row(prompt, new)
            got.update(median_ttft(lambda p, row=row: row(p, 2)["ttft_s"], prompt,
                                   100 + 10 * k))
            got["same_tokens_as_transformers"] = round(statistics.mean(
                a == b for a, b in zip(got.pop("ids"), reference, strict=True)), 3)
            report[row_label] = got
        if concurrent:
            one = concurrent_row(daemon.target, "llama", prompt, new, 1)
            four = concurrent_row(daemon.target, "llama", prompt, new, 4)
            eight = concurrent_row(daemon.target, "llama", prompt, new, 8)
            report["concurrent"] = {"one": one, "four": four, "eight": eight,
                                    "ratio_eight": round(eight["tok_s"] / one["tok_s"], 2),
                                    "ratio": round(four["tok_s"] / one["tok_s"], 2)}
        report["prefix_cache"] = prefix_row(http, prompt)
        report["decode_step"] = decided(daemon.log_path, 0.0)
    finally:
        daemon.stop()
    return report


def prefix_row(address: str, prompt: list[int]) -> dict[str, Any]:
    """The prefix cache (docs/GENERATION.md): a conversation's second turn (a 192-token
    system prompt, a 16-token question, its 32-token answer, another question: 256 tokens),
    its time to one token against a cold prompt as long, TTFT_RUNS conversations each."""
    def first_token(doc: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        request = urllib.request.Request(f"http://{address}/v1/completions",
                                         data=json.dumps({"model": "llama", **doc}).encode(),
                                         headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as reply:
            return time.perf_counter() - t0, json.loads(reply.read())

    cold, warm, held = [], [], 0
    for i in range(TTFT_RUNS):
        system = variant(prompt, 300 + 2 * i) + variant(prompt, 301 + 2 * i)[:64]
        turn = system + variant(prompt, 400 + i)[:16]
        _, said = first_token({"prompt": turn, "max_tokens": 32, "ignore_eos": True})
        second = turn + said["choices"][0]["token_ids"] + variant(prompt, 500 + i)[:16]
        took, said = first_token({"prompt": second, "max_tokens": 1})
        warm.append(took)
        held = said["usage"]["prompt_tokens_details"]["cached_tokens"]
        cold.append(first_token({"prompt": variant(second, 600 + i), "max_tokens": 1})[0])
    return {"prompt": len(second), "held": held, "cold_s": round(statistics.median(cold), 3),
            "turn_s": round(statistics.median(warm), 3),
            "ratio": round(statistics.median(cold) / statistics.median(warm), 2)}


def decided(log: Path, timeout_s: float = 600.0) -> list[str]:
    """What the workers' log says of the compiled decode step, once it says anything (up
    to `timeout_s`)."""
    t0 = time.perf_counter()
    while True:
        said = [line.split("]: ", 1)[-1].strip() for line in log.read_text().splitlines()
                if "a decode step" in line]
        if said or time.perf_counter() - t0 >= timeout_s:
            return said
        time.sleep(0.5)


def main() -> dict[str, Any]:
    import lm_models
    import torch

    from runtimes.profiling import hardware

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    prompt_len, new = (32, 32) if "--quick" in sys.argv else (PROMPT, NEW)
    info = hardware.cpuinfo()
    report: dict[str, Any] = {"host": {"cpu": info["name"], "flags": hardware.cpu_features(
        info["flags"]), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__}}
    model = llama()
    report["model"] = {"parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6,
                                             1), "context": CONTEXT, "prompt": prompt_len,
                       "new_tokens": new}
    prompt = torch.randint(0, 32000, (prompt_len,), generator=torch.Generator().manual_seed(2)
                           ).tolist()
    report["transformers_eager"] = reference = transformers_row(model, prompt, new)
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-gen-") as tmp:
        home = Path(tmp)
        (home / "repo" / "llama" / "1").mkdir(parents=True)
        t0 = time.perf_counter()
        torch.export.save(lm_models.export(model, CONTEXT, dynamic=True),
                          home / "repo" / "llama" / "1" / "model.pt2")
        report["export_s"] = round(time.perf_counter() - t0, 1)
        model.save_pretrained(home / "hf")  # (OpenVINO GenAI's row exports it its own way)
        del model
        report["openvino_genai"] = genai_rows(home, prompt, new, reference["ids"])
        for label, engine in (("fp32", {}), ("auto", {"precision": "auto",
                                                        "max_error": BUDGET})):
            report[label] = served(home, label, engine, prompt, new, reference["ids"],
                                   concurrent=True)
    reference.pop("ids")
    return report


def show(r: dict[str, Any]) -> None:
    print(f"host: {r['host']['cpu']}, {r['host']['cores']} cores, flags {r['host']['flags']}, "
          f"torch {r['host']['torch']}")
    m = r["model"]
    print(f"Llama-architecture, {m['parameters_m']}M parameters (random), context {m['context']},"
          f" prompt {m['prompt']}, {m['new_tokens']} new tokens, greedy; export {r['export_s']} s")
    t = r["transformers_eager"]
    print(f"  transformers generate (eager fp32):  TTFT {t['ttft_s']:.3f} s, decode "
          f"{t['decode_tok_s']:.2f} tok/s")
    for policy in ("fp32", "auto"):
        p = r[policy]
        print(f"  cuvild {policy}{f' (budget {BUDGET:.0e})' if policy == 'auto' else ''}: load "
              f"{p['load_s']} s, first request (builds its buckets) {p['first_request_s']} s; "
              "buckets " + ", ".join(f"{k}: {v['precision']}" for k, v in p["buckets"].items()))
        for label in ("client", "http_stream"):
            c = p[label]
            decode = c["decode_tok_s"] / t["decode_tok_s"]
            print(f"    {label:<12} TTFT {c['ttft_s']:.3f} s ({c['ttft_s'] / t['ttft_s']:.2f}x), "
                  f"decode {c['decode_tok_s']:.2f} tok/s ({decode:.2f}x), tokens as "
                  f"transformers' {c['same_tokens_as_transformers']:.0%}")
        x = p["prefix_cache"]
        print(f"    prefix cache: a {x['prompt']}-token second turn ({x['held']} held) to its "
              f"first token {x['turn_s']:.3f} s, a cold prompt as long {x['cold_s']:.3f} s "
              f"({x['ratio']}x)")
        for why in (w for v in p["buckets"].values() for w in v["why"]):
            print(f"    {why}")
        for said in p.get("decode_step", []):
            print(f"    {said}")
    g = r["openvino_genai"]
    if "skipped" in g:
        print(f"  OpenVINO GenAI: not measured: {g['skipped']}")
    else:
        print(f"  OpenVINO GenAI {g['versions']['openvino_genai'].split('-')[0]} LLMPipeline "
              f"(optimum-intel export at its defaults, {g['weights_mb']} MB of weights; "
              f"export {g['export_s']} s):")
        for name in ("default", "f32"):
            v = g[name]
            print(f"    {name:<8} TTFT {v['ttft_s']:.3f} s, decode {v['decode_tok_s']:.2f} tok/s, "
                  f"logits error {v['logits_error']:.1e}, tokens as transformers' "
                  f"{v['same_tokens_as_transformers']:.0%} ({v['properties']})")
        auto, ov = r["auto"]["client"], g["default"]
        within = min((g[n] for n in ("default", "f32") if g[n]["logits_error"] <= BUDGET),
                     key=lambda v: -v["decode_tok_s"], default=None)
        print(f"  cuvild under {BUDGET:.0e} vs OpenVINO GenAI at its defaults: decode "
              f"{auto['decode_tok_s'] / ov['decode_tok_s']:.2f}x, TTFT "
              f"{auto['ttft_s'] / ov['ttft_s']:.2f}x"
              + (f"; vs its fastest within {BUDGET:.0e} ({within['properties']}): decode "
                 f"{auto['decode_tok_s'] / within['decode_tok_s']:.2f}x, TTFT "
                 f"{auto['ttft_s'] / within['ttft_s']:.2f}x" if within else ""))
    for policy in ("fp32", "auto"):
        c = r[policy]["concurrent"]
        print(f"  4 sequences at once ({policy}): {c['four']['tok_s']} generated tok/s vs 1: "
              f"{c['one']['tok_s']} tok/s = {c['ratio']}x; 8: {c['eight']['tok_s']} tok/s = "
              f"{c['ratio_eight']}x (each {r['model']['prompt']} prompt tokens and "
              f"{r['model']['new_tokens']} new; the prompt's time included)")


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        show(result)
