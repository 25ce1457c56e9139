"""Kiln's plugin API: every name a platform or general plugin may import, with its contract.

A plugin imports Kiln only from here (``from kiln.plugin_api import Platform, register_impl``) and,
for the conformance kit, from ``kiln.plugin_api.conformance``. Each name below is re-exported from
the module that defines it, unchanged: its old import path keeps working, but only the names listed
here are the supported contract; everything else in Kiln may change without notice.
``docs/plugins.md`` ("What a plugin may import") is generated from ``API`` by
``scripts/plugin_api_doc.py``, and a test fails when the two disagree.

Names resolve lazily, on first access (PEP 562): importing this module imports nothing else of
Kiln, so a detector that imports it still costs nothing. ``current_platform`` is read anew on
every access (it is an error before the lifecycle selects a platform).

This module knows nothing itself: it is a table of names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ApiName:
    """One supported name: where it is defined and what a plugin may rely on."""

    module: str
    """The module that defines it (its old import path, still valid)."""
    contract: str
    """What it is for and what Kiln promises (markdown, one paragraph)."""


API: dict[str, dict[str, ApiName]] = {
    "Platform": {
        "Platform": ApiName(
            "kiln.platforms.interface",
            "the platform base class: class attributes and classmethods, never instantiated "
            "(docs/plugins.md, section 3)",
        ),
        "PLATFORM_API_VERSION": ApiName(
            "kiln.platforms.interface",
            "the platform API this Kiln provides; a platform whose `api_version` has another "
            "major is refused",
        ),
        "CpuPlatform": ApiName(
            "kiln.platforms.cpu",
            "Kiln's reference platform (host memory, thread count, dtype choice), to subclass "
            "for a host-memory device; its members are `Platform`'s",
        ),
        "CpuOptions": ApiName(
            "kiln.platforms.cpu",
            "`CpuPlatform`'s config section (`num_threads`), declared as `cpu`",
        ),
        "current_platform": ApiName(
            "kiln.platforms",
            "the platform this process's lifecycle chose (in a worker, a runner, a platform "
            "hook); reading it before `init_process` is a `RuntimeError`",
        ),
        "process_role": ApiName(
            "kiln.platforms",
            "`process_role()`: `api`, `engine`, `worker` or `offline`, or None before the "
            "lifecycle",
        ),
        "worker_cpus": ApiName(
            "kiln.platforms",
            "`worker_cpus(config, cpus)`: the cores of `cpus` this worker may run on when the "
            "server's workers (`data_parallel_size` engines of `tensor_parallel_size` ranks, this "
            "one `config.parallel.data_parallel_rank`, `config.parallel.rank`) share them: "
            "contiguous, disjoint, engine-major shares; call it in `init_worker_process` before "
            "sizing or pinning a thread pool",
        ),
        "cpu_flags": ApiName(
            "kiln.platforms",
            "`cpu_flags()`: the instruction-set flags Linux lists for this machine's CPU "
            "(`/proc/cpuinfo`'s `flags`: `avx512_bf16`, `amx_bf16`, ...) as a frozenset, empty "
            "where there are none; read once per process; `cpu_flags(cpuinfo)` reads another "
            "cpuinfo file (a test's; each path once)",
        ),
    },
    "Config": {
        "KilnConfig": ApiName(
            "kiln.config",
            "the config (frozen); `config.replace(section__field=value)` returns a changed copy",
        ),
        "get_current_config": ApiName(
            "kiln.config",
            "the config of the engine part being built (inside the model runner's config "
            "context, where layers are built), else None",
        ),
        "PLUGIN_CONFIG_REGISTRY": ApiName(
            "kiln.plugins.config",
            "config sections: `declare(name, Dataclass)`, `get(name, config)` reads the "
            "validated section",
        ),
    },
    "Worker and model runner": {
        "WorkerBase": ApiName("kiln.worker.worker_base", "the worker interface (`worker_cls`)"),
        "ModelRunnerBase": ApiName(
            "kiln.worker.worker_base",
            "the model runner interface (`model_runner_cls`): what the reference worker calls",
        ),
        "Worker": ApiName("kiln.worker.worker", "Kiln's reference worker, to subclass"),
        "ModelRunner": ApiName(
            "kiln.worker.model_runner", "Kiln's reference model runner, to subclass"
        ),
        "SchedulerOutput": ApiName(
            "kiln.messages", "what a worker's `execute_model` takes (a plain dataclass)"
        ),
        "ModelRunnerOutput": ApiName(
            "kiln.messages",
            "what a worker's `execute_model` returns: sampled token ids per request",
        ),
    },
    "Scheduler": {
        "SchedulerInterface": ApiName(
            "kiln.scheduler.interface",
            "the scheduler interface (`scheduler_cls`): `__init__(config, num_blocks)`, "
            "`add_request(request)`, `schedule() -> SchedulerOutput`, "
            "`update_from_output(scheduler_output, model_runner_output)`, `finish_requests`, "
            "`has_unfinished_requests`, `get_num_unfinished_requests`",
        ),
        "Scheduler": ApiName(
            "kiln.scheduler.scheduler",
            "Kiln's scheduler, to subclass. Extension points: the attributes "
            "`max_num_batched_tokens` (this step's token budget) and `max_num_seqs` (its "
            "request limit), read by every `schedule()`, which a subclass may lower between "
            "steps but never raise above the config's (`scheduler.max_num_batched_tokens`, "
            "`scheduler.max_num_seqs`); `requests` (request id -> `Request`), `running` (the "
            "running requests, in scheduling order) and `waiting` (the queue; `len()`), read "
            "only; override `schedule()` and call `super().schedule()`",
        ),
        "Request": ApiName(
            "kiln.scheduler.request",
            "a request as the scheduler sees it, read only: `request_id`, `prompt_token_ids`, "
            "`output_token_ids`, `sampling_params`, `priority`, `arrival_time`, `status`, "
            "`num_computed_tokens` (tokens in the KV cache), `num_tokens`, `num_prompt_tokens`, "
            "`num_output_tokens`, `num_cached_tokens` (prefix-cache hit, -1 before its first "
            "step), `is_finished`",
        ),
        "RequestStatus": ApiName(
            "kiln.scheduler.request",
            "`Request.status`: `WAITING`, `WAITING_FOR_GRAMMAR`, `WAITING_FOR_REMOTE_KVS`, "
            "`RUNNING`, `PREEMPTED`, then the finished ones (`RequestStatus.is_finished(status)`)",
        ),
    },
    "Attention": {
        "AttentionBackend": ApiName(
            "kiln.model_executor.layers.attention.backend",
            "the attention backend base (`attention_backend` must subclass it)",
        ),
        "AttentionImpl": ApiName(
            "kiln.model_executor.layers.attention.backend", "one attention layer's implementation"
        ),
        "AttentionMetadataBuilder": ApiName(
            "kiln.model_executor.layers.attention.backend",
            "builds the backend's metadata once per step",
        ),
        "CommonAttentionMetadata": ApiName(
            "kiln.model_executor.layers.attention.backend",
            "what a builder's `build(common)` receives (CPU tensors; do not modify)",
        ),
        "CPUAttentionBackend": ApiName(
            "kiln.model_executor.layers.attention.backends.cpu",
            "Kiln's reference paged attention in PyTorch (the `cpu` platform's): a fallback a "
            "backend may hand calls to (its `get_impl_cls()`, `get_metadata_builder_cls()`)",
        ),
    },
    "Ops": {
        "CustomOp": ApiName(
            "kiln.model_executor.custom_op",
            "base of every op: `forward_native` and `make_examples(generator)`",
        ),
        "register_op": ApiName(
            "kiln.model_executor.custom_op",
            "`@register_op(name)`: make a `CustomOp` subclass an op",
        ),
        "register_impl": ApiName(
            "kiln.model_executor.custom_op",
            "`@register_impl(op, provider, *, device_type, priority=0, supports=None, "
            "override=False)`: an implementation `fn(op, *args, **kwargs)`; registering the "
            "same one again is a no-op, where a function or `supports` predicate re-created by "
            "running the same `def` or `lambda` again (a nested function of `register()`) "
            "counts as the same when its qualified name, code, defaults and captured values are",
        ),
        "OP_REGISTRY": ApiName(
            "kiln.model_executor.custom_op",
            "the op registry (`implementations(op, device_type)`, `register_op`, `register_impl`)",
        ),
        "is_capturing": ApiName(
            "kiln.model_executor.custom_op",
            "True while a graph wrapper records the model: call dispatcher ops "
            "(`torch.ops.*`) then, not Python bindings",
        ),
        "RMSNorm": ApiName("kiln.model_executor.layers.layernorm", "op `rms_norm`"),
        "SiluAndMul": ApiName("kiln.model_executor.layers.activation", "op `silu_and_mul`"),
        "RotaryEmbedding": ApiName(
            "kiln.model_executor.layers.rotary_embedding", "op `rotary_embedding`"
        ),
        "LinearBase": ApiName(
            "kiln.model_executor.layers.linear", "op `linear` (every linear layer subclasses it)"
        ),
        "VocabParallelEmbedding": ApiName(
            "kiln.model_executor.layers.vocab_embedding", "op `vocab_parallel_embedding`"
        ),
        "LogitsProcessor": ApiName(
            "kiln.model_executor.layers.vocab_embedding", "op `logits_processor`"
        ),
        "ApplyTokenBitmask": ApiName(
            "kiln.model_executor.layers.token_bitmask", "op `apply_token_bitmask`"
        ),
        "LoRAApply": ApiName("kiln.model_executor.layers.lora", "op `lora_apply`"),
        "FusedMoE": ApiName(
            "kiln.model_executor.layers.fused_moe",
            "op `fused_moe`: the routed experts of an MoE layer (this rank's `w13_weight "
            "[L, 2I, H]`, `w2_weight [L, H, I]` from expert `expert_offset`, `top_k`, "
            "`renormalize`, `scoring_func`); the layer all-reduces the op's result over "
            "tensor-parallel ranks and adds shared experts",
        ),
        "select_experts": ApiName(
            "kiln.model_executor.layers.fused_moe",
            "`select_experts(router_logits, top_k, renormalize, scoring_func) -> (weights [T, "
            "top_k] float32, ids [T, top_k] int64)`: the op's routing, for an implementation "
            "that routes in torch and runs only the experts itself",
        ),
    },
    "Linear methods and quantization": {
        "LinearMethodBase": ApiName(
            "kiln.model_executor.layers.linear",
            "a linear layer's method: owns its parameters (`create_weights`) and its product "
            "(`apply`)",
        ),
        "UnquantizedLinearMethod": ApiName(
            "kiln.model_executor.layers.linear", "the dense method: `x @ weight.T + bias`"
        ),
        "QuantizationConfig": ApiName(
            "kiln.model_executor.layers.linear",
            "what `Platform.get_quant_config(method, config)` returns: "
            "`get_linear_method(layer, prefix)` gives each linear layer its method",
        ),
        "GGUFQuantConfig": ApiName(
            "kiln.model_executor.layers.quantization",
            "Kiln's `gguf` method (weights kept in their GGUF blocks), to subclass",
        ),
        "GGUFLinearMethod": ApiName(
            "kiln.model_executor.layers.quantization",
            "the reference GGUF linear method (dequantize, then matmul), to subclass",
        ),
        "GGUFWeight": ApiName(
            "kiln.model_executor.layers.quantization",
            "a GGUF weight as loaded: its raw blocks, GGML type and logical shape",
        ),
        "Int8QuantConfig": ApiName(
            "kiln.model_executor.layers.quantization",
            "Kiln's `int8` method (per-row int8 weights and float scales), to subclass",
        ),
        "Int8LinearMethod": ApiName(
            "kiln.model_executor.layers.quantization",
            "the reference int8 linear method, to subclass",
        ),
        "Int4QuantConfig": ApiName(
            "kiln.model_executor.layers.quantization",
            "Kiln's `int4` method (packed int4 weights, a scale per `INT4_GROUP_SIZE` inputs), "
            "to subclass",
        ),
        "Int4LinearMethod": ApiName(
            "kiln.model_executor.layers.quantization",
            "the reference int4 linear method, to subclass",
        ),
        "INT4_GROUP_SIZE": ApiName(
            "kiln.model_executor.layers.quantization",
            "inputs per int4 scale (32)",
        ),
        "unpack_int4": ApiName(
            "kiln.model_executor.layers.quantization",
            "`unpack_int4(qweight)`: the int8 values of packed int4 weights",
        ),
    },
    "Collectives and graphs": {
        "Communicator": ApiName(
            "kiln.distributed.communicator",
            "the communicator interface (`communicator_cls`): `all_reduce` returns the sum and "
            "may reduce in place (callers use the result, never the argument after); a "
            "communicator given `ranks=` creates its own sub-group, made by its members only",
        ),
        "TorchDistCommunicator": ApiName(
            "kiln.distributed.communicator",
            "Kiln's `torch.distributed` communicator, the identity for one rank",
        ),
        "GraphWrapper": ApiName(
            "kiln.worker.graph",
            "the graph wrapper interface (`graph_wrapper_cls`); Kiln captures no graph under "
            "tensor or pipeline parallelism",
        ),
        "EagerGraphWrapper": ApiName("kiln.worker.graph", "captures nothing (the reference)"),
    },
    "Speculative decoding": {
        "ProposerBase": ApiName("kiln.spec_decode.interface", "a draft proposer (`proposer_cls`)"),
        "ProposalInputs": ApiName("kiln.spec_decode.interface", "what `propose(inputs)` reads"),
        "RejectionSamplerBase": ApiName(
            "kiln.spec_decode.interface", "a rejection sampler (`rejection_sampler_cls`)"
        ),
        "RejectionOutput": ApiName(
            "kiln.spec_decode.interface", "what a rejection sampler returns"
        ),
        "NgramProposer": ApiName("kiln.spec_decode.ngram", "Kiln's n-gram proposer"),
        "DraftModelProposer": ApiName(
            "kiln.spec_decode.draft_model", "Kiln's draft-model proposer"
        ),
        "RejectionSampler": ApiName(
            "kiln.spec_decode.rejection_sampler", "Kiln's rejection sampler"
        ),
        "SamplingMetadata": ApiName(
            "kiln.sampling.metadata", "one step's sampling parameters, one row per position"
        ),
    },
    "Models, loaders and parsers": {
        "MODEL_REGISTRY": ApiName(
            "kiln.model_executor.registry",
            '`MODEL_REGISTRY.register("ArchName", "pkg.mod.ModelCls")`',
        ),
        "LOADER_REGISTRY": ApiName(
            "kiln.model_executor.loader",
            '`LOADER_REGISTRY.register("name", "pkg.mod.LoaderCls")`; `--load-format name`',
        ),
        "ModelLoader": ApiName("kiln.model_executor.loader.base", "the loader base class"),
        "TOOL_PARSER_REGISTRY": ApiName(
            "kiln.entrypoints.openai.tool_parsers",
            '`TOOL_PARSER_REGISTRY.register("name", "pkg.mod.MyToolParser")`; '
            "`--tool-call-parser name`",
        ),
        "ToolParser": ApiName("kiln.entrypoints.openai.tool_parsers", "the tool parser base"),
        "ToolParserOptions": ApiName(
            "kiln.entrypoints.openai.tool_parsers", "a choice's tool names and limits"
        ),
        "DeltaMessage": ApiName(
            "kiln.entrypoints.openai.tool_parsers", "a streamed piece of a choice"
        ),
        "DeltaToolCall": ApiName(
            "kiln.entrypoints.openai.tool_parsers", "a streamed piece of a tool call"
        ),
        "CallStreamParser": ApiName(
            "kiln.entrypoints.openai.tool_parsers.base",
            "the tag machine `hermes` and `llama3_json` share",
        ),
        "REASONING_PARSER_REGISTRY": ApiName(
            "kiln.reasoning",
            '`REASONING_PARSER_REGISTRY.register("name", "pkg.mod.MyParser")`; '
            "`--reasoning-parser name`",
        ),
        "ReasoningParser": ApiName("kiln.reasoning", "the reasoning parser base"),
        "ThinkTagReasoningParser": ApiName(
            "kiln.reasoning", "a parser of `start_tag` ... `end_tag`, to subclass"
        ),
    },
    "KV connectors": {
        "KV_CONNECTOR_REGISTRY": ApiName(
            "kiln.kv_transfer.registry",
            '`KV_CONNECTOR_REGISTRY.register("MyConnector", "pkg.mod.MyConnector")` in a general '
            'plugin; `--kv-transfer-config \'{"kv_connector": "MyConnector"}\'`',
        ),
        "KVConnectorBase": ApiName(
            "kiln.kv_transfer.base",
            "the connector base, one class for both roles (docs/kv-connectors.md): scheduler "
            "side `get_num_new_matched_tokens`, `update_state_after_alloc`, "
            "`build_connector_meta`, `request_finished`; worker side `register_kv_caches`, "
            "`start_load_kv`, `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`, "
            "`get_finished`, `get_block_ids_with_load_errors`, `take_stats`",
        ),
        "KVConnectorRole": ApiName(
            "kiln.kv_transfer.base", "`SCHEDULER` or `WORKER`: the side an instance serves"
        ),
        "OffloadingConnector": ApiName(
            "kiln.kv_transfer.offloading",
            "Kiln's CPU tier (`--kv-offloading-size`), to subclass for another tier",
        ),
        "KVConnectorOutput": ApiName(
            "kiln.messages", "a step's report of the worker side, as the scheduler reads it"
        ),
    },
    "Patches (last resort)": {
        "register_patch": ApiName(
            "kiln.patches",
            "`register_patch(target, replacement, *, scope, reason, fingerprint, "
            'on_mismatch="refuse")`; each patch is a missing hook: ask for the hook instead',
        ),
        "fingerprint": ApiName(
            "kiln.patches", "`fingerprint(target)`: the hash of a patch target's source"
        ),
    },
    "Testing": {
        "LogitsTolerance": ApiName(
            "kiln.testing",
            "the kit's `kiln_logits_tolerance` for kernels that are not bit-exact; the kit "
            "itself: `from kiln.plugin_api.conformance import *`",
        ),
        "save_tiny_model": ApiName(
            "kiln.testing.models",
            "a small random model (Llama, Qwen, ...) on disk, for a plugin's own tests",
        ),
    },
}
"""The supported names by group, in the order ``docs/plugins.md`` lists them."""

_WHERE: dict[str, str] = {name: api.module for group in API.values() for name, api in group.items()}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: it is not part of Kiln's plugin API "
            "(see docs/plugins.md, 'What a plugin may import')"
        )
    # Not cached in globals(): current_platform must be read anew.
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*__all__, "API", "ApiName"])
