"""``AsyncLLM`` with the engine core in its own process: streaming, aborts, and a dead engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import pytest

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.messages import EngineDeadError
from kiln.plugins import init_process
from kiln.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow


async def _start() -> AsyncLLM:
    config = init_process("api", EngineArgs(kv_cache_memory=0.25).create_config())
    return await AsyncLLM.create(config, log_stats=False)


def test_streamed_deltas_add_up_and_aborts_free_capacity():
    async def main() -> None:
        llm = await _start()
        try:
            delta = SamplingParams(
                temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA
            )
            final = SamplingParams(temperature=0, max_tokens=12)

            async def collect(params: SamplingParams, request_id: str) -> tuple[str, int]:
                text, chunks = "", 0
                async for output in llm.generate("Count: 1, 2,", params, request_id):
                    text = (
                        text + output.outputs[0].text if params is delta else output.outputs[0].text
                    )
                    chunks += 1
                return text, chunks

            (streamed, num_chunks), (whole, _) = await asyncio.gather(
                collect(delta, "a"), collect(final, "b")
            )
            assert streamed == whole and num_chunks > 1

            # Leaving the iterator early (closing it) aborts the request in the engine core.
            long = SamplingParams(max_tokens=2000, ignore_eos=True)
            async with contextlib.aclosing(llm.generate("Tell a long story.", long, "x")) as gen:
                async for _ in gen:
                    break
            assert llm.num_unfinished_requests() == 0
            for _ in range(100):
                await asyncio.sleep(0.05)
                if llm.stats.totals.num_running == 0:
                    break
            assert llm.stats.totals.num_running == 0
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_a_killed_engine_core_fails_every_waiting_caller():
    async def main() -> None:
        llm = await _start()
        try:
            params = SamplingParams(max_tokens=2000, ignore_eos=True)
            tasks = await _start_running(llm, params, 3)
            assert llm.stats.totals.kv_cache_usage > 0
            os.kill(llm.client.pid, signal.SIGKILL)
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=30
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert llm.is_dead
            await asyncio.wait_for(llm.wait_until_dead(), timeout=5)
            # The gauges describe a dead engine: nothing runs, no KV cache is held.
            totals = llm.stats.totals
            assert (totals.num_running, totals.num_waiting, totals.kv_cache_usage) == (0, 0, 0)
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("again", params, "late"):
                    pass
        finally:
            llm.shutdown()

    asyncio.run(main())


async def _start_running(llm: AsyncLLM, params: SamplingParams, num: int) -> list[asyncio.Task]:
    """``num`` requests that iterate to their end, once the engine reports them running."""

    async def drain(request_id: str) -> None:
        async for _ in llm.generate("Tell me a story.", params, request_id):
            pass

    tasks = [asyncio.ensure_future(drain(f"r{i}")) for i in range(num)]
    for _ in range(300):
        await asyncio.sleep(0.1)
        if llm.stats.totals.num_running == num:
            break
    return tasks


def test_a_dead_output_reader_fails_every_waiting_caller(caplog: pytest.LogCaptureFixture):
    """The client's output reader dies (here: its socket is closed under it): that is logged
    with the reason and handled as a dead engine, instead of every request hanging."""

    async def main() -> None:
        llm = await _start()
        try:
            tasks = await _start_running(llm, SamplingParams(max_tokens=2000, ignore_eos=True), 2)
            llm.client._output.close()
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=30
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert all("output reader" in str(r) for r in results), results
            assert llm.is_dead
            await asyncio.wait_for(llm.wait_until_dead(), timeout=5)
        finally:
            llm.shutdown()

    with caplog.at_level(logging.ERROR, logger="kiln.engine.core_client"):
        asyncio.run(main())
    assert any("output reader" in record.getMessage() for record in caplog.records)
