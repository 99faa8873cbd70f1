"""Tiny random-weight causal language models of several families, exported the way a user
would for cuvild's generation (transformers' own TorchExportableModuleForDecoderOnlyLM:
the static KV cache as buffers, inputs `input_ids` [1, 1] and `cache_position` [1])."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import transformers as tf
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

CONTEXT = 64  # the static cache's length: the longest sequence
VOCAB = 128

FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=CONTEXT)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=CONTEXT)),
    # the families people run most beside those: biases on q/k/v (Qwen2), fused qkv and
    # gate/up (Phi-3), partial rotary and a parallel residual (Phi, GPT-NeoX)
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        pad_token_id=0)),
    "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=CONTEXT)),
    "gptneox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=CONTEXT)),
    # a mixture of experts, exported as transformers does by default: its experts' grouped
    # matmul as transformers' own op (cuvild/intake/foreign_ops.py)
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=CONTEXT)),
}


def lm(family: str) -> Any:
    """The family's model with variance-preserving random weights: its logits far apart, so
    a greedy token is no near tie that rounding could flip."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    model.generation_config.cache_implementation = "static"
    return model


# A pytest worker's exports, by what the model is (its class, config and weights) and how it
# was exported: ~2 s of CPU each, asked for ~40 times by the suite, nearly always of the same
# few models. Each caller gets a copy of its own (a program's buffers are its KV cache, which
# a run updates in place).
_exported: dict[tuple[Any, ...], torch.export.ExportedProgram] = {}


def export(model: Any, context: int = CONTEXT,
           dynamic: bool = False) -> torch.export.ExportedProgram:
    """Exported for one token a step, or (`dynamic`) for any length from 1 to context - 1:
    then a prompt is taken in chunks (cuvild/run/generate.py)."""
    weights = hashlib.sha256()
    for name, value in model.state_dict().items():
        weights.update(name.encode())
        weights.update(value.detach().reshape(-1).view(torch.uint8).numpy())
    key = (type(model).__qualname__, model.config.to_json_string(),
           model.generation_config.to_json_string(), model.training,
           weights.hexdigest(), context, dynamic)
    if key not in _exported:
        _exported[key] = _export(model, context, dynamic)
    return copy.deepcopy(_exported[key])


def _export(model: Any, context: int, dynamic: bool) -> torch.export.ExportedProgram:
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=context)
    if not dynamic:
        return wrapper.export(input_ids=torch.tensor([[1]], dtype=torch.long),
                              cache_position=torch.tensor([0], dtype=torch.long))
    seq = torch.export.Dim("seq", min=1, max=context - 1)
    return wrapper.export(input_ids=torch.tensor([[1, 2]], dtype=torch.long),
                          cache_position=torch.tensor([0, 1], dtype=torch.long),
                          dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})


def reference(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy generation: the token ids after the prompt."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             min_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt):].tolist()
