"""What the test plugin registers: an op with three providers, a model, a loader, a config section,
a tool parser, a reasoning parser and (on request) a patch. Safe to call more than once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kiln.plugin_api import (
    LOADER_REGISTRY,
    MODEL_REGISTRY,
    OP_REGISTRY,
    PLUGIN_CONFIG_REGISTRY,
    REASONING_PARSER_REGISTRY,
    TOOL_PARSER_REGISTRY,
    CustomOp,
    register_patch,
)

PATCH_TARGET = "kiln.worker.graph:EagerGraphWrapper.capture"
# fingerprint(PATCH_TARGET) when this patch was written; a change to the target's source makes
# Kiln refuse the patch, which is what the drift test relies on.
PATCH_FINGERPRINT = "f8075cce699ce98d"

CALLS: list[str] = []
"""Which provider ran each call of the op (tests read it to check dispatch)."""


class ScaleOp(CustomOp):
    """y = x * scale: a tiny op with a reference and two provider implementations."""

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.scale = scale

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("native")
        return x * self.scale

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        x = torch.randn(4, 8, generator=generator)
        return [(cls(3.0), (x,), {}), (cls(0.5), (x.double(),), {})]


def fast_scale(op: ScaleOp, x: torch.Tensor) -> torch.Tensor:
    CALLS.append("fast")
    return torch.mul(x, op.scale)


def generic_scale(op: ScaleOp, x: torch.Tensor) -> torch.Tensor:
    CALLS.append("generic")
    return x.mul(op.scale)


@dataclass(frozen=True)
class TestPluginOptions:
    scale: float = 2.0
    """Factor of the kiln_test_scale op."""
    mode: Literal["fast", "generic"] = "fast"
    """Which provider the plugin prefers."""
    tags: list[str] = field(default_factory=list)
    """Free-form labels."""


def capture_patched(self: Any, num_tokens: Any) -> None:
    CALLS.append("patched-capture")


def register_all(patch_kind: str | None) -> None:
    OP_REGISTRY.register_op("kiln_test_scale")(ScaleOp)
    # float32 inputs only: the predicate lets other dtypes fall through to the next provider.
    # A lambda, as docs/platforms.md writes it: each run of register() makes a new one.
    OP_REGISTRY.register_impl(
        "kiln_test_scale",
        "kiln_test_fast",
        device_type="cpu",
        priority=10,
        supports=lambda op, x: x.dtype == torch.float32,
    )(fast_scale)
    OP_REGISTRY.register_impl(
        "kiln_test_scale", "kiln_test_generic", device_type="cpu", priority=1
    )(generic_scale)

    # Defined inside register(), as a hardware team wrote it: each run makes a new function
    # object with the same qualified name and code, which counts as the same implementation.
    def nested_scale(op: ScaleOp, x: torch.Tensor) -> torch.Tensor:
        return x * op.scale

    OP_REGISTRY.register_impl("kiln_test_scale", "kiln_test_nested", device_type="cpu")(
        nested_scale
    )
    if os.environ.get("KILN_TEST_WRONG_OP"):
        # A provider that computes the wrong thing, for the conformance kit to catch.
        OP_REGISTRY.register_impl(
            "kiln_test_scale", "kiln_test_wrong", device_type="cpu", priority=20
        )(wrong_scale)
    MODEL_REGISTRY.register(
        "KilnTestForCausalLM", "kiln.model_executor.models.llama.LlamaForCausalLM"
    )
    if os.environ.get("KILN_TEST_BAD_MODEL"):
        # A model whose compute_logits is misspelled, for `kiln plugins` to catch.
        MODEL_REGISTRY.register("KilnTestBadForCausalLM", "kiln_test_plugin.classes.MisspeltModel")
    LOADER_REGISTRY.register(
        "kiln-test", "kiln.model_executor.loader.safetensors_loader.SafetensorsLoader"
    )
    PLUGIN_CONFIG_REGISTRY.declare("kiln_test", TestPluginOptions)
    TOOL_PARSER_REGISTRY.register("kiln_test_plain", "kiln_test_plugin.classes.PlainToolParser")
    REASONING_PARSER_REGISTRY.register(
        "kiln_test_reason", "kiln_test_plugin.classes.ReasonTagReasoningParser"
    )
    non_idempotent = os.environ.get("KILN_TEST_NON_IDEMPOTENT")
    _RUNS.append(1)
    if non_idempotent == "raise":
        # Another function each run (it captures the run's number): the second registration
        # is refused (unlike nested_scale above, which captures nothing).
        OP_REGISTRY.register_impl("kiln_test_scale", "kiln_test_fresh", device_type="cpu")(
            _fresh_scale(len(_RUNS))
        )
    elif non_idempotent == "grow":
        MODEL_REGISTRY.register(
            f"KilnTestRun{len(_RUNS)}ForCausalLM",
            "kiln.model_executor.models.llama.LlamaForCausalLM",
        )
    if patch_kind:
        target = PATCH_TARGET if patch_kind != "missing" else PATCH_TARGET + "_gone"
        register_patch(
            target,
            capture_patched,
            scope="platform",
            reason="test: record graph captures (no hook for it yet)",
            fingerprint=PATCH_FINGERPRINT if patch_kind == "good" else "0" * 16,
            on_mismatch="warn" if patch_kind == "warn" else "refuse",
        )


def wrong_scale(op: ScaleOp, x: torch.Tensor) -> torch.Tensor:
    return x * (op.scale + 1e-3)


_RUNS: list[int] = []


def _fresh_scale(run: int) -> Any:
    def scale(op: ScaleOp, x: torch.Tensor) -> torch.Tensor:
        return x * op.scale + 0 * run

    return scale
