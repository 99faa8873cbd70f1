"""A generation's text (cuvild/serve/detokenize.py), without a daemon: what may begin a stop
string is held back, and the text continues its prompt as the tokenizer spaces it."""

from __future__ import annotations

from cuvild.serve.detokenize import release


def test_text_that_may_begin_a_stop_string_is_held_back() -> None:
    assert release("a w1", 0, ("w1 w2",)) == ("a ", 2, False)  # "w1" may begin it
    assert release("a w1 w3", 2, ("w1 w2",)) == ("w1 w3", 7, False)  # it did not
    assert release("a w1 w2 w9", 2, ("w1 w2",)) == ("", 2, True)  # it did: the text ends
    assert release("hello", 0, ()) == ("hello", 5, False)
    assert release("x END y", 0, ("END", "y")) == ("x ", 2, True)  # the first found


def test_a_generations_text_continues_its_prompt() -> None:
    """A SentencePiece tokenizer (Llama 2, Mistral, Gemma: the Metaspace decoder) drops a
    word's leading space from tokens decoded alone ("Paris"); decoded behind the prompt's
    last tokens, as vLLM's detokenizer does, the text continues the prompt (" Paris."),
    streamed piece by piece alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from cuvild.run.generate import Sampling
    from cuvild.serve.generation import Generation

    words = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    prompt = tok.encode("The capital is").ids
    assert tok.decode([4, 5]) == "Paris."  # (alone)
    gen = Generation(None, None, "m", "1", prompt, Sampling(), tok)  # type: ignore[arg-type]
    pieces = [piece for _, piece in gen._released(iter([4, 5]))]  # noqa: SLF001
    assert pieces == [" Paris", "."] and gen.text == " Paris."
    assert tok.decode(prompt) + gen.text == tok.decode([*prompt, 4, 5])


def test_an_entrys_end_of_sequence_ids_come_from_its_configs(tmp_path) -> None:  # noqa: ANN001
    """Generator.eos: generation_config.json's eos_token_id (an id or a list, as transformers
    writes it) and tokenizer_config.json's eos_token (a string or an AddedToken, by the
    tokenizer); none for an entry without them; a config that does not read is refused."""
    import json

    import pytest
    from generation_helpers import tokenizer_json

    from cuvild.serve.errors import Refused
    from cuvild.serve.generation import Generator

    (tmp_path / "lm" / "1").mkdir(parents=True)
    (tmp_path / "lm" / "tokenizer.json").write_text(tokenizer_json())
    generator = Generator(None, None, tmp_path)  # type: ignore[arg-type] - (files only)
    tokenizer = generator.tokenizer("lm", "1")
    assert generator.eos("lm", "1", tokenizer) == []
    (tmp_path / "lm" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "w6", "special": True}}))
    assert generator.eos("lm", "1", tokenizer) == [6]
    assert generator.eos("lm", "1", None) == []  # (a token's name needs the tokenizer)
    (tmp_path / "lm" / "1" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [9, 6, 12], "bos_token_id": 1}))
    assert generator.eos("lm", "1", tokenizer) == [6, 9, 12]
    (tmp_path / "lm" / "1" / "generation_config.json").write_text("{not json")
    with pytest.raises(Refused, match="its generation_config.json does not read"):
        generator.eos("lm", "1", tokenizer)


def test_min_p_never_picks_a_token_less_likely_than_its_share_of_the_likeliest() -> None:
    """min_p 0.2 of probabilities 0.5, 0.3, 0.15, 0.05: the last (under 0.1) is never
    picked, the others are; without it, it is."""
    import numpy as np

    from cuvild.run.generate import Sampling, pick

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    held = Sampling(temperature=1.0, min_p=0.2)
    picked = {pick(logits, held, rng) for _ in range(2000)}
    assert picked == {0, 1, 2}
    assert 3 in {pick(logits, Sampling(temperature=1.0), rng) for _ in range(2000)}
