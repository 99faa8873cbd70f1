"""OpenVINO GenAI's rows of bench_generation.py, run in the bench's own environment
(`make genai-env`: .venv-genai, pinned in pyproject.toml's `genai-bench` extra; optimum-intel
needs transformers < 5.6, older than the project's):

    .venv-genai/bin/python tests/bench/genai_row.py HF_DIR WORK_DIR PROMPT_JSON NEW

The transformers checkpoint in HF_DIR (the bench's random-weight Llama, saved) is exported by
optimum-intel at its defaults (OVModelForCausalLM, export=True: a stateful IR; a model under
1B parameters keeps fp32 weights) and generated from by LLMPipeline on the CPU, greedy, from
token ids (the model has no tokenizer), at the plugin's defaults and held to fp32 (VARIANTS).
Prints one JSON object; per variant: TTFT from 1-token generates (the median of TTFT_RUNS,
each on a prompt of its own, as the transformers row),
decode tokens/s from the whole run less its own TTFT, LLMPipeline's own TTFT/TPOT, the
generated ids and the prompt's logits error against transformers fp32 eager."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

# the pipelines measured: optimum-intel's export at its defaults, LLMPipeline at its defaults
# (on a CPU with bf16: bf16 compute and a u8 KV cache, unchecked), and the same IR held to
# fp32 (what a 1e-2 budget allows where bf16 is over it)
VARIANTS = {"default": {}, "f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}}
TTFT_RUNS = 5  # as bench_generation.py's


def main() -> dict:
    import openvino as ov
    import openvino_genai as genai
    from optimum.intel.openvino import OVModelForCausalLM

    hf_dir, work, prompt, new = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]), \
        int(sys.argv[4])
    t0 = time.perf_counter()
    OVModelForCausalLM.from_pretrained(hf_dir, export=True, compile=False).save_pretrained(
        work / "ov")
    report = {"export_s": round(time.perf_counter() - t0, 1),
              "weights_mb": round((work / "ov" / "openvino_model.bin").stat().st_size / 1e6),
              "versions": {"openvino": ov.__version__, "openvino_genai": genai.__version__}}
    for name, properties in VARIANTS.items():
        report[name] = pipeline_row(work / "ov", prompt, new, properties)
        report[name]["logits_error"] = logits_error(hf_dir, work / "ov", prompt, properties)
    return report


def pipeline_row(ov_dir: Path, prompt: list[int], new: int, properties: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    t0 = time.perf_counter()
    pipe = genai.LLMPipeline(str(ov_dir), "CPU", **properties)
    compile_s = time.perf_counter() - t0

    def run(ids: list[int], tokens: int) -> tuple[float, object]:
        array = np.array([ids], dtype=np.int64)
        config = genai.GenerationConfig()
        config.max_new_tokens, config.min_new_tokens, config.do_sample = tokens, tokens, False
        t = time.perf_counter()
        result = pipe.generate(genai.TokenizedInputs(ov.Tensor(array),
                                                     ov.Tensor(np.ones_like(array))), config)
        return time.perf_counter() - t, result

    # each run on a prompt it has not seen: the pipeline caches prefixes across requests
    run([(t + 1) % 32000 for t in prompt], 2)  # warm-up
    runs = [run([(t + 100 + i) % 32000 for t in prompt], 1)[0] for i in range(TTFT_RUNS)]
    ttft = sorted(runs)[len(runs) // 2]
    total, result = run(prompt, new)
    metrics = result.perf_metrics
    return {"ttft_s": round(ttft, 3), "ttft_runs_s": [round(t, 3) for t in runs],
            "decode_tok_s": round((new - 1) / (total - metrics.get_ttft().mean / 1e3), 2),
            "ids": [int(t) for t in result.tokens[0]],
            "own_ttft_ms": round(metrics.get_ttft().mean, 1),
            "own_tpot_ms": round(metrics.get_tpot().mean, 2), "compile_s": round(compile_s, 1),
            "properties": properties or "defaults"}


def logits_error(hf_dir: Path, ov_dir: Path, prompt: list[int], properties: dict) -> float:
    """The exported model's prompt logits on the CPU plugin with `properties` against
    transformers fp32 eager's: max |difference| / max |fp32| (the project's metric)."""
    import torch
    from optimum.intel.openvino import OVModelForCausalLM
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
        got = OVModelForCausalLM.from_pretrained(ov_dir, ov_config=dict(properties))(ids).logits
    return float((got - want).abs().max() / want.abs().max())


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    print(json.dumps(main()))
