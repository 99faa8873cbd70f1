"""`cuvilctl export-encoder` (cuvild/client/export_encoder.py): a Hugging Face embedding model
or cross-encoder saved as transformers saves one made a model repository entry in one
command: the archive's outputs are the model's at other batch sizes and lengths, the
tokenizer, config and sentence-transformers files beside it; the daemon's serving of such
entries is tests/serve/test_embeddings.py's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cuvild.client.cli import main
from cuvild.client.export_encoder import export_encoder
from cuvild.intake.repository import scan

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "there",
         "a", "b", "c", "d", "e", "f", "g", "h", "i", "."]


def saved(folder: Path, labels: int | None) -> torch.nn.Module:
    """A tiny BERT (a classifier of `labels` labels, or the bare encoder) and its WordPiece
    tokenizer saved in `folder` as transformers saves them."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=128, num_labels=labels or 2)
    model = (transformers.BertForSequenceClassification(config) if labels
             else transformers.BertModel(config)).eval()
    model.save_pretrained(folder)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    return model


def cuvilctl(capsys: pytest.CaptureFixture[str], *args: str) -> SimpleNamespace:
    code = main(["export-encoder", *args])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_an_embedding_model_and_a_cross_encoder_become_entries(tmp_path, capsys) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    source = tmp_path / "tiny-bert"
    model = saved(source, None)
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (source / "modules.json").write_text(json.dumps([{"type": "x.Normalize"}]))
    repository = tmp_path / "models"
    done = cuvilctl(capsys, str(source), "--repository", str(repository), "--json",
                    "--max-length", "64", "--max-batch", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    entry = repository / "tiny-bert"
    assert said["kind"] == "embedding model" and said["check_error"] < 1e-5, said
    assert said["inputs"] == ["input_ids", "attention_mask", "token_type_ids"]
    for name in ("tokenizer.json", "config.json", "modules.json", "1_Pooling/config.json"):
        assert str(entry / name) in said["files"] and (entry / name).exists(), name
    (read,) = scan(repository)  # (as the daemon reads the entry)
    assert not read.error, read.error
    tokenizer = AutoTokenizer.from_pretrained(source)
    given = tokenizer(["the quick brown fox jumps over the lazy dog .", "hello", "a b c"],
                      padding=True, return_tensors="pt")  # (3 rows of 12: not the export's)
    program = torch.export.load(entry / "1" / "model.pt2").module()
    with torch.no_grad():
        got, want = program(**given), model(**given)
    assert torch.allclose(got[0], want.last_hidden_state, atol=1e-5)

    source = tmp_path / "tiny-reranker"
    model = saved(source, 1)
    done = cuvilctl(capsys, str(source), "--repository", str(repository), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    assert said["kind"] == "cross-encoder" and said["max_length"] == 128, said
    assert "no sentence-transformers files" not in done.stderr  # (a cross-encoder pools none)
    program = torch.export.load(repository / "tiny-reranker" / "1" / "model.pt2").module()
    pair = AutoTokenizer.from_pretrained(source)(["is it a dog ?"], ["the lazy dog"],
                                                 return_tensors="pt")
    with torch.no_grad():
        got, want = program(**pair), model(**pair).logits
    assert got[0].shape == (1, 1) and torch.allclose(got[0], want, atol=1e-5)

    saved(tmp_path / "three", 3)  # (a classifier: its labels' names in its config.json)
    done = export_encoder(str(tmp_path / "three"), repository, "three", say=lambda _: None)
    assert done["kind"] == "classifier of 3 labels"
    assert json.loads((repository / "three" / "config.json").read_text())["id2label"] == {
        "0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    with pytest.raises(ValueError, match="name 'a/b'"):
        export_encoder(str(tmp_path / "three"), repository, "a/b", say=lambda _: None)
    done = cuvilctl(capsys, str(source), "--repository", str(repository))
    assert done.returncode == 1 and "exists (--force replaces it)" in done.stderr


def test_a_decoders_embedding_model_exports_without_its_cache(tmp_path) -> None:  # noqa: ANN001
    """Qwen3-Embedding's kind (a decoder, last-token pooled): exported without the KV cache
    its config asks by default (torch.export cannot return a DynamicCache), its hidden states
    at each real token those of the text alone (the daemon pads on the right)."""
    import transformers
    from generation_helpers import byte_tokenizer_json
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    source = tmp_path / "tiny-qwen3-embedding"
    torch.manual_seed(0)
    model = transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256)).eval()
    model.save_pretrained(source)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()),
                            pad_token="</s>").save_pretrained(source)
    done = export_encoder(str(source), tmp_path / "models", "qemb", max_length=64,
                          max_batch=4, say=lambda _: None)
    assert done["kind"] == "embedding model" and done["inputs"] == ["input_ids",
                                                                    "attention_mask"]
    program = torch.export.load(tmp_path / "models" / "qemb" / "1" / "model.pt2").module()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    with torch.no_grad():
        got = program(input_ids=ids, attention_mask=(torch.arange(6) < torch.tensor(
            [[6], [3]])).long())[0]
        alone = model(input_ids=ids[1:, :3]).last_hidden_state
    assert torch.allclose(got[1, :3], alone[0], atol=1e-5)
