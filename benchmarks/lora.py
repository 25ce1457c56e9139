"""Multi-LoRA throughput: ``LLM.generate`` of the same prompts with 4 adapters in a mixed batch
(requests round-robin over the adapters, ``--max-loras 4``) against the base model without LoRA,
in one run, same dtype and prompts.

The adapters are random PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``) of
rank ``--rank`` on all seven projections, written to a temporary folder. Three engines: the base
model (LoRA off, the baseline), the LoRA engine serving base-model requests only (the cost of
enabling LoRA), and the LoRA engine with the 4 adapters mixed. Each workload runs ``--repeats``
times, alternating engines so load from other processes hits them alike; the best run counts,
and each round's ratios to that round's baseline are printed too (their median is the figure to
trust on a loaded machine).

    .venv/bin/python benchmarks/lora.py [--num-prompts 32] [--input-len 128] [--output-len 64]
        [--rank 8] [--repeats 2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file
from throughput import make_prompts

from kiln import LLM, LoRARequest, SamplingParams
from kiln.lora.peft import LORA_MODULES, projection_shapes

NUM_ADAPTERS = 4


def write_adapter(folder: str, hf_config: dict, rank: int, seed: int) -> str:
    """A random PEFT LoRA of the model, rank ``rank`` on every projection of every layer."""
    os.makedirs(folder, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(hf_config["num_hidden_layers"])):
        for projection, (in_features, out_features) in projection_shapes(hf_config).items():
            parent = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{parent}.{projection}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    config["target_modules"] = list(LORA_MODULES)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def run(llm: LLM, prompts: list[list[int]], output_len: int, loras=None) -> float:
    """Output tokens per second of one ``generate`` over ``prompts``."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    common = dict(dtype=args.dtype, max_num_seqs=args.num_prompts, kv_cache_memory=1)
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank)
    runner = base.llm_engine.engine_core.executor.worker.model_runner
    prompts = make_prompts(args.num_prompts, args.input_len, runner.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(
                f"adapter{i}",
                i + 1,
                write_adapter(os.path.join(tmp, str(i)), runner.hf_config, args.rank, i),
            )
            for i in range(NUM_ADAPTERS)
        ]
        mixed = [adapters[i % NUM_ADAPTERS] for i in range(len(prompts))]
        warm = [[1000, 1001, 1002]] * NUM_ADAPTERS
        base.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)
        lora.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False, lora_request=adapters)
        cases = {
            "base model, LoRA off": (base, None),
            "LoRA on, base requests": (lora, None),
            f"LoRA on, {NUM_ADAPTERS} adapters mixed": (lora, mixed),
        }
        rounds: list[dict[str, float]] = []
        for _ in range(args.repeats):
            rounds.append(
                {
                    name: run(llm, prompts, args.output_len, loras)
                    for name, (llm, loras) in cases.items()
                }
            )
            print(f"round {len(rounds)}: " + ", ".join(f"{v:.1f}" for v in rounds[-1].values()))
    print(
        f"{args.num_prompts} prompts, {args.input_len} input / {args.output_len} output tokens, "
        f"rank {args.rank} on q,k,v,o,gate,up,down, dtype {args.dtype}, best of {args.repeats}"
    )
    baseline = max(r["base model, LoRA off"] for r in rounds)
    for name in cases:
        value = max(r[name] for r in rounds)
        ratios = sorted(r[name] / r["base model, LoRA off"] for r in rounds)
        median = ratios[len(ratios) // 2]
        print(
            f"{name:28s} {value:8.1f} tok/s  {value / baseline:5.2f}x best  "
            f"{median:5.2f}x median of rounds ({', '.join(f'{x:.2f}' for x in ratios)})"
        )


if __name__ == "__main__":
    main()
