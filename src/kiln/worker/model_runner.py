"""The reference model runner: ``SchedulerOutput`` in, ``ModelRunnerOutput`` out.

Each step applies the scheduler's diff to the persistent batch (``InputBatch``), then runs four
stages over one ``StepPlan`` (``kiln.worker.step_plan``):

1. ``prepare``: the flattened input ids, positions and ``CommonAttentionMetadata`` (vectorised
   NumPy gathers), the step's sampler from the sampling strategy and its logits rows; then each
   stage's ``before_forward`` (LoRA: the step's adapter slots).
2. ``forward``: the model inside a forward context, padded to a graph bucket when it fits one.
3. ``sample`` and 4. ``commit``: the output stage's (``kiln.worker.output``): on the last
   pipeline stage, logits, the grammar mask, plain sampling or a verification of drafts, prompt
   logprobs, then the tokens into the batch with one host sync; on an earlier stage, the
   step's tokens counted computed.

Features are objects the runner composes at set-up, never branches in the step: the sampling
strategy (``PlainSampling`` or ``SpeculativeSampling``, ``kiln.worker.sampling``), the optional
stages (``kiln.worker.stages``: ``LoRAStage`` or the null ``RunnerStage``, ``PromptLogprobs``,
``GrammarMask``) and the output stage (``SamplingOutput``; ``PoolingOutput`` with ``--runner
pooling``, ``kiln.worker.pooling``, which is a stage too; or ``FollowLastStage``). A new feature
(a KV connector's loads and saves around the forward, say) is a new stage in ``stages``.

Graphs: a step of at most the largest bucket's tokens (decodes, speculative verifications, short
prompts, in any mix) is padded to the smallest bucket that holds it and runs through the
platform's graph wrapper, which ``capture_model`` prepared at start-up; a larger step runs the
model eagerly. The contract is in ``kiln.worker.graph``; with the reference platform's defaults
there are no buckets and no padding.

It is device-agnostic PyTorch: platforms reuse it or subclass it. It knows nothing about
scheduling policy or text; the platform's attention backend, graph wrapper and device come from
the config and the platform.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from kiln.config import KilnConfig, set_current_config
from kiln.distributed.parallel_state import SINGLE_STAGE, get_pp_group
from kiln.forward_context import ForwardContext, set_forward_context
from kiln.kv_transfer import KVConnectorRole, create_connector
from kiln.lora.model_manager import LoRAModelManager
from kiln.messages import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from kiln.model_executor.layers.attention import (
    CommonAttentionMetadata,
    allocate_kv_caches,
    kv_cache_block_dim,
    resolve_attn_backend,
)
from kiln.model_executor.loader import resolve_model_ref
from kiln.model_executor.model_loader import kv_cache_bytes_per_token, load_model
from kiln.sampling.sampler import Sampler
from kiln.scheduler.kv_cache import NULL_BLOCK_ID
from kiln.spec_decode.speculator import Speculator
from kiln.utils import resolve_obj_by_qualname
from kiln.worker.graph import graph_capture_sizes, no_capture_reason, padded_size
from kiln.worker.input_batch import InputBatch
from kiln.worker.output import FollowLastStage, OutputStage, SamplingOutput
from kiln.worker.pooling import PoolingOutput
from kiln.worker.sampling import PlainSampling, SpeculativeSampling
from kiln.worker.stages import (
    GrammarMask,
    KVConnectorStage,
    LoRAStage,
    PromptLogprobs,
    RunnerStage,
)
from kiln.worker.step_plan import StepPlan
from kiln.worker.worker_base import ModelRunnerBase

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner(ModelRunnerBase):
    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = _DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.attn_backend = resolve_attn_backend(config.device.attention_backend)
        self.sampler = Sampler()
        self.speculator: Speculator | None = None
        """The proposer and rejection sampler, with ``speculative.method`` (the speculative
        strategy's)."""
        self.sampling = PlainSampling(self.sampler)
        """The sampling strategy: plain, or speculative with ``speculative.method``."""
        if config.speculative.method is not None:
            self.speculator = Speculator(config, device)
            self.sampling = SpeculativeSampling(self.sampler, self.speculator)
        self.lora: RunnerStage = RunnerStage()
        """``LoRAStage`` with ``lora.enable_lora`` (set by ``load_model``), else the null stage."""
        self.prompt_logprobs = PromptLogprobs()
        self.kv_connector: RunnerStage = RunnerStage()
        """``KVConnectorStage`` with ``kv_transfer.kv_connector``, else the null stage."""
        if config.kv_transfer.kv_connector is not None:
            self.kv_connector = KVConnectorStage(create_connector(config, KVConnectorRole.WORKER))
        self.pooling: RunnerStage = RunnerStage()
        """``PoolingOutput`` (also ``output``) with ``model.runner == "pooling"`` on the last
        pipeline stage, else the null stage."""
        self.output: OutputStage = FollowLastStage()
        """What this rank makes of the forward (``SamplingOutput`` on the last pipeline stage);
        set by ``load_model``."""
        self.model: Any = None
        self.pp_group = SINGLE_STAGE
        """This rank's pipeline stage (the worker's ``set_pp_group``); set by ``load_model``."""
        self.graph_sizes: list[int] = []
        """Decode buckets, ascending (empty: no graphs, no padding); set by ``load_model``."""
        self.hf_config: dict[str, Any] = {}
        self.max_model_len = 0
        self.input_batch: InputBatch | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}

    @property
    def stages(self) -> tuple[RunnerStage, ...]:
        """The stages whose hooks run at set-up, on the batch's diff and before each forward,
        in this order."""
        return (self.sampling, self.lora, self.kv_connector, self.prompt_logprobs, self.pooling)

    # -- set-up ------------------------------------------------------------------------------------
    def load_model(self) -> None:
        from kiln.platforms import current_platform

        with set_current_config(self.config):
            model, self.hf_config = load_model(
                resolve_model_ref(self.config.model.model),
                self.dtype,
                self.device,
                self.config.model.load_format,
                quantization=self.config.model.quantization,
                platform=current_platform,
                model_impl=self.config.model.model_impl,
            )
        wrapper_cls = resolve_obj_by_qualname(self.config.device.graph_wrapper_cls)
        self.model = model
        self.pp_group = get_pp_group()
        self.runnable = wrapper_cls(model, self.config)
        self.graph_sizes = graph_capture_sizes(self.config, current_platform.supports_graph_capture)
        reason = no_capture_reason(self.config)
        if self.graph_sizes and reason:
            logger.info("graphs off (graph_capture_sizes=%s): %s", self.graph_sizes, reason)
            self.graph_sizes = []
        model_len = int(self.hf_config.get("max_position_embeddings") or 2048)
        self.max_model_len = min(self.config.model.max_model_len or model_len, model_len)
        self.vocab_size = int(self.hf_config["vocab_size"])
        self._build_stages(model)
        for stage in self.stages:
            stage.load_model(model, current_platform)

    def _build_stages(self, model: Any) -> None:
        """The stages that need the model: LoRA's adapter slots over its layers, and what this
        rank makes of its forward."""
        if self.config.lora.enable_lora:
            self.lora = LoRAStage(
                LoRAModelManager(model, self.config.lora, self.hf_config, self.dtype, self.device)
            )
        if self.pp_group.is_last and self.config.model.runner == "pooling":
            model_config = self.config.model
            pooling = PoolingOutput(model_config.pooling_type, model_config.pooling_normalize)
            self.output = self.pooling = pooling
        elif self.pp_group.is_last:
            grammar_mask = GrammarMask(self.device)
            self.output = SamplingOutput(model, self.sampling, grammar_mask, self.prompt_logprobs)

    def get_kv_cache_bytes_per_block(self) -> int:
        """The target's keys and values of one block, plus what the stages add (a draft model's
        own cache over the same block ids)."""
        num_bytes = kv_cache_bytes_per_token(self.hf_config, self.dtype) * self.block_size
        return num_bytes + sum(stage.get_kv_cache_bytes_per_block() for stage in self.stages)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model, self.attn_backend, num_blocks, self.block_size, self.dtype, self.device
        )
        block_dim = kv_cache_block_dim(self.attn_backend)
        for stage in self.stages:
            stage.initialize_kv_cache(num_blocks)
            stage.register_kv_caches(self.kv_caches, block_dim)
        self.attention_layers = self.model.attention_layers()
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            self.config.scheduler.max_num_seqs,
            self.max_model_len,
            max_blocks_per_req,
            self.vocab_size,
            self.device,
        )
        self.metadata_builder = self.attn_backend.get_metadata_builder_cls()(
            self.block_size, self.device
        )

    # -- one step ----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.input_batch is not None, "initialize_kv_cache() must run before execute_model()"
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # No forward; a KV connector's background transfers still report (or nothing).
            report = self.kv_connector.without_forward(scheduler_output.kv_connector_metadata)
            if report is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, kv_connector_output=report)
        plan = self._prepare(scheduler_output)
        hidden_states = self._forward(plan)
        for stage in self.stages:
            stage.after_forward(plan)
        sampled = self.output.sample(plan, hidden_states)
        return self.output.commit(plan, sampled)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the batch and tell the stages."""
        batch = self.input_batch
        assert batch is not None
        finished = list(scheduler_output.finished_req_ids)
        for stage in self.stages:
            stage.remove_requests(finished)
        for req_id in finished:
            batch.remove_request(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = batch.req_id_to_index[req_id]
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = num_computed
        self.output.receive_tokens(batch, cached)
        new_reqs = scheduler_output.scheduled_new_reqs
        for new in new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: start afresh
            batch.add_request(new)
        for stage in self.stages:
            stage.add_requests(new_reqs)

    def _prepare(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """The step's plan: its requests, inputs, sampler and logits rows; then each stage's
        ``before_forward``."""
        batch = self.input_batch
        assert batch is not None
        num_tokens = scheduler_output.num_scheduled_tokens
        rows = [row for row, req_id in enumerate(batch.req_ids) if num_tokens.get(req_id, 0) > 0]
        req_ids = [batch.req_ids[row] for row in rows]
        num_scheduled = np.array([num_tokens[req_id] for req_id in req_ids], dtype=np.int64)
        # Before the inputs are read: a speculative step writes its drafts into the batch.
        sampler = self.sampling.step_sampler(
            batch, rows, scheduler_output.scheduled_spec_decode_tokens
        )
        input_ids, positions, common = self._prepare_inputs(rows, num_scheduled)
        num_computed_after = batch.num_computed_tokens[rows] + num_scheduled
        num_positions = sampler.num_positions
        plan = StepPlan(
            scheduler_output=scheduler_output,
            batch=batch,
            rows=rows,
            req_ids=req_ids,
            num_scheduled=num_scheduled,
            num_computed_after=num_computed_after,
            is_partial=num_computed_after < batch.num_tokens[rows],
            input_ids=input_ids,
            positions=positions,
            common=common,
            sampler=sampler,
            logits_indices=sampler.logits_indices(common),
            num_positions=num_positions,
            logits_starts=np.cumsum(num_positions) - num_positions,
        )
        for stage in self.stages:
            stage.before_forward(plan)
        return plan

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The model over the step's tokens: [num_tokens (padded), hidden] (on a stage before
        the last, what it passed on)."""
        attn_metadata = self.metadata_builder.build(plan.common)
        input_ids, positions, model = plan.input_ids, plan.positions, self.model
        # A graph depends on the token count only (attention reads the step's metadata at run
        # time), so any step that fits a bucket replays it, speculative verifications included.
        graph_size = padded_size(self.graph_sizes, len(input_ids))
        if graph_size is not None:
            # Padding rows get no KV slot (the metadata covers the real tokens only); see graph.py.
            input_ids, positions = _pad(input_ids, graph_size), _pad(positions, graph_size)
            model = self.runnable
        context = ForwardContext(
            attn_metadata,
            len(input_ids),
            attention_layers=self.attention_layers,
            kv_connector=plan.kv_connector,
        )
        with set_forward_context(context):
            return model(input_ids, positions)

    def _prepare_inputs(
        self, rows: list[int], num_scheduled: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
        batch = self.input_batch
        assert batch is not None
        rows_arr = np.asarray(rows, dtype=np.int64)
        num_reqs, num_tokens = len(rows), int(num_scheduled.sum())
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        computed = batch.num_computed_tokens[rows_arr]
        # Request index of every scheduled token, then its position in its request.
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)  # [num_tokens]
        offsets = np.arange(num_tokens) - query_start_loc[req_indices]
        positions = computed[req_indices] + offsets  # [num_tokens]
        token_rows = rows_arr[req_indices]
        input_ids = batch.token_ids[token_rows, positions]  # [num_tokens]
        block_ids = batch.block_table[token_rows, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        seq_lens = computed + num_scheduled
        max_blocks = int(batch.num_blocks[rows_arr].max())
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            num_computed_tokens=torch.from_numpy(computed.astype(np.int32)),
            block_table=torch.from_numpy(
                np.ascontiguousarray(batch.block_table[rows_arr, :max_blocks])
            ),
            slot_mapping=torch.from_numpy(slot_mapping),
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            num_prompt_tokens=torch.from_numpy(batch.num_prompt_tokens[rows_arr].astype(np.int32)),
        )
        return (
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            common,
        )

    def capture_model(self) -> list[int]:
        """Capture the graph wrapper's buckets: ``capture``, then one dummy decode per bucket;
        returns the buckets (empty: nothing to capture).

        Each dummy step decodes ``size`` one-token requests whose keys and values go to the null
        block, which no request owns; nothing else in the KV cache is written.
        """
        if not self.graph_sizes:
            return []
        self.runnable.capture(list(self.graph_sizes))
        null_table = [NULL_BLOCK_ID]
        for size in reversed(self.graph_sizes):
            common = CommonAttentionMetadata.from_block_tables(
                [1] * size, [0] * size, [null_table] * size, self.block_size
            )
            attn_metadata = self.metadata_builder.build(common)
            input_ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            positions = torch.zeros(size, dtype=torch.int64, device=self.device)
            context = ForwardContext(attn_metadata, size, attention_layers=self.attention_layers)
            with set_forward_context(context):
                self.runnable(input_ids, positions)
        return list(self.graph_sizes)

    def get_max_model_len(self) -> int:
        return self.max_model_len

    def dummy_run(self, num_tokens: int) -> None:
        """Run the model once without attention metadata (warm-up; attention returns zeros)."""
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        with set_forward_context(ForwardContext(None, num_tokens=num_tokens)):
            self.runnable(input_ids, positions)


def _pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` [n] followed by zeros up to [size]."""
    out = x.new_zeros(size)
    out[: x.shape[0]] = x
    return out
