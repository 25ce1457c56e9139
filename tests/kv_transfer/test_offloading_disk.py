"""The offloading connector's disk tier: block files whole or a miss, a prefix loaded from disk
gives what recomputing gives, and a corrupt file is a failed load that is recomputed, never
used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.kv_transfer import disk
from kiln.testing import compare_connector_run
from kiln.testing.checks import CONNECTOR_KV_GIB, CONNECTOR_PROMPTS, check_kv_connector

ONE_BLOCK_POOL = 1_000_000
"""Bytes: one block of the default model in float32 (about 0.8 MB), not two, so that a prompt's
earlier blocks can only come back from the disk tier."""


def disk_connector(path: Path, disk_bytes: int = 1 << 26) -> dict:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {
            "cpu_bytes": ONE_BLOCK_POOL,
            "disk_path": str(path),
            "disk_bytes": disk_bytes,
        },
    }


def test_a_block_file_reads_back_whole_and_anything_else_is_a_miss(tmp_path) -> None:
    parts = [torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8).bfloat16()]
    num_bytes = sum(p.numel() * p.element_size() for p in parts)
    path = disk.block_path(tmp_path, -12345, 0)  # prefix hashes may be negative
    written = disk.write_block(path, -12345, 0, parts)
    assert written == disk.HEADER.size + num_bytes == path.stat().st_size
    payload = disk.read_block(path, -12345, 0, num_bytes)
    assert payload is not None
    first = torch.frombuffer(payload, dtype=torch.uint8, count=parts[0].numel() * 4)
    assert torch.equal(first.view(torch.float32).reshape(parts[0].shape), parts[0])

    assert disk.read_block(path, 999, 0, num_bytes) is None  # another block's file
    assert disk.read_block(path, -12345, 1, num_bytes) is None  # another rank's
    assert disk.read_block(tmp_path / "missing", -12345, 0, num_bytes) is None
    data = path.read_bytes()
    path.write_bytes(data[:-1])  # torn
    assert disk.read_block(path, -12345, 0, num_bytes) is None
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    path.write_bytes(bytes(flipped))  # corrupt payload
    assert disk.read_block(path, -12345, 0, num_bytes) is None


def test_start_up_clears_the_directorys_block_files_only(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("kept")
    stale = disk.block_path(tmp_path, 7, 0)
    stale.write_bytes(b"old")
    stale.with_name(stale.name + ".tmp99").write_bytes(b"torn")
    disk.clear(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_prefix_evicted_past_the_memory_tier_loads_from_disk(tmp_path) -> None:
    result = check_kv_connector("cpu", json.dumps(disk_connector(tmp_path)))
    stats = result["connector"]["connector_stats"]
    assert stats.get("spilled_blocks", 0) > 0, stats
    # A one-block memory tier supplies at most one block: the rest came from disk.
    assert result["connector"]["cached_tokens"][2] > result["none"]["cached_tokens"][2] + 16
    problem = compare_connector_run(result["connector"], result["none"])
    assert problem is None, problem
    assert list(tmp_path.glob(f"*{disk.SUFFIX}")), "the tier's files are on disk"


def test_corrupt_files_are_failed_loads_that_are_recomputed(tmp_path) -> None:
    from kiln import LLM, SamplingParams

    llm = LLM(
        platform="cpu",
        dtype="float32",
        kv_cache_memory=CONNECTOR_KV_GIB,
        max_model_len=160,
        kv_transfer_config=disk_connector(tmp_path),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    first, _ = (llm.generate([p], params, use_tqdm=False)[0] for p in CONNECTOR_PROMPTS)
    files = list(tmp_path.glob(f"*{disk.SUFFIX}"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    again = llm.generate([CONNECTOR_PROMPTS[0]], params, use_tqdm=False)[0]
    stats = llm.llm_engine.stats.totals.kv_connector
    assert stats.get("failed_loads", 0) >= 1, stats
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    tokens, wanted = first.outputs[0].token_ids, first.outputs[0].logprobs
    for token, got, want in zip(tokens, again.outputs[0].logprobs, wanted, strict=True):
        assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"cpu_bytes": ONE_BLOCK_POOL, "disk_bytes": 1 << 26}, "disk_path"),
        ({"cpu_bytes": ONE_BLOCK_POOL, "disk_path": "DIR", "disk_bytes": 10}, "disk_bytes"),
        ({"cpu_bytes": ONE_BLOCK_POOL, "disk_path": "DIR"}, "disk_bytes"),
    ],
)
def test_a_disk_tier_without_its_path_or_size_is_refused(tmp_path, extra, field) -> None:
    from kiln import LLM

    if "disk_path" in extra:
        extra = {**extra, "disk_path": str(tmp_path)}
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.{field}"):
        LLM(platform="cpu", dtype="float32", max_model_len=160, kv_transfer_config=config)
