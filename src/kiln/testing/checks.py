"""Conformance checks that must run in a fresh process: ``python -m kiln.testing.checks NAME
PLATFORM [ARG]`` prints one JSON object on its last line.

- ``idempotence``: run the lifecycle, snapshot every registry, run every loaded general plugin's
  ``register()`` again, snapshot again; the snapshots must be equal and nothing may raise.
- ``ops``: run every op implementation registered for the platform's device type on the op's
  examples and compare with ``forward_native``.
- ``greedy``: greedy tokens of the default model (float32) for prompts that share a prefix, through
  ``LLM`` on the platform with a token budget of 16 (chunked prefill, prefix-cache hits), and the
  teacher-forced log-probabilities of the reference platform's completions; the kit compares them
  with the same run on the reference cpu platform (``kiln.testing.compare_greedy``).
- ``kv_connector``: a prefix evicted from the paged cache and loaded through a KV connector gives
  the tokens and log-probabilities that recomputing it gives.
- ``scheduler``, ``communicator``: the contracts of the platform's scheduler and communicator,
  without a model (``kiln.testing.contracts``).
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch

from kiln.config import DeviceConfig, KilnConfig
from kiln.testing.contracts import check_communicator, check_scheduler


def _init(platform: str) -> None:
    from kiln.plugins import init_process

    init_process("worker", KilnConfig(device=DeviceConfig(platform=platform)))


def _snapshot() -> dict[str, Any]:
    from kiln.model_executor.custom_op import OP_REGISTRY
    from kiln.model_executor.loader import LOADER_REGISTRY
    from kiln.model_executor.registry import MODEL_REGISTRY
    from kiln.plugins.config import PLUGIN_CONFIG_REGISTRY
    from kiln.plugins.manager import get_plugin_manager
    from kiln.plugins.registry import describe, registries

    return {
        "registries": sorted(
            (reg.kind, name, describe(value), reg.source_of(name))
            for reg in registries()
            for name, value in reg.items()
        ),
        "models": sorted((n, describe(v)) for n, v in MODEL_REGISTRY.items()),
        "loaders": sorted((n, describe(v)) for n, v in LOADER_REGISTRY.items()),
        "ops": sorted((n, describe(v)) for n, v in OP_REGISTRY.ops.items()),
        "impls": sorted(
            (i.op, i.provider, i.device_type, i.priority, describe(i.fn))
            for n in OP_REGISTRY.ops.names()
            for i in OP_REGISTRY.implementations(n)
        ),
        "overrides": len(MODEL_REGISTRY.overrides) + len(OP_REGISTRY.overrides),
        "plugin_config": sorted(PLUGIN_CONFIG_REGISTRY.sections.names()),
        "patches": sorted(
            (p.target, p.status) for p in get_plugin_manager().patches.patches.values()
        ),
    }


def check_idempotence(platform: str) -> dict[str, Any]:
    from kiln.plugins.discovery import GENERAL_GROUP, find_entry_points
    from kiln.plugins.manager import get_plugin_manager
    from kiln.plugins.registry import registering_as

    _init(platform)
    manager = get_plugin_manager()
    before = _snapshot()
    loaded = {r.name for r in manager.general_records if r.status == "loaded"}
    errors = []
    for ep in find_entry_points(GENERAL_GROUP):
        if ep.name in loaded:
            try:
                with registering_as(ep.name):
                    ep.load()()
            except Exception:
                errors.append(f"{ep.name}: {traceback.format_exc()}")
    # Running the whole lifecycle again must be a no-op too.
    _init(platform)
    manager.load_general_plugins()
    after = _snapshot()
    return {
        "plugins": sorted(loaded),
        "equal": before == after,
        "before": before,
        "after": after,
        "errors": errors,
    }


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _close(a: Any, b: Any) -> str | None:
    if isinstance(a, torch.Tensor):
        try:
            tol = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-9)}.get(
                a.dtype, (2e-2, 2e-2)
            )
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=tol[0], atol=tol[1])
        except AssertionError as exc:
            return str(exc).splitlines()[0] + " " + " ".join(str(exc).split()[-12:])
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return "different number of outputs"
        for x, y in zip(a, b, strict=True):
            problem = _close(x, y)
            if problem:
                return problem
    return None


def check_ops(platform: str) -> dict[str, Any]:
    from kiln.model_executor.custom_op import OP_REGISTRY

    _init(platform)
    # Imported after _init: the import selects a platform, and only _init selects this one (with
    # another installed platform active too, selecting by detection alone is an error).
    from kiln.platforms import current_platform

    device = current_platform.get_device()
    results = []
    unknown = set(OP_REGISTRY.implemented_ops()) - set(OP_REGISTRY.ops.names())
    for name in sorted(unknown):
        results.append(
            {
                "op": name,
                "provider": "*",
                "status": "unknown-op",
                "checked": 0,
                "detail": "implementations registered for an op nobody defines",
            }
        )
    for name, op_cls in OP_REGISTRY.ops.items():
        impls = OP_REGISTRY.implementations(name, current_platform.device_type)
        if not impls:
            continue
        examples = op_cls.make_examples(torch.Generator().manual_seed(0))
        if not examples:
            results.append({"op": name, "provider": "*", "status": "no-examples"})
            continue
        for impl in impls:
            checked = 0
            problem = None
            for op, args, kwargs in examples:
                op = op.to(device)
                args, kwargs = _to(args, device), _to(kwargs, device)
                if impl.supports is not None and not impl.supports(op, *args, **kwargs):
                    continue
                with torch.no_grad():
                    expected = op.forward_native(*_clone(args), **_clone(kwargs))
                    got = impl.fn(op, *_clone(args), **_clone(kwargs))
                problem = _close(got, expected)
                checked += 1
                if problem:
                    break
            status = "mismatch" if problem else ("ok" if checked else "no-supported-example")
            results.append(
                {
                    "op": name,
                    "provider": impl.provider,
                    "status": status,
                    "checked": checked,
                    "detail": problem or "",
                }
            )
    return {"device_type": current_platform.device_type, "results": results}


def _clone(value: Any) -> Any:
    # Ops may work in place (fused residual add): give each run its own inputs.
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


GREEDY_PREFIX = (
    "Kiln's conformance kit asks every platform the same questions, one at a time. Answer each "
    "question in one short sentence, without repeating the question or adding notes."
)
GREEDY_PROMPTS = [
    GREEDY_PREFIX + " What is the capital of France?",
    GREEDY_PREFIX + " Name three colors.",
    GREEDY_PREFIX + " Write a Python function that adds two numbers.",
    "The capital of France is",
]
"""The first three share a prefix longer than two KV-cache blocks; the first runs alone, then the
others together, so they hit the prefix cache on that prefix."""
GREEDY_TOKENS = 12
GREEDY_BUDGET = 16
"""``max_num_batched_tokens`` of the greedy check: every prompt but the last is prefilled in
chunks, and chunks share steps with other requests' decodes."""


def check_greedy(platform: str, forced_json: str | None = None) -> dict[str, Any]:
    """Greedy tokens of the default model (float32) on ``platform`` under a small token budget
    with prefix-cache hits, then teacher-forced log-probabilities of each prompt followed by the
    completions in ``forced_json`` (a JSON list of token lists; default: its own tokens)."""
    from kiln import LLM, SamplingParams

    llm = LLM(
        platform=platform,
        dtype="float32",
        kv_cache_memory=0.25,
        max_model_len=256,
        max_num_batched_tokens=GREEDY_BUDGET,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate(GREEDY_PROMPTS[:1], params, use_tqdm=False)
    outputs += llm.generate(GREEDY_PROMPTS[1:], params, use_tqdm=False)
    prompts = [list(o.prompt_token_ids) for o in outputs]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    forced = json.loads(forced_json) if forced_json else tokens
    return {
        "platform": platform,
        "prompt_lens": [len(p) for p in prompts],
        "cached_tokens": [o.num_cached_tokens for o in outputs],
        "tokens": tokens,
        "texts": [o.outputs[0].text for o in outputs],
        "teacher_forced": _teacher_forced(llm, prompts, forced),
    }


def _teacher_forced(llm: Any, prompts: list[list[int]], completions: list[list[int]]) -> list:
    """Per prompt, per completion token: ``[top-1 token id, logprob of the forced token]``
    given the prompt and the forced tokens before it (prompt logprobs of ``prompt + completion``).
    """
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    requests = [{"prompt_token_ids": p + c} for p, c in zip(prompts, completions, strict=True)]
    outputs = llm.generate(requests, params, use_tqdm=False)
    result = []
    for prompt, completion, output in zip(prompts, completions, outputs, strict=True):
        rows = []
        for index, token in enumerate(completion):
            position = output.prompt_logprobs[len(prompt) + index]
            top1 = next(t for t, lp in position.items() if lp.rank == 1)
            rows.append([top1, position[token].logprob])
        result.append(rows)
    return result


CONNECTOR_PROMPTS = [
    GREEDY_PREFIX + " " + " ".join(f"Question {i}: what comes after {i}?" for i in range(9)),
    "A second, unrelated conversation about pottery: "
    + " ".join(f"glaze number {i} is fired at {900 + 10 * i} degrees," for i in range(8)),
]
"""Two prompts of about 100 tokens that share no block; ``CONNECTOR_KV_GIB`` holds one of
them, so each evicts the other from the paged cache."""
CONNECTOR_KV_GIB = 0.008
"""About 11 blocks of the default model in float32."""
DEFAULT_CONNECTOR = {
    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"cpu_bytes": 1 << 28},
}


def check_kv_connector(platform: str, kv_transfer_json: str | None = None) -> dict[str, Any]:
    """A KV connector gives what recomputing gives: the default model (float32, greedy, with
    logprobs) runs ``CONNECTOR_PROMPTS`` as A, B, A (the second A's prefix left the paged cache)
    with the connector in ``kv_transfer_json`` (default: the offloading connector) and without
    one; returns both runs' tokens, logprobs and cached-token counts, and the connector's
    counters."""
    from kiln import LLM, SamplingParams

    connector = json.loads(kv_transfer_json) if kv_transfer_json else DEFAULT_CONNECTOR
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [CONNECTOR_PROMPTS[0], CONNECTOR_PROMPTS[1], CONNECTOR_PROMPTS[0]]
    runs = {}
    for name, kv_transfer in (("connector", connector), ("none", None)):
        llm = LLM(
            platform=platform,
            dtype="float32",
            kv_cache_memory=CONNECTOR_KV_GIB,
            max_model_len=160,
            kv_transfer_config=kv_transfer,
        )
        completions = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        outputs = [c.outputs[0] for c in completions]
        runs[name] = {
            "tokens": [list(o.token_ids) for o in outputs],
            "logprobs": [
                [pos[t].logprob for pos, t in zip(o.logprobs or (), o.token_ids, strict=True)]
                for o in outputs
            ],
            "cached_tokens": [c.num_cached_tokens for c in completions],
            "connector_stats": dict(llm.llm_engine.stats.totals.kv_connector),
        }
        del llm
    return {"platform": platform, **runs}


CHECKS = {
    "idempotence": check_idempotence,
    "ops": check_ops,
    "greedy": check_greedy,
    "scheduler": check_scheduler,
    "communicator": check_communicator,
    "kv_connector": check_kv_connector,
}

if __name__ == "__main__":
    name, platform, *rest = sys.argv[1:]
    print(json.dumps(CHECKS[name](platform, *rest), default=str))
