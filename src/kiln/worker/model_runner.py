"""The reference model runner: ``SchedulerOutput`` in, ``ModelRunnerOutput`` out.

Each step it (1) applies the scheduler's diff to the persistent batch, (2) prepares the flattened
input ids, positions and ``CommonAttentionMetadata`` with vectorised NumPy gathers, (3) runs the
model inside a forward context, computes logits for the last scheduled token of each request (and
for prompt positions of requests that asked for prompt logprobs), (4) samples, and (5) reads the
result back with one host sync. Logprobs leave it complete and per request: the sampled token's
row for each request that asked, and a request's prompt logprobs whole (gathered across prefill
chunks) in the step that samples its first token. It is device-agnostic PyTorch: platforms reuse
it or subclass it.

Graphs: a step of at most the largest bucket's tokens (decodes, speculative verifications, short
prompts, in any mix) is padded to the smallest bucket that holds it and runs through the
platform's graph wrapper, which ``capture_model`` prepared at start-up; a larger step runs the
model eagerly. The contract is in ``kiln.worker.graph``; with the reference platform's defaults
there are no buckets and no padding.

Speculative decoding (``kiln.spec_decode.speculator``): a request scheduled with drafts gets
logits at its last ``1 + k`` positions, each sampled with the metadata of its position, and the
platform's rejection sampler decides what it emits (its accepted drafts and one more token);
after sampling the platform's proposer drafts the next step's tokens of every request that
emitted some (``ModelRunnerOutput.spec_token_ids``). A request with a grammar speculates too: its
bitmask has a row per position (the scheduler's, see ``SchedulerOutput.grammar_bitmask``), so
the rejection sampler verifies its drafts against grammar-masked logits.

It knows nothing about scheduling policy or text; the platform's attention backend, graph wrapper
and device come from the config and the platform.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kiln.config import KilnConfig, set_current_config
from kiln.distributed.parallel_state import SINGLE_STAGE, get_pp_group
from kiln.forward_context import ForwardContext, set_forward_context
from kiln.lora.model_manager import LoRAModelManager
from kiln.messages import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kiln.model_executor.layers.attention import (
    CommonAttentionMetadata,
    allocate_kv_caches,
    resolve_attn_backend,
)
from kiln.model_executor.layers.token_bitmask import ApplyTokenBitmask
from kiln.model_executor.loader import resolve_model_ref
from kiln.model_executor.model_loader import kv_cache_bytes_per_token, load_model
from kiln.sampling.sampler import (
    Sampler,
    compute_prompt_logprobs,
)
from kiln.scheduler.kv_cache import NULL_BLOCK_ID
from kiln.spec_decode.speculator import Speculator
from kiln.spec_decode.verify import emitted_tokens, logits_positions
from kiln.utils import resolve_obj_by_qualname
from kiln.worker.graph import graph_capture_sizes, no_capture_reason, padded_size
from kiln.worker.input_batch import InputBatch
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
        self.apply_token_bitmask = ApplyTokenBitmask()
        self.speculator: Speculator | None = None
        """The proposer and rejection sampler, with ``speculative.method``."""
        if config.speculative.method is not None:
            self.speculator = Speculator(config, device)
        self.model: Any = None
        self.pp_group = SINGLE_STAGE
        """This rank's pipeline stage (the worker's ``set_pp_group``); set by ``load_model``."""
        self.graph_sizes: list[int] = []
        """Decode buckets, ascending (empty: no graphs, no padding); set by ``load_model``."""
        self.hf_config: dict[str, Any] = {}
        self.max_model_len = 0
        self.input_batch: InputBatch | None = None
        self.lora_manager: LoRAModelManager | None = None
        """Adapter slots over the model, when ``lora.enable_lora``."""
        self.kv_caches: dict[str, torch.Tensor] = {}
        # Prompt logprobs of chunked prefills, gathered until the prompt is complete.
        self._prompt_logprobs: dict[str, list[LogprobsLists]] = {}

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
        if self.config.lora.enable_lora:
            self.lora_manager = LoRAModelManager(
                model, self.config.lora, self.hf_config, self.dtype, self.device
            )
        model_len = int(self.hf_config.get("max_position_embeddings") or 2048)
        self.max_model_len = min(self.config.model.max_model_len or model_len, model_len)
        self.vocab_size = int(self.hf_config["vocab_size"])
        if self.speculator is not None:
            self.speculator.load_model(model, current_platform)

    def get_kv_cache_bytes_per_block(self) -> int:
        """The target's keys and values of one block, plus a draft model's (which has its own
        cache over the same block ids)."""
        num_bytes = kv_cache_bytes_per_token(self.hf_config, self.dtype) * self.block_size
        if self.speculator is not None:
            num_bytes += self.speculator.get_kv_cache_bytes_per_block()
        return num_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model, self.attn_backend, num_blocks, self.block_size, self.dtype, self.device
        )
        if self.speculator is not None:
            self.speculator.initialize_kv_cache(num_blocks)
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
        batch = self.input_batch
        assert batch is not None, "initialize_kv_cache() must run before execute_model()"
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        rows = [
            row
            for row, req_id in enumerate(batch.req_ids)
            if scheduler_output.num_scheduled_tokens.get(req_id, 0) > 0
        ]
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[batch.req_ids[row]] for row in rows],
            dtype=np.int64,
        )
        drafts = None
        if self.speculator is not None:
            spec_tokens = scheduler_output.scheduled_spec_decode_tokens
            drafts = self.speculator.write_drafts(batch, rows, spec_tokens)
        input_ids, positions, common = self._prepare_inputs(rows, num_scheduled)
        failed_requests: dict[str, str] = {}
        if self.lora_manager is not None:
            failed_requests = self.lora_manager.set_active_loras(
                [batch.req_ids[row] for row in rows], num_scheduled
            )
        attn_metadata = self.metadata_builder.build(common)
        # Each request's logits rows: its last position, or with drafts its last 1 + k.
        num_positions = np.ones(len(rows), dtype=np.int64)
        if drafts is None:
            logits_indices = common.query_start_loc[1:].to(torch.int64) - 1  # [num_reqs]
        else:
            num_positions += [len(d) for d in drafts]
            logits_indices = torch.from_numpy(
                logits_positions(common.query_start_loc.numpy().astype(np.int64), num_positions - 1)
            )  # [P]
        ends = np.cumsum(num_positions)  # request i's logits rows: ends[i] - num_positions[i] ..
        starts = ends - num_positions
        num_tokens = len(input_ids)
        # A graph depends on the token count only (attention reads the step's metadata at run
        # time), so any step that fits a bucket replays it, speculative verifications included.
        graph_size = padded_size(self.graph_sizes, num_tokens)
        model = self.model
        if graph_size is not None:
            # Padding rows get no KV slot (the metadata covers the real tokens only); see graph.py.
            input_ids = _pad(input_ids, graph_size)
            positions = _pad(positions, graph_size)
            model = self.runnable
        context = ForwardContext(
            attn_metadata, len(input_ids), attention_layers=self.attention_layers
        )
        with set_forward_context(context):
            hidden_states = model(input_ids, positions)  # [num_tokens (padded), hidden]
            if not self.pp_group.is_last:
                return self._follow_last_stage(rows, num_scheduled)
            logits = self.model.compute_logits(hidden_states[logits_indices])  # [P, V]

        # A request still inside its prompt after this step samples nothing; its generator must
        # not advance, so a seed gives the same tokens however the prompt was chunked.
        computed_after = batch.num_computed_tokens[rows] + num_scheduled
        is_partial = computed_after < batch.num_tokens[rows]
        if drafts is None:
            metadata = batch.sampling_metadata(rows)
        else:
            assert self.speculator is not None
            metadata = self.speculator.expand_metadata(batch, rows, drafts)
        last_positions = (ends - 1).tolist()
        saved = {
            p: metadata.generators[p].get_state()
            for p in (last_positions[i] for i in np.flatnonzero(is_partial).tolist())
            if p in metadata.generators
        }
        if scheduler_output.grammar_bitmask is not None:
            logits = self._apply_grammar_bitmask(
                logits, rows, starts, num_positions, scheduler_output
            )
        if drafts is None:
            sampler_output = self.sampler(logits, metadata)
            logprobs_tensors = sampler_output.logprobs_tensors
            sampled_t = sampler_output.sampled_token_ids
        else:
            assert self.speculator is not None
            logprobs_tensors, verified = self.speculator.verify(
                self.sampler, logits, metadata, [batch.req_ids[row] for row in rows], drafts
            )
        for p, state in saved.items():
            metadata.generators[p].set_state(state)

        prompt_logprobs = self._prompt_logprobs_step(rows, num_scheduled, hidden_states, common)
        if drafts is None:
            tokens = [[t] for t in sampled_t.tolist()]  # the step's one host sync
        else:
            tokens = emitted_tokens(*verified, [len(d) for d in drafts])
        rows_logprobs = None  # [P] rows, when some request asked for logprobs
        if logprobs_tensors is not None:
            rows_logprobs = LogprobsLists(*logprobs_tensors.tolists())

        req_ids = [batch.req_ids[row] for row in rows]
        sampled_token_ids: list[list[int]] = []
        logprobs: dict[str, LogprobsLists] = {}
        for i, row in enumerate(rows):
            if is_partial[i]:
                batch.num_computed_tokens[row] = computed_after[i]
                sampled_token_ids.append([])
                continue
            new_tokens = tokens[i]
            # Rejected drafts are not computed tokens: their slots are written over later.
            batch.num_computed_tokens[row] = computed_after[i] - num_positions[i] + len(new_tokens)
            for token_id in new_tokens:
                batch.append_token(row, token_id)
            sampled_token_ids.append(new_tokens)
            if (
                rows_logprobs is not None
                and batch.requests[row].sampling_params.logprobs is not None
            ):
                first, last = int(starts[i]), int(starts[i]) + len(new_tokens)
                logprobs[req_ids[i]] = LogprobsLists(
                    rows_logprobs.logprob_token_ids[first:last],
                    rows_logprobs.logprobs[first:last],
                    rows_logprobs.sampled_token_ranks[first:last],
                )
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            spec_token_ids=(
                self.speculator.propose(batch, rows, sampled_token_ids)
                if self.speculator is not None
                else []
            ),
            failed_requests=failed_requests,
        )

    def _follow_last_stage(self, rows: list[int], num_scheduled: np.ndarray) -> ModelRunnerOutput:
        """A stage before the last: count the step's tokens computed and answer nothing, without
        waiting for the last stage (its sampled tokens come with a later step's
        ``CachedRequestData.new_token_ids``), so the next batch can start here meanwhile."""
        batch = self.input_batch
        assert batch is not None
        batch.num_computed_tokens[rows] += num_scheduled
        return EMPTY_MODEL_RUNNER_OUTPUT

    def _apply_grammar_bitmask(
        self,
        logits: torch.Tensor,
        rows: list[int],
        starts: np.ndarray,
        num_positions: np.ndarray,
        scheduler_output: SchedulerOutput,
    ) -> torch.Tensor:
        """Structured outputs: forbid what each grammar forbids, before the sampler, so logprobs
        see the masked distribution too (as vLLM applies it before its sampler).

        Request ``i`` (of ``rows``) has logits rows ``starts[i] ..`` for its ``num_positions[i]``
        positions (its last, or with ``k`` drafts its last ``1 + k``); a structured request has
        as many bitmask rows, in the same order."""
        assert scheduler_output.grammar_bitmask is not None
        batch = self.input_batch
        assert batch is not None
        index = {batch.req_ids[row]: i for i, row in enumerate(rows)}
        masked_rows: list[int] = []
        for req_id in scheduler_output.structured_output_request_ids:
            i = index[req_id]
            masked_rows.extend(range(int(starts[i]), int(starts[i] + num_positions[i])))
        assert len(masked_rows) == len(scheduler_output.grammar_bitmask), "a row per position"
        bitmask = torch.from_numpy(scheduler_output.grammar_bitmask).to(self.device)
        masked_rows_t = torch.tensor(masked_rows, dtype=torch.int64).to(self.device)
        return self.apply_token_bitmask(logits, bitmask, masked_rows_t)  # [P, V]

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        assert batch is not None
        if self.speculator is not None:
            # Finished, preempted or resumed: the proposer forgets them (a draft model's cache
            # of a resumed request is rebuilt).
            new_ids = [new.req_id for new in scheduler_output.scheduled_new_reqs]
            self.speculator.remove_requests([*scheduler_output.finished_req_ids, *new_ids])
        for req_id in scheduler_output.finished_req_ids:
            batch.remove_request(req_id)
            self._prompt_logprobs.pop(req_id, None)
            if self.lora_manager is not None:
                self.lora_manager.remove_request(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for i, (req_id, new_blocks, num_computed) in enumerate(
            zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)
        ):
            row = batch.req_id_to_index[req_id]
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = num_computed
            if cached.new_token_ids and not self.pp_group.is_last:
                # Pipelined: the tokens the last stage sampled since this stage last ran it.
                new_token_ids = cached.new_token_ids[i]
                num_missing = num_computed + len(new_token_ids) - int(batch.num_tokens[row])
                for token_id in new_token_ids[len(new_token_ids) - num_missing :]:
                    batch.append_token(row, token_id)
        for new in scheduler_output.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: start afresh
            batch.add_request(new)
            if self.lora_manager is not None:
                self.lora_manager.add_request(new.req_id, new.lora_request)

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

    def _prompt_logprobs_step(
        self,
        rows: list[int],
        num_scheduled: np.ndarray,
        hidden_states: torch.Tensor,
        common: CommonAttentionMetadata,
    ) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens computed this step, for requests that asked.

        Position ``p`` predicts prompt token ``p + 1``; a request's complete list (``P - 1``
        entries) is returned in the step its prefill finishes.
        """
        batch = self.input_batch
        assert batch is not None
        result: dict[str, LogprobsLists] = {}
        if not any(batch.requests[row].sampling_params.prompt_logprobs is not None for row in rows):
            return result  # the common case: no per-step work
        starts = common.query_start_loc.tolist()
        for i, row in enumerate(rows):
            state = batch.requests[row]
            num_logprobs = state.sampling_params.prompt_logprobs
            num_prompt = int(batch.num_prompt_tokens[row])
            start = int(common.num_computed_tokens[i])
            if num_logprobs is None or start >= num_prompt:
                continue
            end = min(start + int(num_scheduled[i]), num_prompt - 1)  # last position with a target
            chunks = self._prompt_logprobs.setdefault(state.req_id, [])
            if end > start:
                token_start = starts[i]
                logits = self.model.compute_logits(
                    hidden_states[token_start : token_start + end - start]
                )
                targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1])
                chunks.append(
                    LogprobsLists(*compute_prompt_logprobs(logits, targets, num_logprobs).tolists())
                )
            if start + int(num_scheduled[i]) >= num_prompt:
                parts = self._prompt_logprobs.pop(state.req_id)
                result[state.req_id] = LogprobsLists(
                    [r for p in parts for r in p.logprob_token_ids],
                    [r for p in parts for r in p.logprobs],
                    [r for p in parts for r in p.sampled_token_ranks],
                )
        return result

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
