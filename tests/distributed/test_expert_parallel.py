"""Expert parallelism (``parallel.enable_expert_parallel``): at TP=2 with it, greedy float32
tokens equal TP=1 on small random Mixtral and Qwen3-MoE models; each rank builds and loads only
its half of the experts, whole; the op's reference with a local-expert subset, summed over the
two halves, equals the op over every expert; a number of experts the ranks do not divide is
refused; with one rank the flag changes nothing."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from parallel_utils import MOE_CONFIGS, SHARDED_SHAPES, TOKEN_PROMPTS, greedy_tokens

from kiln.config import KilnConfig, ParallelConfig, set_current_config
from kiln.distributed.parallel_state import TensorParallelGroup, set_tp_group
from kiln.engine.arg_utils import ENGINE_FLAGS
from kiln.model_executor.custom_op import OP_REGISTRY
from kiln.model_executor.layers.fused_moe import FusedMoE
from kiln.model_executor.loader import get_loader
from kiln.model_executor.models.mixtral import MixtralForCausalLM
from kiln.testing.models import save_tiny_model

E, H, INTER = 8, 32, 24
EP2 = KilnConfig(parallel=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))


@pytest.fixture
def reference_dispatch():
    """The reference, whatever platform an earlier test in this process selected."""
    before = OP_REGISTRY.device_type
    OP_REGISTRY.select_device(None)
    yield
    OP_REGISTRY.select_device(before)


def rank_of_two(rank: int) -> TensorParallelGroup:
    # Only construction, loading and forward_native run here (no collective): any object
    # stands in for the communicator.
    return TensorParallelGroup(rank=rank, world_size=2, communicator=cast(Any, object()))


def build(rank: int, top_k: int = 2, **kwargs) -> FusedMoE:
    """Rank ``rank`` of two's ``FusedMoE`` with expert parallelism."""
    with set_tp_group(rank_of_two(rank)):
        return FusedMoE(E, top_k, H, INTER, expert_parallel=True, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MOE_CONFIGS))
def test_ep2_greedy_tokens_equal_tp1_on_small_random_models(tmp_path, gguf_path, model_type):
    folder = save_tiny_model(
        tmp_path / model_type,
        model_type,
        random_norms=True,
        num_key_value_heads=4,
        **{**SHARDED_SHAPES, **MOE_CONFIGS[model_type]},
    )
    tp1 = greedy_tokens(folder, TOKEN_PROMPTS, tokenizer=gguf_path)
    ep2 = greedy_tokens(
        folder,
        TOKEN_PROMPTS,
        tokenizer=gguf_path,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert ep2 == tp1
    assert len({tuple(t) for t in tp1}) == len(TOKEN_PROMPTS)  # not a degenerate output


def test_each_rank_builds_and_loads_only_its_experts_whole(tmp_path):
    folder = save_tiny_model(tmp_path / "m", "mixtral", num_local_experts=4, num_hidden_layers=1)
    loader = get_loader(folder, "auto")
    hf_config = loader.load_hf_config(folder)
    checkpoint = dict(loader.iter_weights(folder, torch.float32))
    prefix = "model.layers.0.block_sparse_moe.experts"
    for rank in range(2):
        with set_current_config(EP2), set_tp_group(rank_of_two(rank)):
            model = MixtralForCausalLM(hf_config)
        loaded = model.load_weights(checkpoint.items())
        assert loaded == {name for name, _ in model.named_parameters()}
        experts = model.model.layers[0].mlp.experts
        assert (experts.num_local_experts, experts.expert_offset) == (2, 2 * rank)
        for local in range(2):
            e = 2 * rank + local
            gate, up, down = (checkpoint[f"{prefix}.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
            assert torch.equal(experts.w13_weight[local], torch.cat([gate, up]))  # whole
            assert torch.equal(experts.w2_weight[local], down)


def test_a_stacked_checkpoint_tensor_is_narrowed_to_the_local_experts():
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)
    rank1 = build(1)
    assert rank1.w13_weight.shape == (E // 2, 2 * INTER, H)
    assert rank1.w2_weight.shape == (E // 2, H, INTER)
    rank1.weight_loader(rank1.w13_weight, w13, (None, "gate_up"))
    rank1.weight_loader(rank1.w2_weight, w2, (None, "down"))
    assert torch.equal(rank1.w13_weight, w13[E // 2 :])
    assert torch.equal(rank1.w2_weight, w2[E // 2 :])


@pytest.mark.parametrize(
    ("top_k", "scoring", "renormalize", "num_tokens"),
    [(2, "softmax", True, 1), (2, "softmax", True, 9), (3, "sigmoid", False, 9)],
)
def test_the_halves_summed_equal_the_op_over_every_expert(
    reference_dispatch, top_k, scoring, renormalize, num_tokens
):
    routing = dict(renormalize=renormalize, scoring_func=scoring)
    full = FusedMoE(E, top_k, H, INTER, **routing)
    gen = torch.Generator().manual_seed(1)
    for param in full.parameters():
        param.data.copy_(0.2 * torch.randn(param.shape, generator=gen))
    x = torch.randn(num_tokens, H, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen)
    halves = []
    for rank in range(2):
        half = build(rank, top_k=top_k, **routing)
        half.w13_weight.data.copy_(full.w13_weight[E // 2 * rank : E // 2 * (rank + 1)])
        half.w2_weight.data.copy_(full.w2_weight[E // 2 * rank : E // 2 * (rank + 1)])
        halves.append(half.forward_native(x, logits))
    expected = full.forward_native(x, logits)
    torch.testing.assert_close(halves[0] + halves[1], expected, rtol=0, atol=1e-6)
    if num_tokens > 1:  # some token's experts lie on both ranks: neither half is the whole
        assert not any(torch.allclose(half, expected) for half in halves)


def test_experts_the_ranks_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"num_experts=5 is not divisible by .*enable_expert_par"):
        with set_tp_group(rank_of_two(0)):
            FusedMoE(5, 2, H, INTER, expert_parallel=True)
    with set_tp_group(rank_of_two(0)):  # without expert parallelism 5 experts are fine
        assert FusedMoE(5, 2, H, INTER).w13_weight.shape == (5, INTER, H)


def test_the_layer_reads_the_flag_from_the_config_and_one_rank_changes_nothing():
    with set_current_config(EP2), set_tp_group(rank_of_two(1)):
        assert FusedMoE(E, 2, H, INTER).expert_offset == E // 2
    one_rank = KilnConfig(parallel=ParallelConfig(enable_expert_parallel=True))
    with set_current_config(one_rank):
        layer = FusedMoE(E, 2, H, INTER)
    assert (layer.num_local_experts, layer.expert_offset) == (E, 0)
    assert layer.w13_weight.shape == (E, 2 * INTER, H)
    assert ENGINE_FLAGS["enable_expert_parallel"].default is False  # --enable-expert-parallel
