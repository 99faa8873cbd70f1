"""A generation's text (cuvild/serve/generation.py), without a daemon: what may begin a stop
string is held back, and the text continues its prompt as the tokenizer spaces it."""

from __future__ import annotations

from cuvild.serve.generation import release


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
