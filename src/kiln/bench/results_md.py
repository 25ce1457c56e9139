"""Write a benchmark run's tables into a results page (``docs/results.md``) as a dated section.

Contract:

- A page marks where a script's sections go with a line ``<!-- results: NAME inserts here -->``
  (``marker(NAME)``). ``insert_section(path, name, section)`` puts the section right below that
  line, so the newest run comes first, and leaves the rest of the page as it was.
- ``format_section(...)`` is the section: a heading with the date, then a table of what a reader
  needs to weigh the figures (command, machine, commit, date), then the script's own Markdown
  tables, unchanged.
- ``describe_machine()`` says what this machine is from ``/proc/cpuinfo`` and the load average.

Side effects: ``insert_section`` rewrites the page; nothing else here writes anything. It knows
nothing about any benchmark: the tables are the script's.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path


def marker(name: str) -> str:
    """The line below which ``name``'s sections are inserted."""
    return f"<!-- results: {name} inserts here -->"


def describe_machine() -> str:
    """CPU model, usable cores and the 1-minute load average, e.g. ``Intel Xeon ..., 2 cores,
    load 0.4``."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, load {os.getloadavg()[0]:.2f}"


def git_commit(repo: str | Path) -> str:
    """The checkout's short commit, with ``+changes`` when its tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD"]).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if dirty else head


def format_section(
    title: str,
    command: str,
    machine: str,
    tables: list[str],
    commit: str,
    date: datetime.date | None = None,
) -> str:
    """A results section: ``### title, date``, the run's facts, then ``tables`` as given.

    Args:
        title: what was run, e.g. ``serve_compare.py``.
        command: the command line, shown as code (backquotes in it are dropped).
        machine: ``describe_machine()``, with anything the script measured about the machine.
        tables: Markdown the script printed (tables, ratio lines), each kept as it is.
        commit: ``git_commit(repo)``.
        date: the run's date (default: today).
    """
    day = (date or datetime.date.today()).isoformat()
    facts = [
        "| | |",
        "|---|---|",
        f"| command | `{command.replace('`', '')}` |",
        f"| machine | {machine.replace('|', '/')} |",
        f"| commit | {commit} |",
        f"| date | {day} |",
    ]
    return "\n\n".join([f"### {title}, {day}", "\n".join(facts), *tables]).rstrip() + "\n"


def insert_section(path: str | Path, name: str, section: str) -> None:
    """Put ``section`` right below ``marker(name)`` in the page at ``path``.

    Raises:
        ValueError: the page has no such marker line (naming the line it must have).
    """
    page = Path(path)
    text = page.read_text()
    line = marker(name)
    index = text.find(line + "\n")
    if index < 0:
        raise ValueError(f"{page} has no line {line!r} to insert {name}'s results below")
    end = index + len(line) + 1
    page.write_text(text[:end] + "\n" + section + text[end:])
