"""kiln.bench.results_md: a benchmark's tables go into the results page as a dated section."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from kiln.bench.results_md import (
    describe_machine,
    format_section,
    git_commit,
    insert_section,
    marker,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = "| engine | output tok/s |\n|---|---|\n| kiln | 97.9 |"


def section(day: int) -> str:
    return format_section(
        "serve_compare.py",
        "benchmarks/serve_compare.py --engines `kiln`",
        "Some CPU | 2 cores, load 0.10",
        [TABLE, "Kiln / vllm: 1.2x"],
        "abc1234",
        datetime.date(2026, 12, day),
    )


def test_a_section_has_the_command_machine_commit_date_and_the_tables_as_printed() -> None:
    text = section(2)
    assert text.startswith("### serve_compare.py, 2026-12-02\n\n| | |\n|---|---|\n")
    assert "| command | `benchmarks/serve_compare.py --engines kiln` |" in text
    assert "| machine | Some CPU / 2 cores, load 0.10 |" in text  # a "|" would split the cell
    assert "| commit | abc1234 |" in text and "| date | 2026-12-02 |" in text
    assert text.endswith(TABLE + "\n\nKiln / vllm: 1.2x\n")


def test_sections_go_below_the_marker_newest_first(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    before, after = "# Results\n\nIntro.\n\n", "\n## Older figures\n\nKept.\n"
    page.write_text(before + marker("serve_compare.py") + "\n" + after)
    insert_section(page, "serve_compare.py", section(1))
    insert_section(page, "serve_compare.py", section(2))
    text = page.read_text()
    assert text.startswith(before + marker("serve_compare.py") + "\n")
    assert text.endswith(after)
    assert text.index("2026-12-02") < text.index("2026-12-01")


def test_a_page_without_the_marker_is_refused_naming_the_line(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    page.write_text("# Results\n")
    with pytest.raises(ValueError, match="<!-- results: serve_compare.py inserts here -->"):
        insert_section(page, "serve_compare.py", section(1))
    assert page.read_text() == "# Results\n"


def test_the_results_page_has_the_marker_serve_compare_writes_below() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    assert marker("serve_compare.py") + "\n" in text
    assert "--results-md" in (ROOT / "benchmarks" / "serve_compare.py").read_text()


def test_machine_and_commit_are_described() -> None:
    assert " cores, load " in describe_machine()
    assert git_commit(ROOT) != "" and git_commit(Path("/")) == "unknown"
