"""`cuvilctl export-lm`: a Hugging Face causal language model made a model repository entry
the daemon generates with (docs/GENERATION.md), in one command:

    cuvilctl export-lm Qwen/Qwen2.5-0.5B-Instruct --repository models   # or a local folder
    -> models/Qwen2.5-0.5B-Instruct/1/model.pt2, tokenizer.json, tokenizer_config.json,
       chat_template.jinja, generation_config.json (and config.yaml: --precision auto
       --max-error 1e-2, the entry's load options)

The model is exported as transformers' own exporter for decoder-only models exports it
(`TorchExportableModuleForDecoderOnlyLM`: a static KV cache of `--context` positions held as
buffers), for prompts of any length up to the context (the daemon runs them in chunks), at
fp32 (the daemon settles each part's precision under its policy). The export is checked
before it is written: the program's logits on a short prompt against the model's own. The
archive is written under a temporary name and renamed, so that a daemon reading the
repository never sees half of it. Runs here, not in the daemon (it needs transformers, and
the model's weights where this runs); a daemon serving the repository loads the entry at its
next read of it (`cuvilctl reload`, SIGHUP) or its next start.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cuvild.intake.registry import NAME_RE
from cuvild.intake.repository import CONFIG

DEFAULT_CONTEXT = 2048
CHECK_TOKENS = 8


def export_lm(source: str, repository: Path, name: str, version: str = "1",
              context: int | None = None, force: bool = False,
              say: Any = print, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Export `source` (a Hub id or a local folder, as from_pretrained takes) into
    repository/name; what was written. `options`: the entry's load options (config.yaml:
    precision, max_error), written where given. ValueError naming what is wrong."""
    entry = repository / name
    archive = entry / version / "model.pt2"
    checked_name(name, version, archive, force)
    t0 = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"loading {source}")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        tokenizer = None
        say(f"no tokenizer ({str(e)[:200]}): prompts go as token ids")
    longest = getattr(model.config, "max_position_embeddings", None)
    context = context or min(DEFAULT_CONTEXT, longest or DEFAULT_CONTEXT)
    if context < 2 or (longest and context > longest):
        raise ValueError(f"--context {context}: from 2 to the model's "
                         f"max_position_embeddings ({longest})")
    say(f"exporting with a static cache of {context} positions")
    generation = copy.deepcopy(model.generation_config)
    try:
        exported = _export(model, context)
    except Exception as e:  # noqa: BLE001 - torch.export's many errors: the user's answer
        raise ValueError(f"transformers' exporter cannot export it ({type(e).__name__}: "
                         f"{str(e)[:500]})") from None
    error = _check(model, exported, tokenizer, min(CHECK_TOKENS, context - 1))
    say(f"checked: logits {error:.1e} off the model's own (max |a - b| / max |b|)")
    if not error <= 1e-3:
        raise ValueError(f"the exported program's logits are {error:.1e} off the model's own "
                         "(over 1e-3): not written")
    written = _write(exported, archive, generation, tokenizer, options or {}, say)
    return {"name": name, "version": version, "archive": str(archive),
            "bytes": archive.stat().st_size, "context": context, "check_error": error,
            "files": sorted({str(p) for p in written}),
            "seconds": round(time.monotonic() - t0, 1)}


def _write(exported: Any, archive: Path, generation: Any, tokenizer: Any,
           options: dict[str, Any], say: Any) -> list[Path]:
    """The archive (under a temporary name, then renamed), the generation config, the load
    options and the tokenizer's files, in the entry; their paths."""
    entry = archive.parent.parent
    written = save(exported, archive, options)
    generation.save_pretrained(entry)
    written.append(entry / "generation_config.json")
    if tokenizer is not None:
        written += [Path(p) for p in tokenizer.save_pretrained(entry) if Path(p).exists()]
        if not (entry / "tokenizer.json").exists():
            say("its tokenizer has no tokenizer.json (a slow one): prompts go as token ids")
    return written


def save(exported: Any, archive: Path, options: dict[str, Any]) -> list[Path]:
    """The archive written under a temporary name and renamed (a daemon reading the
    repository never sees half of it), and the entry's load options (config.yaml) where
    given; their paths."""
    import torch

    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".partial-{os.getpid()}-{archive.name}")  # (torch: .pt2)
    try:
        torch.export.save(exported, partial)
        os.replace(partial, archive)
    finally:
        partial.unlink(missing_ok=True)
    written = [archive]
    if options:
        import yaml

        entry = archive.parent.parent
        (entry / CONFIG).write_text(yaml.safe_dump(options))
        written.append(entry / CONFIG)
    return written


def checked_name(name: str, version: str, archive: Path, force: bool) -> None:
    """ValueError where the entry's name or version is not one the repository takes, or its
    archive exists and `force` does not replace it."""
    for label, value in (("name", name), ("version", version)):
        if not NAME_RE.fullmatch(value):
            raise ValueError(f"{label} {value!r}: 1-128 of A-Z a-z 0-9 _ . -")
    if archive.exists() and not force:
        raise ValueError(f"{archive} exists (--force replaces it)")


def _export(model: Any, context: int) -> Any:
    import torch
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.cache_implementation = "static"
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=context)
    length = torch.export.Dim("length", min=1, max=context - 1)
    return wrapper.export(input_ids=torch.tensor([[1, 2]], dtype=torch.long),
                          cache_position=torch.tensor([0, 1], dtype=torch.long),
                          dynamic_shapes={"input_ids": {1: length},
                                          "cache_position": {0: length}})


def _check(model: Any, exported: Any, tokenizer: Any, most: int) -> float:
    """The exported program's logits on a short prompt against the model's own, relative."""
    import torch

    vocab = model.config.vocab_size
    ids = (tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
           if tokenizer is not None else [])
    ids = [i for i in ids if 0 <= i < vocab][:most] or [i % vocab for i in range(1, most + 1)]
    prompt = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        want = model(prompt).logits[0, -1].double()
        got = exported.module()(input_ids=prompt, cache_position=torch.arange(len(ids)))
    got = got[0, -1].double()
    return float((got - want).abs().max() / want.abs().max())


def teller(as_json: bool) -> Any:
    """How an export says its phases: a line each, or with --json a JSON line on stderr."""
    def say(phase: str) -> None:
        if as_json:
            print(json.dumps({"phase": phase}), file=sys.stderr, flush=True)
        else:
            print(phase, flush=True)
    return say


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The entry's load options the command was given (its config.yaml)."""
    return {k: v for k, v in (("precision", args.precision), ("max_error", args.max_error))
            if v is not None}


def add_entry_arguments(export: Any) -> None:
    """The arguments every export-* command takes: where the entry goes, its load options,
    --force and --json."""
    export.add_argument("source", help="a Hub model id or a local folder (from_pretrained's)")
    export.add_argument("--repository", required=True, metavar="DIR",
                        help="the model repository (the daemon's model_repository)")
    export.add_argument("--name", default=None,
                        help="the entry's name (default: the source's last path part)")
    export.add_argument("--version", default="1", help="the version folder (default 1)")
    export.add_argument("--precision", choices=("fp32", "auto"), default=None,
                        help="the entry's load option (its config.yaml): auto, the fastest "
                             "plan within --max-error of torch eager (default: the daemon's "
                             "engine.precision)")
    export.add_argument("--max-error", type=float, default=None, metavar="E",
                        help="auto's budget (default: the daemon's engine.max_error)")
    export.add_argument("--force", action="store_true", help="replace an archive there")
    export.add_argument("--json", action="store_true", help="machine-readable output: the "
                        "result on stdout, each phase a JSON line on stderr")


def cmd_export_lm(_client: Any, args: argparse.Namespace) -> int:
    return run_export(args, "export-lm", lambda name, say: export_lm(
        args.source, Path(args.repository), name, args.version, args.context, args.force, say,
        load_options(args)), lambda done: f"context {done['context']}")


def run_export(args: argparse.Namespace, command: str, export: Any, detail: Any) -> int:
    """An export-* command: `export(name, say)` run, its errors a line on stderr, its result
    JSON (--json) or a line saying what was written (`detail(result)` in it)."""
    say = teller(args.json)
    try:
        done = export(args.name or Path(args.source.rstrip("/")).name, say)
    except ImportError as e:
        print(f"cuvilctl: {command} needs transformers where it runs ({e})", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"cuvilctl: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(done))
    else:
        print(f"wrote {done['archive']} ({done['bytes'] / 1e6:.1f} MB, {detail(done)}) and "
              f"{len(done['files']) - 1} file(s) beside it in {done['seconds']} s; a daemon "
              f"serving {args.repository} loads it at its next read of it (cuvilctl reload)")
    return 0


def add_export_lm(sub: Any) -> None:
    export = sub.add_parser("export-lm", help="make a Hugging Face causal language model a "
                                              "model repository entry (docs/GENERATION.md)")
    add_entry_arguments(export)
    export.add_argument("--context", type=int, default=None, metavar="N",
                        help=f"positions its cache holds: prompt and answer together "
                             f"(default: {DEFAULT_CONTEXT}, or the model's "
                             "max_position_embeddings where less)")
    export.set_defaults(func=cmd_export_lm)
