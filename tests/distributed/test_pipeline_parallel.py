"""Pipeline parallelism: greedy tokens in float32 at PP=2 (two worker processes, hidden states
and residual handed from stage to stage through the platform's communicator) equal TP=1 on the
default model (tied LM head on a stage without the embedding) and on a small random Llama with 4
KV heads, an odd vocabulary and 3 layers (an uneven split); a stage builds and loads only its own
layers; bad sizes are refused."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import ParallelConfig
from kiln.distributed.communicator import Communicator
from kiln.distributed.parallel_state import PipelineParallelGroup, set_pp_group
from kiln.model_executor.loader import get_loader
from kiln.model_executor.models.llama import LlamaForCausalLM
from kiln.testing.models import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
TOKEN_PROMPTS = [
    {"prompt_token_ids": [1, 5, 9, 200, 17, 3]},
    {"prompt_token_ids": [3, 256, 7]},  # 256: the last row of the odd vocabulary
    {"prompt_token_ids": [(11 * i) % 257 for i in range(1, 40)]},
]


def greedy_tokens(model: str, prompts: list, **kwargs) -> list[list[int]]:
    """Greedy float32 token ids of ``prompts`` from an ``LLM`` built with ``kwargs``."""
    llm = LLM(model, dtype="float32", kv_cache_memory=0.02, max_model_len=256, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


def tiny_llama(folder) -> str:
    return save_tiny_model(
        folder,
        "llama",
        num_hidden_layers=3,  # 2 + 1 over two stages
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=257,
        initializer_range=0.2,  # peaked logits: no greedy ties
    )


@pytest.mark.slow
def test_pp2_greedy_tokens_equal_tp1_on_a_small_random_llama(tmp_path, gguf_path):
    folder = tiny_llama(tmp_path / "llama")
    tp1 = greedy_tokens(folder, TOKEN_PROMPTS, tokenizer=gguf_path)
    pp2 = greedy_tokens(folder, TOKEN_PROMPTS, tokenizer=gguf_path, pipeline_parallel_size=2)
    assert pp2 == tp1
    assert len({tuple(t) for t in tp1}) == len(TOKEN_PROMPTS)  # not a degenerate output


@pytest.mark.slow
def test_pp2_greedy_tokens_equal_tp1_on_the_default_model(gguf_path):
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    tp1 = greedy_tokens(gguf_path, prompts, quantization="none")
    pp2 = greedy_tokens(gguf_path, prompts, pipeline_parallel_size=2)
    assert pp2 == tp1


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
