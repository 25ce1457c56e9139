"""A ``transformers`` reference for a GGUF model: what Kiln's outputs are checked against.

``hf_model_from_gguf`` builds the model the way ``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)`` does (config and dequantized tensors from transformers' own GGUF reader), without
that call's ``accelerate`` requirement. ``hf_greedy`` decodes with transformers' own KV cache.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import torch


def hf_model_from_gguf(gguf_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The ``transformers`` model of ``gguf_path``, in eval mode, eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) stayed on meta: rebuild them on the CPU.
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(config)
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq.clone()
    return model.eval()


def hf_greedy(hf_model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """``transformers`` greedy decoding with its own KV cache; the new token ids.

    A plain loop rather than ``generate``: no generation-config processors (``generate`` would
    stop at EOS, or with ``min_new_tokens`` mask EOS out, where Kiln's runner just continues).
    """
    # transformers 5 renamed past_key_values to cache.
    cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else None
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([list(prompt)]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == max_new_tokens:
                break
            cache = out.cache if cache_arg else out.past_key_values
            out = hf_model(
                torch.tensor([[tokens[-1]]]),
                use_cache=True,
                **{cache_arg or "past_key_values": cache},
            )
    return tokens


def hf_logits(hf_model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """[vocab] float32 logits of the last prompt token."""
    with torch.inference_mode():
        return hf_model(torch.tensor([list(prompt)])).logits[0, -1].float()
