"""`cuvilctl export-lm` (cuvild/client/export_lm.py): a Hugging Face causal language model
saved as transformers saves one, made a model repository entry in one command: the archive
generates transformers' greedy tokens, the tokenizer and chat template beside it; the
daemon's serving of such entries is tests/serve/test_generation.py's."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import lm_models
import pytest
import torch
from generation_helpers import TOOLS_TEMPLATE, byte_tokenizer_json

from cuvild.client.cli import main
from cuvild.client.export_lm import export_lm
from cuvild.intake.repository import scan


def cuvilctl(capsys: pytest.CaptureFixture[str], *args: str) -> SimpleNamespace:
    """`cuvilctl export-lm ARGS` through its own main (argparse and all), in this process:
    a subprocess imported torch and transformers again (~4 s of CPU)."""
    code = main(["export-lm", *args])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_a_saved_model_becomes_an_entry_that_generates_as_transformers(tmp_path,
                                                                     capsys) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    model = lm_models.lm("llama")
    source = tmp_path / "tiny-llama"
    model.save_pretrained(source)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()), bos_token="<s>",
        eos_token="</s>")
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(source)
    repository = tmp_path / "models"
    done = cuvilctl(capsys, str(source), "--repository", str(repository), "--context", "48",
                    "--json", "--precision", "auto", "--max-error", "0.01")
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    phases = [json.loads(line)["phase"] for line in done.stderr.splitlines()
              if line.startswith("{")]
    assert phases[0].startswith("loading") and any(p.startswith("checked") for p in phases)
    entry = repository / "tiny-llama"
    assert said["archive"] == str(entry / "1" / "model.pt2") and said["context"] == 48
    assert said["check_error"] < 1e-5
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "config.yaml"):
        assert str(entry / name) in said["files"] and (entry / name).exists(), name
    assert (entry / "chat_template.jinja").read_text() == TOOLS_TEMPLATE
    (read,) = scan(repository)  # (as the daemon reads the entry)
    assert not read.error and read.options == {"precision": "auto", "max_error": 0.01}
    assert not list((entry / "1").glob(".partial-*"))

    prompt, new = [5, 9, 2, 7], 8  # greedy through the archive's cache, a token a step
    program = torch.export.load(entry / "1" / "model.pt2").module()
    ids, got = list(prompt), []
    with torch.no_grad():
        logits = program(input_ids=torch.tensor([ids]), cache_position=torch.arange(len(ids)))
        for _ in range(new):
            got.append(int(logits[0, -1].argmax()))
            logits = program(input_ids=torch.tensor([[got[-1]]]),
                             cache_position=torch.tensor([len(ids) + len(got) - 1]))
    assert got == lm_models.reference(model, prompt, new)

    for given, words in (({}, "exists (--force replaces it)"),  # (in this process: quicker)
                         ({"name": "a/b"}, "name 'a/b'"),
                         ({"context": 100000, "force": True}, "max_position_embeddings")):
        with pytest.raises(ValueError, match=re.escape(words)):
            export_lm(str(source), repository, **{"name": "tiny-llama", **given},
                      say=lambda _: None)
