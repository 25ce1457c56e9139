"""Gemma on kiln-x86 with its traced decode graphs, against ``transformers`` in float32.

Gemma 3 (no soft cap): its sliding-window layers (window 8, shorter than every sequence) and
global layers run on the x86 attention kernel. Gemma 2: its soft-capped attention layers run on
the reference CPU attention (the kernel has no soft cap; ``kiln_x86.attention``), the rest of
the model on kiln-x86's ops. Both give transformers' greedy tokens for 32 steps and the chosen
tokens' logprobs within 1e-4. One fresh process (a process selects its platform once) runs both.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.testing import run_python
from kiln.testing.models import TINY_GEMMA, save_tiny_model
from kiln.testing.reference import hf_greedy

NUM_TOKENS = 32
LOGPROB_ATOL = 1e-4
PROMPTS = [[1, 5, 9, 200, 17], [(11 * i) % 251 for i in range(1, 41)]]
MODELS = {
    "gemma2": dict(attn_logit_softcapping=3.0, final_logit_softcapping=10.0),
    "gemma3_text": dict(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        }
    ),
}

GENERATE = """
import gc, json, sys
from kiln import LLM, SamplingParams

tokenizer, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
result = {}
for folder in json.loads(sys.argv[4]):
    llm = LLM(folder, platform="x86", tokenizer=tokenizer, dtype="float32", kv_cache_memory=0.02,
              max_model_len=256, max_num_seqs=4)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result[folder] = {
        "backend": [
            [layer.backend.get_name(), bool(getattr(layer.impl, "soft_capped", False))]
            for layer in runner.model.attention_layers().values()
        ],
        "traced": sorted(getattr(runner.runnable, "_graphs", {})),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs
        ],
    }
    llm.llm_engine.shutdown()
    del llm, runner
    gc.collect()
print(json.dumps(result))
"""


@pytest.mark.slow
def test_gemma_on_x86_with_graphs_matches_transformers(tmp_path, gguf_path):
    folders = {
        name: save_tiny_model(tmp_path / name, name, random_norms=True, **TINY_GEMMA, **config)
        for name, config in MODELS.items()
    }
    args = [gguf_path, json.dumps(PROMPTS), str(NUM_TOKENS), json.dumps(list(folders.values()))]
    proc = run_python(["-c", GENERATE, *args], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "soft-capped layers run on the reference CPU attention backend" in proc.stderr
    for name, folder in folders.items():
        got = result[folder]
        assert got["traced"], f"{name}: no decode graph was traced"
        # Gemma 2's layers all soft-cap: the reference runs them; Gemma 3's run on the kernel.
        soft_capped = name == "gemma2"
        assert got["backend"] == [["X86_PAGED", soft_capped]] * 2
        hf_model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for prompt, tokens, logprobs in zip(PROMPTS, got["tokens"], got["logprobs"], strict=True):
            assert tokens == hf_greedy(hf_model, prompt, NUM_TOKENS), name
            with torch.inference_mode():
                logits = hf_model(torch.tensor([prompt + tokens])).logits[0]
            reference = logits.float().log_softmax(-1)[len(prompt) - 1 : -1]
            expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            diff = (torch.tensor(logprobs) - expected).abs().max()
            assert diff <= LOGPROB_ATOL, f"{name}: logprobs differ by {diff}"
