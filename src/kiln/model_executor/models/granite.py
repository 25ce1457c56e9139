"""IBM Granite (3.x dense): the Llama blocks with four scalar multipliers from the config.

Same contract as ``kiln.model_executor.models.llama`` (which see); this module only maps the
config onto ``DecoderArgs``, whose scales the Llama blocks apply: ``embedding_multiplier`` scales
the token embeddings, ``attention_multiplier`` is the attention scale (instead of ``head_dim **
-0.5``), ``residual_multiplier`` scales each sub-layer's output before it joins the residual
stream, and the logits are divided by ``logits_scaling``. Missing keys take Hugging Face's
defaults (1.0 each).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.model_executor.models.llama import DecoderArgs, LlamaForCausalLM, config_dict


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite causal LM (dense)."""

    @classmethod
    def parse_config(cls, hf_config: Any) -> DecoderArgs:
        cfg = config_dict(hf_config)
        args = super().parse_config(hf_config)
        return dataclasses.replace(
            args,
            attention_scale=float(cfg.get("attention_multiplier", 1.0)),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            logits_scale=1.0 / float(cfg.get("logits_scaling", 1.0)),
        )


__all__ = ["GraniteForCausalLM"]
