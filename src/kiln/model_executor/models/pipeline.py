"""What a model needs to hold only its pipeline stage: a placeholder for the modules another
stage holds, and the test that tells a checkpoint tensor of another stage from an unknown one.

Contract: a model built inside ``set_pp_group`` (``kiln.distributed.parallel_state``) puts a
``MissingLayer`` wherever another stage holds the module (the embedding off the first stage, the
decoder layers outside ``layer_range``, the final norm and LM head off the last), so that module
names, and the KV-cache names of the attention layers, stay those of the whole model. Its
``load_weights`` skips the tensors for which ``is_on_other_stage`` holds.
"""

from __future__ import annotations

from torch import nn


class MissingLayer(nn.Identity):
    """A module another pipeline stage holds: no parameters, never called."""


def is_on_other_stage(model: nn.Module, param_name: str) -> bool:
    """Whether ``param_name`` (as in ``named_parameters()`` of the whole model) lies inside a
    ``MissingLayer`` of ``model``."""
    module: nn.Module | None = model
    for part in param_name.split(".")[:-1]:
        module = getattr(module, part, None)
        if module is None:
            return False
        if isinstance(module, MissingLayer):
            return True
    return False


__all__ = ["MissingLayer", "is_on_other_stage"]
