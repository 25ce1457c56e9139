"""Pipeline parallelism: greedy tokens in float32 at PP=2 (two worker processes, hidden states
and residual handed from stage to stage through the platform's communicator) equal TP=1 on the
default model (tied LM head on a stage without the embedding) and on a small random Llama with 4
KV heads, an odd vocabulary and 3 layers (an uneven split); a stage builds and loads only its own
layers; bad sizes are refused."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from kiln.config import ParallelConfig
from kiln.distributed.communicator import Communicator
from kiln.distributed.parallel_state import PipelineParallelGroup, set_pp_group
from kiln.model_executor.loader import get_loader
from kiln.model_executor.models.llama import LlamaForCausalLM
from kiln.testing.models import save_tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from parallel_utils import TEXT_PROMPTS, TOKEN_PROMPTS, greedy_tokens  # noqa: E402


@pytest.mark.slow
def test_pp2_greedy_tokens_equal_tp1_on_a_small_random_llama(tiny_llama, gguf_path):
    folder, tp1 = tiny_llama
    pp2 = greedy_tokens(folder, TOKEN_PROMPTS, tokenizer=gguf_path, pipeline_parallel_size=2)
    assert pp2 == tp1


@pytest.mark.slow
def test_pp2_greedy_tokens_equal_tp1_on_the_default_model(gguf_path, default_model_tokens):
    # quantization auto: dense weights with more than one rank; SmolLM2's head is tied.
    assert greedy_tokens(gguf_path, TEXT_PROMPTS, pipeline_parallel_size=2) == default_model_tokens


class UnusedCommunicator(Communicator):
    """Stands in for a peer that is never reached: building and loading a stage sends nothing."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None: ...

    def all_reduce(self, tensor):
        raise AssertionError("no traffic while building")

    all_gather = broadcast = barrier = send = recv = all_reduce


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_stage_holds_and_loads_only_its_layers(tmp_path, tied):
    folder = save_tiny_model(tmp_path / "m", "llama", num_hidden_layers=3, tie_word_embeddings=tied)
    loader = get_loader(folder, "auto")
    hf_config = loader.load_hf_config(folder)
    checkpoint = dict(loader.iter_weights(folder, torch.float32))
    stages = []
    for rank in range(2):
        group = PipelineParallelGroup(rank, 2, UnusedCommunicator(rank, 2, torch.device("cpu")))
        with set_pp_group(group):
            model = LlamaForCausalLM(hf_config)
        loaded = model.load_weights(checkpoint.items())
        assert loaded == {name for name, _ in model.named_parameters()}
        stages.append(dict(model.named_parameters()))
    first, last = stages
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"2"}
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    assert "lm_head.weight" in last and "lm_head.weight" not in first
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    head = checkpoint["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(last["lm_head.weight"], head)
    assert torch.equal(
        last["model.layers.2.mlp.down_proj.weight"],
        checkpoint["model.layers.2.mlp.down_proj.weight"],
    )


@pytest.mark.parametrize(
    ("num_layers", "world_size", "expected"),
    [
        (30, 2, [(0, 15), (15, 30)]),
        (3, 2, [(0, 2), (2, 3)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_layers_split_as_evenly_as_they_go(num_layers, world_size, expected):
    comm = UnusedCommunicator(0, world_size, torch.device("cpu"))
    ranges = [
        PipelineParallelGroup(rank, world_size, comm).layer_range(num_layers)
        for rank in range(world_size)
    ]
    assert ranges == expected


def test_more_stages_than_layers_is_refused():
    group = PipelineParallelGroup(0, 4, UnusedCommunicator(0, 4, torch.device("cpu")))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 exceeds .* allowed: 1\.\.3"):
        group.layer_range(3)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pipeline_parallel_size": 0}, r"parallel.pipeline_parallel_size=0 .* >= 1"),
        (
            {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
            r"parallel.pipeline_parallel_size=2 .* allowed: 1 with tensor_parallel_size=2",
        ),
    ],
)
def test_bad_pipeline_sizes_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelConfig(**kwargs)


def test_world_size_counts_every_stage():
    assert ParallelConfig(pipeline_parallel_size=3).world_size == 3
