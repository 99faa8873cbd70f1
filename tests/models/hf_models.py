"""Tiny Hugging Face transformers models (2 layers, small widths: seconds to load), built
from their configs with seeded random weights, each with keyword example inputs."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import transformers as tf
from transformers.models.whisper.modeling_whisper import WhisperEncoder

VOCAB, SEQ, BATCH = 128, 16, 2


def tokens(seq: int = SEQ) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, seq))}


def tokens_and_mask(seq: int = SEQ, left: bool = False) -> dict[str, torch.Tensor]:
    """The second row padded: at its end, or (`left`) at its start, as transformers pads a
    decoder's batch for generation, whose first queries then attend no key (OpenVINO's
    attention made them NaN, and the NaN every query of the next layer: runtimes/masks.py)."""
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    (mask[1, :seq // 2] if left else mask[1, seq // 2:]).zero_()
    return {**tokens(seq), "attention_mask": mask}


def pixels(seq: int = 0) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, 32, 32)}


def features(seq: int = 0) -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(BATCH, 16, 64)}  # 16 mel bins, 64 frames


IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary
FAMILIES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., dict[str, Any]]]] = {
    "bert": (lambda: tf.BertModel(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0)), tokens_and_mask),
    "gpt2": (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, use_cache=False,
        **IDS)), tokens),
    "llama": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        use_cache=False, **IDS)), partial(tokens_and_mask, left=True)),
    "t5-encoder": (lambda: tf.T5EncoderModel(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, **IDS)),
        tokens),
    "vit": (lambda: tf.ViTForImageClassification(tf.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=10)), pixels),
    "convnext": (lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=10)), pixels),
    "resnet": (lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)), pixels),
    "swin": (lambda: tf.SwinForImageClassification(tf.SwinConfig(  # shifted windows
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=10)), pixels),
    "whisper-encoder": (lambda: WhisperEncoder(tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2,
        encoder_attention_heads=2, encoder_ffn_dim=64, decoder_layers=1,
        decoder_attention_heads=2, decoder_ffn_dim=64, max_source_positions=32,
        decoder_start_token_id=1, **IDS)), features),
}


def redraw(model: torch.nn.Module) -> None:
    """Variance-preserving weights (std 1/sqrt(fan in)), for a family whose own init makes
    the outputs vanish (then every error is 0 and a test proves nothing)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)


def build(family: str, seq: int = SEQ) -> tuple[torch.nn.Module, dict[str, Any], Any]:
    """The eval-mode model, its keyword inputs and its eager outputs (a ModelOutput), whose
    scale is checked: a degenerate random init is re-drawn."""
    make, inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    kwargs = inputs(seq)
    with torch.no_grad():
        ref = model(**kwargs)
        if min(scale(ref).values()) < 1e-3:
            redraw(model)
            ref = model(**kwargs)
    low = {k: s for k, s in scale(ref).items() if s < 1e-3}
    assert not low, f"{family}: eager outputs of degenerate scale {low}"
    return model, kwargs, ref


def scale(outputs: Any) -> dict[str, float]:
    """The standard deviation of each tensor output."""
    return {k: float(v.float().std()) for k, v in outputs.items() if isinstance(v, torch.Tensor)}
