"""Pipeline parallelism: greedy tokens in float32 at PP=2 (two worker processes, hidden states
and residual handed from stage to stage through the platform's communicator) equal TP=1 on the
default model (tied LM head on a stage without the embedding) and on a small random Llama with 4
KV heads, an odd vocabulary and 3 layers (an uneven split), with two batches in flight (the
requests split into micro-batches); a request aborted while its batch is in flight ends without
disturbing the others; PP=2 x TP=2 (four ranks) equals TP=1 too, and needs a communicator that
takes a sub-group; a stage killed mid-request fails the request at once and stops
``kiln serve``; a stage builds and loads only its own layers; bad sizes are refused."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import DeviceConfig, KilnConfig, ParallelConfig
from kiln.distributed.communicator import Communicator, TorchDistCommunicator
from kiln.distributed.parallel_state import (
    PipelineParallelGroup,
    init_pipeline_group,
    set_pp_group,
)
from kiln.model_executor.loader import get_loader
from kiln.model_executor.models.llama import LlamaForCausalLM
from kiln.testing.models import save_tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from parallel_utils import (  # noqa: E402
    GREEDY,
    TEXT_PROMPTS,
    TOKEN_PROMPTS,
    greedy_tokens,
    small_llm,
)

from kiln.testing.server import KilnServer, child_pids, engine_core_pid, is_running

MAX_STEPS = 200
"""Far more engine steps than the tiny model's requests need (a stalled queue fails, not hangs)."""


@pytest.fixture(scope="module")
def tiny_pp2(tiny_llama, gguf_path) -> Iterator[LLM]:
    """The small random Llama over two stages (two worker processes), shared by the module."""
    llm = small_llm(tiny_llama[0], tokenizer=gguf_path, pipeline_parallel_size=2)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _step_until_done(llm: LLM, abort: str | None = None) -> dict[str, list[int]]:
    """Step the engine until no request is left; the tokens of each request that finished. With
    ``abort``, that request is aborted as soon as its batch is in flight."""
    engine = llm.llm_engine
    core = engine.engine_core
    tokens: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if abort is not None and abort in core.scheduler.in_flight:
            engine.abort_request([abort])
            abort = None
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests() and not core.has_unfinished_requests():
            assert abort is None, "never found the request in flight"
            return tokens
    raise AssertionError(f"not done after {MAX_STEPS} steps")


@pytest.mark.slow
def test_pp2_greedy_tokens_equal_tp1_with_batches_in_flight(tiny_llama, tiny_pp2):
    tp1 = tiny_llama[1]
    engine = tiny_pp2.llm_engine
    for i, prompt in enumerate(TOKEN_PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    # A stop token ends a request at its first occurrence, inside a pipelined run.
    stop_at = 5
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tp1[0][stop_at]])
    engine.add_request("stop", TOKEN_PROMPTS[0], stop)
    tokens = _step_until_done(tiny_pp2)
    assert [tokens[f"r{i}"] for i in range(len(TOKEN_PROMPTS))] == tp1
    assert tokens["stop"] == tp1[0][: tp1[0].index(tp1[0][stop_at]) + 1]
    # Four requests over two stages: two micro-batches of two, both in the pipeline at once.
    assert engine.engine_core.max_num_batches_in_flight == 2


@pytest.mark.slow
def test_a_request_aborted_in_flight_ends_and_leaves_the_others_unchanged(tiny_llama, tiny_pp2):
    tp1 = tiny_llama[1]
    engine = tiny_pp2.llm_engine
    for i, prompt in enumerate(TOKEN_PROMPTS):
        engine.add_request(f"a{i}", prompt, GREEDY)
    tokens = _step_until_done(tiny_pp2, abort="a0")
    assert tokens == {"a1": tp1[1], "a2": tp1[2]}
    core = engine.engine_core
    assert not core.scheduler.in_flight and not core.batch_queue
    # Every stage dropped the aborted request: the same prompts again give the same tokens.
    outputs = tiny_pp2.generate(TOKEN_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tp1


@pytest.mark.slow
def test_pp2_by_tp2_greedy_tokens_equal_tp1_with_batches_in_flight(tiny_llama, gguf_path):
    # Four ranks: each stage's layers split over two tensor-parallel ranks (its own all-reduces),
    # each rank handing its hidden states to the same rank of the next stage.
    folder, tp1 = tiny_llama
    llm = small_llm(folder, tokenizer=gguf_path, pipeline_parallel_size=2, tensor_parallel_size=2)
    try:
        engine = llm.llm_engine
        for i, prompt in enumerate(TOKEN_PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        tokens = _step_until_done(llm)
        assert [tokens[f"r{i}"] for i in range(len(TOKEN_PROMPTS))] == tp1
        assert engine.engine_core.max_num_batches_in_flight == 2
    finally:
        llm.llm_engine.engine_core.shutdown()


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


class WholeGroupCommunicator(TorchDistCommunicator):
    """A communicator written before sub-groups: its constructor takes no ``ranks``."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        super().__init__(rank, world_size, device)


def test_pp_with_tp_needs_a_communicator_that_takes_a_sub_group():
    config = KilnConfig(
        parallel=ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2),
        device=DeviceConfig(communicator_cls=f"{__name__}.WholeGroupCommunicator"),
    )
    needle = r"tensor_parallel_size=2 needs a communicator that takes a sub-group .* 'ranks'"
    with pytest.raises(ValueError, match=needle):
        init_pipeline_group(config, 3, torch.device("cpu"))


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
        ({"pipeline_parallel_size": 2, "rank": 2}, r"parallel.rank=2 .* allowed: 0\.\.1"),
    ],
)
def test_bad_pipeline_sizes_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelConfig(**kwargs)


def test_world_size_counts_every_stage():
    assert ParallelConfig(pipeline_parallel_size=3).world_size == 3
    assert ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4


@pytest.mark.slow
def test_killing_a_stage_mid_request_fails_it_and_stops_the_server(tmp_path, gguf_path):
    # Long enough that the stream outlasts the kill (the tiny model takes ~ms per token).
    max_model_len = 32768
    model = save_tiny_model(
        tmp_path / "llama", "llama", max_position_embeddings=max_model_len, initializer_range=0.2
    )
    args = [model, "--tokenizer", gguf_path, "--dtype", "float32", "--kv-cache-memory", "0.1"]
    args += ["--max-model-len", str(max_model_len), "--pipeline-parallel-size", "2"]
    server = KilnServer([*args, "--disable-log-stats"], start_timeout=600)
    engine = engine_core_pid(server.proc.pid)
    stages = sorted(p for p in child_pids(engine) if _is_worker(p))
    try:
        assert len(stages) == 2
        body = {"prompt": [1, 5, 9], "max_tokens": max_model_len - 8, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # generating
                # The first stage: it is not the one that answers, and the last stage is left
                # waiting for its hidden states.
                os.kill(stages[0], signal.SIGKILL)
                killed = time.monotonic()
                rest = [line for line in lines if line.startswith("data: ")]
                assert time.monotonic() - killed < 10
                assert any('"error"' in line for line in rest), rest[-3:]
        assert server.proc.wait(30) != 0
        deadline = time.monotonic() + 30
        while any(is_running(p) for p in [engine, *stages]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in [engine, *stages] if is_running(p)], "processes left behind"
    finally:
        server.stop()
        for pid in [engine, *stages]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _is_worker(pid: int) -> bool:
    """Whether ``pid`` runs ``kiln.executor.multiproc.main`` (a rank's process)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"kiln.executor.multiproc" in f.read()
    return False
