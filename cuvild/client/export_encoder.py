"""`cuvilctl export-encoder`: a Hugging Face encoder made a model repository entry the daemon
embeds, reranks, scores or classifies with (`/v1/embeddings`, `/rerank`, `/score`,
`/classify`: docs/GENERATION.md), in one command:

    cuvilctl export-encoder sentence-transformers/all-MiniLM-L6-v2 --repository models
    cuvilctl export-encoder cross-encoder/ms-marco-MiniLM-L6-v2 --repository models
    -> models/<name>/1/model.pt2, tokenizer.json, tokenizer_config.json, config.json and the
       sentence-transformers files it has (modules.json, 1_Pooling/config.json)

A model whose config names a `...ForSequenceClassification` architecture is exported with
its head (its `logits`: one label, a cross-encoder; more, a classifier, its labels' names in
the config.json beside it), any other as `transformers.AutoModel` is (its
`last_hidden_state`, pooled by the daemon as its sentence-transformers files say). Its
inputs are those its tokenizer gives (input_ids, attention_mask, token_type_ids), batch and
length dynamic (up to `--max-batch` rows and `--max-length` tokens), at fp32 (the daemon
settles the precision under its policy). The export is checked before it is written: the
program's outputs on two padded texts against the model's own. Written as export-lm writes
(cuvild/client/export_lm.py: the archive under a temporary name, then renamed). Runs here,
not in the daemon; a daemon serving the repository loads the entry at its next read of it.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from cuvild.client.export_lm import (
    add_entry_arguments,
    checked_name,
    load_options,
    run_export,
    save,
)

# sentence-transformers' files the daemon reads (pooling, normalization), and its own config
ST_FILES = ("modules.json", "1_Pooling/config.json", "config_sentence_transformers.json")
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
CHECK_TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello there"]
DEFAULT_BATCH, DEFAULT_LENGTH = 64, 512


def export_encoder(source: str, repository: Path, name: str, version: str = "1",
                   max_length: int | None = None, max_batch: int = DEFAULT_BATCH,
                   force: bool = False, say: Any = print,
                   options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Export `source` (a Hub id or a local folder) into repository/name; what was written.
    ValueError naming what is wrong."""
    entry = repository / name
    archive = entry / version / "model.pt2"
    checked_name(name, version, archive, force)
    t0 = time.monotonic()
    import torch
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    say(f"loading {source}")
    config = AutoConfig.from_pretrained(source)
    heads = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    kind = ("embedding model" if not heads else "cross-encoder" if config.num_labels == 1
            else f"classifier of {config.num_labels} labels")
    auto = AutoModelForSequenceClassification if heads else AutoModel
    model = auto.from_pretrained(source, dtype=torch.float32).eval()
    model.config.use_cache = False  # (a decoder's embedding model: no KV cache in its outputs)
    tokenizer = AutoTokenizer.from_pretrained(source)
    longest = getattr(config, "max_position_embeddings", None) or DEFAULT_LENGTH
    max_length = max_length or min(DEFAULT_LENGTH, longest)
    if not 2 <= max_length <= longest or not 2 <= max_batch:
        raise ValueError(f"--max-length {max_length}: from 2 to the model's "
                         f"max_position_embeddings ({longest}); --max-batch from 2")
    say(f"exporting as {kind}, up to {max_batch} inputs of {max_length} tokens a run")
    example = _inputs(tokenizer, ["a b c d e f g", "h i"])
    try:
        exported = _export(model, example, max_batch, max_length)
    except Exception as e:  # noqa: BLE001 - torch.export's many errors: the user's answer
        raise ValueError(f"torch.export cannot export it ({type(e).__name__}: "
                         f"{str(e)[:500]})") from None
    error = _check(model, exported, _inputs(tokenizer, CHECK_TEXTS))
    say(f"checked: outputs {error:.1e} off the model's own (max |a - b| / max |b|)")
    if not error <= 1e-3:
        raise ValueError(f"the exported program's outputs are {error:.1e} off the model's "
                         "own (over 1e-3): not written")
    written = save(exported, archive, options or {})
    written += [Path(p) for p in tokenizer.save_pretrained(entry) if Path(p).exists()]
    config.to_json_file(entry / "config.json")  # (its Matryoshka sizes, where it has them)
    written.append(entry / "config.json")
    written += _sentence_transformers(source, entry)
    if not heads and not (entry / "modules.json").exists():
        say("no sentence-transformers files: embeddings are the mean of the tokens, "
            "normalized")
    if not (entry / "tokenizer.json").exists():
        say("its tokenizer has no tokenizer.json (a slow one): inputs go as token ids")
    return {"name": name, "version": version, "archive": str(archive),
            "kind": kind, "inputs": list(example),
            "bytes": archive.stat().st_size, "max_length": max_length, "check_error": error,
            "files": sorted({str(p) for p in written}),
            "seconds": round(time.monotonic() - t0, 1)}


def _inputs(tokenizer: Any, texts: list[str]) -> dict[str, Any]:
    """The tokenizer's inputs for `texts`, padded to the longest, those the daemon gives."""
    given = tokenizer(texts, padding=True, return_tensors="pt")
    return {n: given[n] for n in INPUTS if n in given}


def _export(model: Any, example: dict[str, Any], max_batch: int, max_length: int) -> Any:
    import torch

    from partitioner.annotate import export

    rows = torch.export.Dim("rows", max=max_batch)
    length = torch.export.Dim("length", min=2, max=max_length)
    return export(model, (), kwargs=example,
                  dynamic_shapes={n: {0: rows, 1: length} for n in example})


def _check(model: Any, exported: Any, given: dict[str, Any]) -> float:
    """The exported program's first output against the model's own, relative."""
    import torch

    with torch.no_grad():
        want = model(**given)[0].double()
        got = exported.module()(**given)
    got = (got[0] if isinstance(got, (tuple, list)) else next(iter(got.values()))
           if isinstance(got, dict) else got).double()
    return float((got - want).abs().max() / want.abs().max())


def _sentence_transformers(source: str, entry: Path) -> list[Path]:
    """The source's sentence-transformers files copied beside the archive (from its folder,
    or the Hub); without them the daemon pools by the mean, normalized."""
    written = []
    for file in ST_FILES:
        found = Path(source) / file
        if not found.is_file():
            try:
                from huggingface_hub import hf_hub_download

                found = Path(hf_hub_download(source, file))
            except Exception:  # noqa: BLE001 - not there, or no Hub here: pooled by default
                continue
        (entry / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found, entry / file)
        written.append(entry / file)
    return written


def cmd_export_encoder(_client: Any, args: argparse.Namespace) -> int:
    return run_export(args, "export-encoder", lambda name, say: export_encoder(
        args.source, Path(args.repository), name, args.version, args.max_length,
        args.max_batch, args.force, say, load_options(args)),
        lambda done: f"{done['kind']}, up to {done['max_length']} tokens")


def add_export_encoder(sub: Any) -> None:
    export = sub.add_parser("export-encoder", help="make a Hugging Face embedding model or "
                                                   "cross-encoder a model repository entry "
                                                   "(docs/GENERATION.md)")
    add_entry_arguments(export)
    export.add_argument("--max-length", type=int, default=None, metavar="N",
                        help=f"the most tokens an input takes (default: {DEFAULT_LENGTH}, or "
                             "the model's max_position_embeddings where less)")
    export.add_argument("--max-batch", type=int, default=DEFAULT_BATCH, metavar="N",
                        help=f"the most inputs a run takes (default {DEFAULT_BATCH})")
    export.set_defaults(func=cmd_export_encoder)
