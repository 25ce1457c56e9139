"""The model registry: architecture name (as in ``config.json``'s ``architectures``) -> model class.

Entries are dotted paths, imported only when a model of that architecture is built, so registering
costs nothing. Plugins add architectures with ``MODEL_REGISTRY.register(arch, "pkg.mod.Cls")``
(``override=True`` to replace one of Kiln's).
"""

from __future__ import annotations

from kiln.plugins.registry import Registry
from kiln.utils import resolve_obj_by_qualname

_BUILTIN_MODELS = {
    "Gemma2ForCausalLM": "kiln.model_executor.models.gemma2.Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "kiln.model_executor.models.gemma3.Gemma3ForCausalLM",
    "GraniteForCausalLM": "kiln.model_executor.models.granite.GraniteForCausalLM",
    "LlamaForCausalLM": "kiln.model_executor.models.llama.LlamaForCausalLM",
    "MistralForCausalLM": "kiln.model_executor.models.llama.LlamaForCausalLM",
    "MixtralForCausalLM": "kiln.model_executor.models.mixtral.MixtralForCausalLM",
    "Olmo2ForCausalLM": "kiln.model_executor.models.olmo2.Olmo2ForCausalLM",
    "Phi3ForCausalLM": "kiln.model_executor.models.phi3.Phi3ForCausalLM",
    "Qwen2ForCausalLM": "kiln.model_executor.models.qwen2.Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kiln.model_executor.models.qwen3.Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "kiln.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM",
}
MODEL_REGISTRY: Registry[str] = Registry("model", builtins=_BUILTIN_MODELS)


def resolve_model_cls(architectures: list[str]) -> type:
    """The class of the first registered architecture in ``architectures``.

    Raises:
        ValueError: none of them is registered; the message lists the supported ones.
    """
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return resolve_obj_by_qualname(MODEL_REGISTRY.get(arch))
    raise ValueError(
        f"model architectures {architectures} are not supported; "
        f"supported: {sorted(MODEL_REGISTRY.names())}"
    )
