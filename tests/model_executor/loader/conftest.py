"""Shared fixtures for the loader tests: the real default model, loaded once per session.

The reference weights come from ``transformers``' own GGUF pipeline (``load_gguf_checkpoint``, what
``from_pretrained(gguf_file=...)`` calls; ``from_pretrained`` itself also insists on ``accelerate``,
which Kiln does not install). It dequantizes with ``gguf.quants`` and un-permutes Q/K itself, so
it is independent of Kiln's dequantizer and name mapping. Its name mapping costs ~0.2 s per layer
module, so the reference is built for the first two layers only (plus embedding and final norm).
"""

from __future__ import annotations

import pytest
import torch

from kiln.model_executor.loader.default_model import default_model_path
from kiln.model_executor.loader.gguf_loader import GGUFLoader


@pytest.fixture(scope="session")
def default_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def kiln_gguf_weights(default_gguf: str) -> dict[str, torch.Tensor]:
    return dict(GGUFLoader().iter_weights(default_gguf, torch.float32))


HF_REFERENCE_LAYERS = 2


@pytest.fixture(scope="session")
def hf_gguf_weights(default_gguf: str) -> dict[str, torch.Tensor]:
    """transformers' tensors for layers 0-1, the embedding and the final norm of the default model.

    The meta-device model only supplies parameter names; the sizes, head counts (for the Q/K
    un-permutation) and values come from the file through transformers' own GGUF parsing.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=HF_REFERENCE_LAYERS))
    tensors = load_gguf_checkpoint(default_gguf, return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    return {name: torch.as_tensor(t).float() for name, t in tensors.items()}
