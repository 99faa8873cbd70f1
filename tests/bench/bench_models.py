"""The model families users bring, at realistic sizes, one run, side by side:

    python tests/bench/bench_models.py [--json] [--quick] [--rounds N] [--models a,b]
                                       [--auto 1e-2,5e-2 | --auto none] [--calibrate N]
                                       [--timing interleaved | blocks]

ResNet-50, ResNet-18, MobileNetV2 and ViT-Base (224x224, batch 1), BERT-base with 4 layers and a
4-layer Llama (hidden 512; 128 tokens, batch 1), built with transformers from their configs
(seeded random weights). Per model: cuvild's load time (upload to READY, every runtime tried:
the default config, one CPU device on every core, fp32) and its plan (parts, runtime,
precision); p50 / p99 ms through the fast path (`Client(fast=True)`) and through tritonclient
with system shared memory; in this process, OpenVINO on its default settings (its own precision:
bf16 on a CPU that has it), ONNX Runtime fp32 and torch eager; and each one's relative error
against eager on the first output, on the load's sample (seed 0, the one it is timed on) and
over four held-out inputs (seeds 100-103: none the daemon checked), read against the range the
outputs take over the four, as a budget is (runtimes/base.py set_error). Timed alone in turn
(timing.py `in_blocks`: each runner 5 calls back to back, the runners in turn, `--rounds` calls
each in all), so that no other runner's threads wake between a runner's calls: timed call by
call (`--timing interleaved`), OpenVINO's threads in this process and the worker's slowed each
other (ResNet-50 bf16 through the fast path read 1.07x OpenVINO's default interleaved, 0.98x
alone in turn, same build, 2-core EPYC). `--quick`: ResNet-50 and BERT only, fewer rounds.
`--auto B1,B2` (default 1e-2,5e-2, as `make bench` runs it; `none`: fp32 only): the model loaded
again under `precision="auto"` at each budget (its own fast-path row, the plan's precisions and
which groups stayed fp32), and OpenVINO with `INFERENCE_PRECISION_HINT=f32` beside its default.
A one-part plan's fast path and shm rows are also read against the runtime it chose, compiled
here at fp32 (`x_same_runtime`: the serving paths' cost over that runtime's own run).
`--calibrate N`: each budget's model loaded once more with N calibration inputs (seeds 200 on;
int8 is then tried, with its back-off). ConvNeXt-T and Swin-T are in the default list too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(Path(__file__).resolve().parent))
from daemons import DaemonProcess, daemon_config, one_cpu  # noqa: E402
from timing import in_blocks, interleaved, rel_error, stats  # noqa: E402

from cuvild.client import Client  # noqa: E402
from runtimes.base import set_error  # noqa: E402
from runtimes.profiling import hardware  # noqa: E402

SEQ = 128
CLASSES = 1000
# The inputs each runner's error is measured on: none of them is one the daemon checked
# (sample_inputs' seeds 0-3 draw the same values for a float input) or loaded with.
HELD_OUT = (100, 101, 102, 103)
CALIBRATION_SEED = 200  # --calibrate's inputs: seeds 200 on (neither checked nor held out)
BLOCK_SIZE = 5
# a runtime a plan may choose -> its fp32 runner here
SAME_RUNTIME = {"openvino": "openvino f32 (in-process)",
                "onnxruntime": "onnxruntime fp32 (in-process)"}


def families() -> dict[str, Callable[[], tuple[torch.nn.Module,
                                                Callable[[int], dict[str, torch.Tensor]]]]]:
    """Per model: its maker, returning the model and its inputs by seed (0: the sample the
    daemon loads it with, and the one it is timed on; HELD_OUT: its errors)."""
    import transformers as tf

    # A generator per model: a model's input does not depend on which others run before it.
    def image(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(1, 3, 224, 224, generator=gen)}

    def text(vocab: int, mask: bool) -> Callable[[int], dict[str, torch.Tensor]]:
        def make(seed: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(seed)
            ids = {"input_ids": torch.randint(0, vocab, (1, SEQ), generator=gen)}
            return ({**ids, "attention_mask": torch.ones(1, SEQ, dtype=torch.long)} if mask
                    else ids)
        return make

    return {
        # ImageNet's 1,000 classes, as the published checkpoints have (a config's default
        # head has two: two random logits can both sit near zero on an input)
        "resnet50": lambda: (tf.ResNetForImageClassification(tf.ResNetConfig(
            num_labels=CLASSES)), image),
        "resnet18": lambda: (tf.ResNetForImageClassification(tf.ResNetConfig(
            layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
            num_labels=CLASSES)), image),
        "mobilenet-v2": lambda: (tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
            num_labels=CLASSES)), image),
        "vit-base": lambda: (tf.ViTForImageClassification(tf.ViTConfig(num_labels=CLASSES)),
                             image),
        "convnext-tiny": lambda: (tf.ConvNextForImageClassification(tf.ConvNextConfig(
            num_labels=CLASSES)), image),
        "swin-tiny": lambda: (tf.SwinForImageClassification(tf.SwinConfig(
            num_labels=CLASSES)), image),
        "bert-base-4l": lambda: (tf.BertModel(tf.BertConfig(num_hidden_layers=4)),
                                 text(30522, True)),
        "llama-4l": lambda: (tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=8, use_cache=False)), text(32000, True)),
    }


def in_process(ep: Any, feed: dict[str, np.ndarray], threads: int,
               tmp: Path) -> tuple[dict[str, Callable[..., Any]], str]:
    """OpenVINO on its defaults and ONNX Runtime fp32, compiled here; OpenVINO's precision.
    Each runner runs `feed` unless given another."""
    import openvino as ov

    from runtimes.onnxruntime import open_session

    runners: dict[str, Callable[..., Any]] = {}
    onnx_path = tmp / f"{uuid.uuid4().hex[:8]}.onnx"
    try:
        torch.onnx.export(ep, (), kwargs={k: torch.from_numpy(v) for k, v in feed.items()},
                          dynamo=True, verbose=False).save(str(onnx_path))
    except Exception as e:  # noqa: BLE001 - a peer that cannot take the model is a finding
        first = str(e).strip().splitlines()[-1][:160] if str(e).strip() else ""
        print(f"  onnxruntime fp32: torch.onnx.export failed ({type(e).__name__}: {first}); "
              "no row", file=sys.stderr, flush=True)
    else:
        session = open_session(onnx_path, threads)
        names = [i.name for i in session.get_inputs()]
        runners["onnxruntime fp32 (in-process)"] = lambda f=feed: session.run(
            None, {n: f[n] for n in names})[0]
    for label, hint in (("openvino default (in-process)", {}),
                        ("openvino f32 (in-process)", {"INFERENCE_PRECISION_HINT": "f32"})):
        compiled = ov.Core().compile_model(ov.convert_model(ep), "CPU",
                                           {"INFERENCE_NUM_THREADS": threads,
                                            "PERFORMANCE_HINT": "LATENCY", **hint})
        request = compiled.create_infer_request()
        runners[label] = lambda f=feed, r=request: r.infer(
            list(f.values()), share_inputs=True)[0].copy()
        if not hint:
            precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    return runners, precision


def triton_shm(target: str, name: str, feed: dict[str, np.ndarray], output: str,
               out_shape: list[int]) -> tuple[Callable[..., Any], Callable[[], None]]:
    """A tritonclient request with every input and the first output in system shared memory
    (its inputs written there once; another feed is written before its run)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    client = grpcclient.InferenceServerClient(url=target)
    key = f"cuvil-bench-models-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    handles, inputs = [], []
    for i, (n, a) in enumerate(feed.items()):
        h = shm.create_shared_memory_region(f"in{i}", f"/{key}-in{i}", a.nbytes)
        shm.set_shared_memory_region(h, [a])
        client.register_system_shared_memory(f"{key}-in{i}", f"/{key}-in{i}", a.nbytes)
        x = grpcclient.InferInput(n, list(a.shape), "INT64" if a.dtype == np.int64 else "FP32")
        x.set_shared_memory(f"{key}-in{i}", a.nbytes)
        handles.append(h)
        inputs.append(x)
    nbytes = int(np.prod(out_shape)) * 4
    out_h = shm.create_shared_memory_region("out", f"/{key}-out", nbytes)
    client.register_system_shared_memory(f"{key}-out", f"/{key}-out", nbytes)
    out = grpcclient.InferRequestedOutput(output)
    out.set_shared_memory(f"{key}-out", nbytes)

    def run(other: dict[str, np.ndarray] | None = None) -> Any:
        if other is not None:
            for h, a in zip(handles, other.values(), strict=True):
                shm.set_shared_memory_region(h, [a])
        client.infer(name, inputs, outputs=[out])
        return shm.get_contents_as_numpy(out_h, np.float32, out_shape).copy()

    def close() -> None:
        for h, a in zip(handles, feed.values(), strict=True):  # as it was timed
            shm.set_shared_memory_region(h, [a])
        client.unregister_system_shared_memory()
        for h in [*handles, out_h]:
            shm.destroy_shared_memory_region(h)
        client.close()

    return run, close


def one_model(name: str, make: Callable[[], Any], target: str, rounds: int, threads: int,  # noqa: PLR0915 - one model's table, row by row
              tmp: Path, budgets: list[float], calibrate: int = 0,
              blocks: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs_of = make()
    model.eval()
    kwargs = inputs_of(0)

    def eager(given: dict[str, torch.Tensor] = kwargs) -> Any:
        with torch.no_grad():
            return next(iter(model(**given).values())).numpy()

    expected = eager()
    feed = {k: v.numpy() for k, v in kwargs.items()}
    ep = torch.export.export(model, (), kwargs)
    runners, ov_precision = in_process(ep, feed, threads, tmp)
    runners["torch eager (in-process)"] = lambda f=feed: eager(
        {k: torch.from_numpy(v) for k, v in f.items()})
    with Client(target, timeout=1800) as client:
        t0 = time.perf_counter()
        summary = client.load(name, model, kwargs=kwargs, timeout=1800)["model"]
        load_s = time.perf_counter() - t0
        plan = client.plan(name)["plan"]
        output = summary["outputs"][0]["name"]
    fast = Client(target, fast=True)

    def served(model_name: str) -> Callable[..., Any]:
        return lambda f=feed: fast.infer(model_name, {k: torch.from_numpy(v) for k, v in
                                                      f.items()})[output].numpy()

    runners["cuvild fast path"] = served(name)
    chosen: dict[str, Any] = {}
    calibration = [inputs_of(CALIBRATION_SEED + i) for i in range(calibrate)]
    for budget, calibrated in [(b, c) for b in budgets for c in (False, True)
                               if calibration or not c]:
        label = f"{budget:.0e}" + (" + calibration" if calibrated else "")
        auto = f"{name}-auto-{budget:.0e}" + ("-c" if calibrated else "")
        with Client(target, timeout=1800) as client:
            t0 = time.perf_counter()
            client.load(auto, model, kwargs=kwargs, precision="auto", max_error=budget,
                        calibration=calibration if calibrated else None, timeout=1800)
            report = client.compare(auto)
            chosen[label] = {
                "load_s": round(time.perf_counter() - t0, 1),
                "plan": [f"{p['id']} {p['runtime']} {p['precision']}"
                         for p in client.plan(auto)["plan"]["parts"]],
                "notes": [n for n in report.get("notes", []) if " runs " in n
                          or " refused" in n or " stays " in n]}
        runners[f"cuvild auto {label} fast path"] = served(auto)
    shm_run, shm_close = triton_shm(target, name, feed, output, list(expected.shape))
    runners["cuvild tritonclient shm"] = shm_run
    try:
        errors = {k: rel_error(run(), expected) for k, run in runners.items()}
        others = [{k: v.numpy() for k, v in inputs_of(seed).items()} for seed in HELD_OUT]
        wants = [np.asarray(runners["torch eager (in-process)"](other)) for other in others]
        # over the held-out set, as the budget is read (runtimes/base.py set_error)
        held = {k: set_error([np.asarray(run(other)) for other in others], wants)
                for k, run in runners.items()}
        samples = (in_blocks(runners, blocks=max(1, rounds // BLOCK_SIZE), size=BLOCK_SIZE)
                   if blocks else
                   interleaved(runners, rounds, warmup=3))
    finally:
        shm_close()
        fast.close()
    eager_p50 = stats(samples["torch eager (in-process)"])["p50_ms"]
    ov_p50 = stats(samples["openvino default (in-process)"])["p50_ms"]
    rows = {k: {**{m: round(v, 3) for m, v in stats(s).items() if m != "n"},
                "x_eager": round(stats(s)["p50_ms"] / eager_p50, 3),
                "x_openvino_default": round(stats(s)["p50_ms"] / ov_p50, 3),
                "rel_error": errors[k], "held_out_error": held[k]}
            for k, s in samples.items()}
    parts = [f"{p.get('id', i)} {p['device']} {p.get('runtime', '?')} "
             f"{p.get('precision', '?')}" for i, p in enumerate(plan.get("parts", []))]
    # cuvild's fp32 paths against the runtime its plan chose, run in this process (one part)
    same = SAME_RUNTIME.get(plan["parts"][0].get("runtime", "")) if len(parts) == 1 else None
    if same in samples:
        for k in ("cuvild fast path", "cuvild tritonclient shm"):
            rows[k]["x_same_runtime"] = round(rows[k]["p50_ms"] / rows[same]["p50_ms"], 3)
    return {"model": name, "load_s": round(load_s, 1), "plan": parts, "calibration": calibrate,
            "openvino_default_precision": ov_precision, "output": output, "rows": rows,
            "auto": chosen, "same_runtime": same}


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=0, help="timed calls per runner")
    parser.add_argument("--models", default="")
    parser.add_argument("--auto", default="1e-2,5e-2",
                        help="budgets of precision='auto' (none: fp32 only)")
    parser.add_argument("--calibrate", type=int, default=0, metavar="N",
                        help="also load each budget with N calibration inputs (int8 tried)")
    parser.add_argument("--timing", choices=("interleaved", "blocks"), default="blocks")
    args = parser.parse_args()
    budgets = [] if args.auto == "none" else [float(b) for b in args.auto.split(",") if b]
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    rounds = args.rounds or (10 if args.quick else 20)
    wanted = families()
    names = (args.models.split(",") if args.models else
             ["resnet50", "bert-base-4l"] if args.quick else list(wanted))
    info = hardware.cpuinfo()
    report: dict[str, Any] = {"host": {"cpu": info["name"], "cores": threads,
                                       "flags": hardware.cpu_features(info["flags"])},
                              "rounds": rounds, "timing": args.timing, "models": []}
    with tempfile.TemporaryDirectory(prefix="cuvil-modelbench-") as tmp:
        home = Path(tmp)
        config = daemon_config(home, home / "state", home)
        config["devices"] = one_cpu()
        config["log_level"] = "warning"
        daemon = DaemonProcess(home, config).start()
        try:
            for name in names:
                print(f"{name} ...", file=sys.stderr, flush=True)
                report["models"].append(one_model(name, wanted[name], daemon.target, rounds,
                                                  threads, home, budgets, args.calibrate,
                                                  args.timing == "blocks"))
        finally:
            daemon.stop()
            daemon.close()
    return report


def show(r: dict[str, Any]) -> None:
    print(f"host: {r['host']['cpu']}, {r['host']['cores']} cores, flags {r['host']['flags']}; "
          f"{r['rounds']} calls per runner, timed {r.get('timing', 'interleaved')}")
    for m in r["models"]:
        print(f"\n{m['model']}: READY in {m['load_s']} s; plan: {'; '.join(m['plan'])}; "
              f"OpenVINO's default precision here: {m['openvino_default_precision']}")
        print(f"  {'':<32} {'p50 ms':>8} {'p99 ms':>8} {'x eager':>8} {'x OV def':>8}  "
              f"error vs eager ({m['output']}): on the load's sample, over "
              f"{len(HELD_OUT)} held out")
        for k, row in m["rows"].items():
            print(f"  {k:<32} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['x_eager']:8.2f} "
                  f"{row['x_openvino_default']:8.2f}  {row['rel_error']:.1e}  "
                  f"{row['held_out_error']:.1e}")
        if m.get("same_runtime"):
            rows = m["rows"]
            print(f"  vs {m['same_runtime']}, the runtime cuvild chose: fast path "
                  f"{rows['cuvild fast path']['x_same_runtime']:.3f}x, tritonclient shm "
                  f"{rows['cuvild tritonclient shm']['x_same_runtime']:.3f}x")
        for budget, auto in m.get("auto", {}).items():
            print(f"  auto {budget}: READY in {auto['load_s']} s; plan {'; '.join(auto['plan'])}")
            for note in auto["notes"]:
                print(f"    {note}")


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        show(result)
