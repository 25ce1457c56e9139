"""The model registry: architecture name (as in ``config.json``'s ``architectures``) -> model class.

Entries are dotted paths, imported only when a model of that architecture is built, so registering
costs nothing. Plugins add architectures with ``MODEL_REGISTRY.register(arch, "pkg.mod.Cls")``
(``override=True`` to replace one of Kiln's).

``model.model_impl`` (``--model-impl``, vLLM's flag) chooses between a registered class and
transformers' own modeling code on Kiln's paged attention
(``kiln.model_executor.models.transformers_backend``): ``kiln`` only the registry, ``transformers``
always transformers, ``auto`` the registry where it has the architecture, else transformers.
"""

from __future__ import annotations

from kiln.config.model import MODEL_IMPLS
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


TRANSFORMERS_BACKEND = "kiln.model_executor.models.transformers_backend.TransformersForCausalLM"


def transformers_architecture(architectures: list[str]) -> str | None:
    """The first of ``architectures`` that transformers has a causal-LM class for, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return next((arch for arch in architectures if arch in known), None)


def model_impl_of(architectures: list[str], model_impl: str = "kiln") -> tuple[str, str]:
    """``(implementation, architecture)``: implementation ``"kiln"`` (a registered class, native
    or a plugin's) or ``"transformers"``, for the first of ``architectures`` it serves.

    Raises:
        ValueError: ``model_impl`` is not one of ``MODEL_IMPLS``, or nothing serves these
            architectures that way; the message lists what is supported.
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model.model_impl={model_impl!r}; allowed: {list(MODEL_IMPLS)}")
    if model_impl != "transformers":
        registered = next((arch for arch in architectures if arch in MODEL_REGISTRY), None)
        if registered is not None:
            return "kiln", registered
    if model_impl != "kiln":
        arch = transformers_architecture(architectures)
        if arch is not None:
            return "transformers", arch
    supported = f"Kiln: {sorted(MODEL_REGISTRY.names())}"
    if model_impl == "kiln":
        supported += "; other causal LMs transformers implements with --model-impl auto"
    else:
        supported += ", or a causal LM transformers implements"
    raise ValueError(
        f"model architectures {architectures} are not supported with model_impl="
        f"{model_impl!r}; supported: {supported}"
    )


def describe_model_impl(architectures: list[str], model_impl: str = "auto") -> str:
    """One line on what runs ``architectures`` under ``model_impl`` (the start-up banner's).

    Raises:
        ValueError: as ``model_impl_of``.
    """
    impl, arch = model_impl_of(architectures, model_impl)
    if impl == "kiln":
        source = MODEL_REGISTRY.source_of(arch)
        who = "Kiln's native class" if source == "kiln" else f"plugin {source}'s class"
        return f"{arch}: {who} (model_impl {model_impl})"
    why = "" if model_impl == "transformers" else f"; Kiln has no class for {arch}"
    return f"{arch}: transformers' modeling code on Kiln's attention (model_impl {model_impl}{why})"


def resolve_model_cls(architectures: list[str], model_impl: str = "kiln") -> type:
    """The class that builds the model of ``architectures`` (see ``model_impl_of``).

    Raises:
        ValueError: as ``model_impl_of``.
    """
    impl, arch = model_impl_of(architectures, model_impl)
    if impl == "transformers":
        return resolve_obj_by_qualname(TRANSFORMERS_BACKEND)
    return resolve_obj_by_qualname(MODEL_REGISTRY.get(arch))
