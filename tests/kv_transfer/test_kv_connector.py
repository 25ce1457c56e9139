"""The KV-connector API through a real ``LLM`` (the default model on the cpu platform): the
order of the worker-side hooks, the caches a connector is handed, and that the conformance
kit's connector check fails for a connector that loads the wrong KV. The offloading connector's
own check (the kit's ``test_kv_connector_loads_what_recomputing_gives``) runs in every
platform's conformance tests; its scheduler side is tested in
``tests/scheduler/test_scheduler_kv_connector.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.kv_transfer import KVConnectorBase, KVConnectorRole
from kiln.kv_transfer.offloading import OffloadingConnector
from kiln.model_executor.layers.attention import AttentionBackend, kv_cache_block_dim
from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend
from kiln.testing import compare_connector_run
from kiln.testing.checks import check_kv_connector

pytestmark = pytest.mark.slow

CALLS: list[tuple[Any, ...]] = []
"""What ``RecordingConnector``'s worker side was called with, in order."""


class RecordingConnector(KVConnectorBase):
    """Supplies nothing; records every worker-side hook it gets."""

    uses_layer_hooks = True

    def __init__(self, config: Any, role: KVConnectorRole) -> None:
        super().__init__(config, role)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        CALLS.append(("register", {n: tuple(t.shape) for n, t in kv_caches.items()}, block_dim))

    def start_load_kv(self) -> None:
        CALLS.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        CALLS.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        CALLS.append(("save_kv_layer", layer_name, attn_metadata is not None))

    def wait_for_save(self) -> None:
        CALLS.append(("wait_for_save",))


class ZeroingConnector(OffloadingConnector):
    """The offloading connector with a broken load: the blocks it should fill are zeroed."""

    def start_load_kv(self) -> None:
        if self._metadata is not None and self._metadata.loads:
            for cache in self._caches:
                for _, block_id in self._metadata.loads:
                    cache.select(self._block_dim, block_id).zero_()


def test_worker_hooks_run_in_order_around_each_layer(gguf_path):
    CALLS.clear()
    llm = LLM(
        gguf_path,
        dtype="float32",
        kv_cache_memory=0.05,
        max_model_len=256,
        kv_transfer_config={
            "kv_connector": "RecordingConnector",
            "kv_connector_module_path": __name__,
        },
    )
    register, *steps = CALLS
    assert register[0] == "register" and register[2] == 1  # (2, num_blocks, ...): blocks on dim 1
    layers = list(register[1])
    assert len(layers) == 30 and all(shape[1] > 1 for shape in register[1].values())
    CALLS.clear()
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=3), use_tqdm=False)
    per_step = [("start_load_kv",)]
    for name in layers:
        per_step += [("wait_for_layer_load", name), ("save_kv_layer", name, True)]
    per_step.append(("wait_for_save",))
    assert CALLS == per_step * 3  # a prefill and two decodes


def test_the_kits_connector_check_fails_for_a_connector_that_loads_wrong_kv():
    broken = {
        "kv_connector": "ZeroingConnector",
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": {"cpu_bytes": 1 << 28},
    }
    result = check_kv_connector("cpu", json.dumps(broken))
    problem = compare_connector_run(result["connector"], result["none"])
    assert problem is not None and "prompt 2" in problem, problem


def test_the_block_dimension_comes_from_the_backend():
    assert kv_cache_block_dim(CPUAttentionBackend) == 1

    class BlocksLast(CPUAttentionBackend):
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (2, block_size, num_kv_heads, head_size, num_blocks)

    class NoBlocks(CPUAttentionBackend):
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (2, 16 * block_size, num_kv_heads, head_size)

    assert kv_cache_block_dim(BlocksLast) == 4
    with pytest.raises(TypeError, match="no block dimension"):
        kv_cache_block_dim(NoBlocks)
    assert issubclass(NoBlocks, AttentionBackend)
