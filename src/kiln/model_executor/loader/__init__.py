"""Model loaders by name; ``get_loader`` picks the one that understands a model reference.

Plugins add loaders with ``LOADER_REGISTRY.register(name, "pkg.mod.LoaderCls")``. Entries are dotted
paths resolved lazily.
"""

from __future__ import annotations

from kiln.model_executor.loader.base import ModelLoader
from kiln.plugins.registry import Registry
from kiln.utils import resolve_obj_by_qualname

# Order matters for "auto": the first loader whose can_load() accepts the reference wins.
_BUILTIN_LOADERS = {
    "gguf": "kiln.model_executor.loader.gguf_loader.GGUFLoader",
    "safetensors": "kiln.model_executor.loader.safetensors_loader.SafetensorsLoader",
    "hub": "kiln.model_executor.loader.hub.HubLoader",
}
LOADER_REGISTRY: Registry[str] = Registry("loader", builtins=_BUILTIN_LOADERS)


def get_loader(model: str, load_format: str = "auto") -> ModelLoader:
    """An instance of the loader named ``load_format``, or the first that accepts ``model``.

    Raises:
        ValueError: unknown ``load_format``, or no loader accepts ``model``.
    """
    if load_format != "auto":
        if load_format not in LOADER_REGISTRY:
            raise ValueError(
                f"load_format={load_format!r} is not a registered loader; allowed: "
                f"{['auto', *LOADER_REGISTRY.names()]}"
            )
        return resolve_obj_by_qualname(LOADER_REGISTRY.get(load_format))()
    for _name, path in LOADER_REGISTRY.items():
        cls = resolve_obj_by_qualname(path)
        if cls.can_load(model):
            return cls()
    raise ValueError(
        f"model={model!r} is not a GGUF file, a folder with config.json and *.safetensors, "
        "or a Hugging Face hub id"
    )


__all__ = ["LOADER_REGISTRY", "ModelLoader", "get_loader", "resolve_model_ref"]


def resolve_model_ref(model: str | None) -> str:
    """``model``, or the embedded default model's path when it is None."""
    if model:
        return model
    from kiln.model_executor.loader.default_model import default_model_path

    return default_model_path()
