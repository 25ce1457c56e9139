"""``kiln chat``: the loop's commands and history on a scripted back end, and a streamed
conversation with the real default model loaded in-process.

(``tests/bench/test_bench_serve_live.py`` pipes stdin into ``kiln chat --url`` against a real
``kiln serve``.)
"""

from __future__ import annotations

import io

import pytest

from kiln.entrypoints.chat import ChatError, LocalChat, run_chat


class ScriptedBackend:
    """Replies "reply N" in two deltas and records every conversation it was sent."""

    model_name = "scripted"

    def __init__(self, fail_on: str | None = None) -> None:
        self.sent: list[list[dict[str, str]]] = []
        self.fail_on = fail_on

    def stream(self, messages):
        self.sent.append([dict(m) for m in messages])
        if messages[-1]["content"] == self.fail_on:
            raise ChatError("the server said no")
        yield "reply "
        yield str(len(self.sent))


def lines(*items: str):
    it = iter(items)

    def read_line(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read_line


def test_history_is_kept_and_sent_whole():
    backend, out = ScriptedBackend(), io.StringIO()
    run_chat(backend, lines("hi", "", "again"), out, system_prompt="be brief")
    assert out.getvalue() == "reply 1\nreply 2\n\n"  # the last "\n" is the one printed at EOF
    assert backend.sent[1] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "again"},
    ]


def test_reset_keeps_the_system_prompt_and_exit_stops_reading():
    backend, out = ScriptedBackend(), io.StringIO()
    run_chat(backend, lines("one", "/reset", "two", "/exit", "never"), out, system_prompt="sys")
    assert "(conversation reset)" in out.getvalue()
    assert backend.sent[1] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "two"},
    ]
    assert len(backend.sent) == 2


def test_unknown_command_prints_help_and_sends_nothing():
    backend, out = ScriptedBackend(), io.StringIO()
    run_chat(backend, lines("/what"), out)
    assert "/reset" in out.getvalue() and "/exit" in out.getvalue()
    assert backend.sent == []


def test_a_failed_turn_is_reported_and_forgotten(capsys):
    backend, out = ScriptedBackend(fail_on="bad"), io.StringIO()
    run_chat(backend, lines("bad", "good"), out)
    assert "error: the server said no" in capsys.readouterr().err
    assert backend.sent[1] == [{"role": "user", "content": "good"}]


@pytest.mark.slow
def test_local_model_streams_and_remembers(capsys):
    chat = LocalChat(None, max_tokens=12, temperature=0.0, kv_cache_memory=0.25, max_num_seqs=4)
    try:
        deltas = list(chat.stream([{"role": "user", "content": "What is the capital of France?"}]))
        assert len(deltas) > 1, "the reply should arrive in several pieces"
        assert "Paris" in "".join(deltas)
        out = io.StringIO()
        run_chat(chat, lines("What is the capital of France?", "And of Italy?", "/exit"), out)
        first, second = out.getvalue().splitlines()[:2]
        assert "Paris" in first and second and second != first
        assert not chat.llm.llm_engine.has_unfinished_requests()
        # Abandoning a stream half-way aborts the request in the engine.
        stream = chat.stream([{"role": "user", "content": "Tell me a long story."}])
        next(stream)
        stream.close()
        assert not chat.llm.llm_engine.has_unfinished_requests()
    finally:
        chat.close()
