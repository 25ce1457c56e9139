"""The documentation cannot rot: the site builds, its links resolve, and its commands exist.

The pages are the two READMEs (Kiln's and kiln-x86's) and every Markdown file under ``docs/``,
which ``mkdocs.yml`` builds as a site. Checked here:

- ``mkdocs build --strict`` succeeds (a page missing from the nav, a link to a file that is not a
  page, or an ``#anchor`` that names no heading is a warning, and strict makes it an error);
- every relative link of every page, the READMEs' too (they are outside the site), names a file
  that exists and, with ``#anchor``, a heading of that file as GitHub spells its anchors;
- ``docs/index.md`` is the README with its links made relative to ``docs/``;
- every ``kiln ...`` command in a shell block or an inline code span names a real subcommand and
  only flags its parser has (``kiln.entrypoints.cli.build_parser``), ``./scripts/serve.sh`` is
  ``kiln serve``, and every ``python SCRIPT.py --flag`` names a script that exists and a flag
  its source defines;
- every inline code span that starts with a flag (`` `--max-num-seqs 4` ``, the way the pages
  list options in prose) names a flag of some ``kiln`` subcommand or of a script of the
  repository, or one of the few other tools' flags the pages mention (``OTHER_TOOLS_FLAGS``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "plugins/kiln-x86/README.md", *(ROOT / "docs").rglob("*.md")]
)
FENCE = re.compile(r"^ *```(\S*)[^\n]*\n(.*?)^ *```$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *#*$", re.MULTILINE)
SHELL_LANGS = {"bash", "sh", "shell", "console"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def strip_code(text: str) -> str:
    """The text with fenced blocks blanked (line numbers kept): links and headings are outside."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


# ---------------------------------------------------------------------------------------------
# Anchors


def heading_text(markdown: str) -> str:
    """A heading's text as rendered: links to their text, code and emphasis marks dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    return text.replace("`", "").replace("**", "").replace("\\", "")


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = heading_text(text).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify (what the site uses)."""
    text = unicodedata.normalize("NFKD", heading_text(text)).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> dict[str, str]:
    """GitHub anchor -> the site's anchor, for every heading of ``path`` (repeats get -1, -2...)."""
    found: dict[str, str] = {}
    for match in HEADING.finditer(strip_code(path.read_text())):
        github, site = github_slug(match.group(2)), mkdocs_slug(match.group(2))
        base, n = github, 0
        while github in found:
            n += 1
            github, site = f"{base}-{n}", f"{mkdocs_slug(match.group(2))}_{n}"
        found[github] = site
    return found


@dataclass
class Link:
    page: Path
    line: int
    target: str


def page_links(page: Path) -> list[Link]:
    text = strip_code(page.read_text())
    text = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [Link(page, text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def broken_links(pages: list[Path]) -> list[str]:
    """Every relative link of ``pages`` that names no file, or a heading its file lacks."""
    broken = []
    for page in pages:
        for link in page_links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link.target):  # https:, mailto:: not checked
                continue
            path_part, _, anchor = link.target.partition("#")
            target = (page.parent / path_part).resolve() if path_part else page
            where = f"{rel(page)}:{link.line}: ({link.target})"
            if not target.exists():
                broken.append(f"{where} {path_part} does not exist")
                continue
            if not anchor:
                continue
            if target.suffix != ".md":
                broken.append(f"{where} an anchor into a file that is not a page")
                continue
            known = anchors(target)
            if anchor not in known:
                broken.append(f"{where} {rel(target)} has no heading #{anchor}")
            elif known[anchor] != anchor:
                broken.append(
                    f"{where} the site spells this heading's anchor #{known[anchor]}: "
                    "reword the heading so that GitHub and the site agree"
                )
    return broken


def test_pages_are_found() -> None:
    names = {rel(p) for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/results.md", "docs/x86/results.md"} <= names


def test_every_fence_is_closed() -> None:
    # An unclosed fence swallows the rest of the page (and hides its links from these checks).
    odd = [rel(p) for p in PAGES if len(re.findall(r"^ *```", p.read_text(), re.MULTILINE)) % 2]
    assert not odd, f"a code fence is not closed in {odd}"


def test_every_relative_link_resolves() -> None:
    broken = broken_links(PAGES)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# A page\n\n## Its `second` part\n\n[ok](#its-second-part) [ok](b.md#b-page)\n"
        "[missing](c.md) [bad anchor](b.md#nowhere) `[in code](c.md)`\n"
        "```bash\n[in a block](c.md)\n```\n"
    )
    (tmp_path / "b.md").write_text("# B: page\n")
    found = broken_links([tmp_path / "a.md"])
    assert len(found) == 2, found
    assert "c.md does not exist" in found[0] and "no heading #nowhere" in found[1]


def test_slugs_match_github_and_the_site() -> None:
    assert github_slug("5. Layout of the `repository`") == "5-layout-of-the-repository"
    assert github_slug("Serve targets (issue 8)") == "serve-targets-issue-8"
    assert mkdocs_slug("Serve targets (issue 8)") == "serve-targets-issue-8"
    # Where they differ the link check says so: GitHub keeps each hyphen, the site merges them.
    assert github_slug("a - b") == "a---b" and mkdocs_slug("a - b") == "a-b"


def test_index_is_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    assert index == readme.replace("](docs/", "]("), (
        "docs/index.md (the site's home page) differs from README.md: rewrite it with "
        "`sed 's#](docs/#](#g' README.md > docs/index.md`"
    )


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the test extra installs mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "x86" / "results" / "index.html").exists()
    # The guide's ```python file=... blocks are code, not headings (scripts/mkdocs_hooks.py).
    assert 'id="3-contracts"' in (tmp_path / "plugins" / "index.html").read_text()


# ---------------------------------------------------------------------------------------------
# Commands


@dataclass
class Command:
    page: Path
    line: int
    text: str


def shell_commands(page: Path) -> list[Command]:
    """Each command line of ``page``'s shell blocks (continuations joined, comments cut), and
    each inline code span that starts with ``kiln ``."""
    text = page.read_text()
    commands = []
    for match in FENCE.finditer(text):
        if match.group(1) not in SHELL_LANGS:
            continue
        first = text.count("\n", 0, match.start()) + 2
        pending, start = "", first
        for i, line in enumerate(match.group(2).split("\n")):
            if not pending:
                start = first + i
            if line.rstrip().endswith("\\"):  # continued on the next line
                pending += line.rstrip()[:-1] + " "
                continue
            if (pending + line).strip():
                commands.append(Command(page, start, (pending + line).strip()))
            pending = ""
    outside = strip_code(text)
    for match in INLINE_CODE.finditer(outside):
        code = " ".join(match.group(2).split())
        if code.startswith("kiln "):
            commands.append(Command(page, outside.count("\n", 0, match.start()) + 1, code))
    return commands


def simple_commands(command: str) -> list[list[str]]:
    """``command``'s simple commands (split at ``&&``, ``||``, ``;``, ``|``), each as its words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote in prose: the plain words
        tokens = command.split()
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token and set(token) <= set(";&|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_kiln(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """What in ``argv`` (after ``kiln``) no parser knows: a subcommand or a flag."""
    problems, chain = [], ["kiln"]
    for word in argv:
        word = word.strip("[]")
        if re.fullmatch(r"-\d.*", word):  # a negative number: a flag's value
            continue
        if word.startswith("-") and word != "-":
            flag = word.split("=", 1)[0]
            if flag not in parser._option_string_actions:
                problems.append(f"`{' '.join(chain)}` has no flag {flag}")
            continue
        choices = subparsers(parser)
        if not choices:
            continue  # a positional argument or a flag's value
        if word not in choices:
            problems.append(f"`{' '.join(chain)}` has no subcommand {word!r}")
            return problems
        parser = choices[word]
        chain.append(word)
    return problems


def check_script(script: str, argv: list[str]) -> list[str]:
    path = ROOT / script
    if not path.exists():
        return [f"{script} does not exist"]
    source = path.read_text()
    return [
        f"{script} defines no flag {flag}"
        for flag in (w.split("=", 1)[0] for w in argv if w.startswith("--"))
        if f'"{flag}"' not in source and f"'{flag}'" not in source
    ]


def check_command(command: str, parser: argparse.ArgumentParser) -> list[str]:
    return [p for argv in simple_commands(command) for p in check_argv(argv, parser)]


def check_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    if not argv:
        return []
    program, rest = argv[0], argv[1:]
    if program == "kiln" or program.endswith("/bin/kiln"):
        return check_kiln(rest, parser)
    if program in ("./scripts/serve.sh", "scripts/serve.sh"):
        return check_kiln(["serve", *rest], parser)
    if program.endswith("python") or program.endswith("python3"):
        if rest[:1] == ["-m"] or not rest:
            return []
        return check_script(rest[0], rest[1:])
    return []


def stale_commands(pages: list[Path], parser: argparse.ArgumentParser) -> list[str]:
    return [
        f"{rel(c.page)}:{c.line}: {problem} ({c.text})"
        for page in pages
        for c in shell_commands(page)
        for problem in check_command(c.text, parser)
    ]


def test_commands_name_real_subcommands_and_flags() -> None:
    checked = [c for page in PAGES for c in shell_commands(page) if " kiln " in f" {c.text}"]
    assert len(checked) > 50, "the pages' kiln commands were not found"
    stale = stale_commands(PAGES, build_parser())
    assert not stale, "stale commands:\n" + "\n".join(stale)


def test_a_stale_command_is_found(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "Run `kiln serve --max-num-seqs 4` or `kiln plugins --jsn`.\n\n```bash\n"
        "kiln serve MODEL --port 8001 \\\n  --no-such-flag  # a comment --not-a-flag\n"
        "kiln srve\n./scripts/serve.sh --tensor-parallel-size 2 --dp 2\n"
        "python benchmarks/throughput.py --dtype bfloat16 --no-such-option\n"
        "python benchmarks/nowhere.py\nkiln bench serve --base-url http://x --json\n```\n"
    )
    stale = stale_commands([page], build_parser())
    assert [s.split(": ", 1)[1].split(" (")[0] for s in stale] == [
        "`kiln serve` has no flag --no-such-flag",
        "`kiln` has no subcommand 'srve'",
        "`kiln serve` has no flag --dp",
        "benchmarks/throughput.py defines no flag --no-such-option",
        "benchmarks/nowhere.py does not exist",
        "`kiln plugins` has no flag --jsn",
    ], stale


OTHER_TOOLS_FLAGS = {
    "--processor": "guidellm's, in docs/benchmarks.md",
}
"""Flags of tools other than Kiln that pages name in a span of their own."""
SCRIPTS = [
    *(ROOT / "benchmarks").glob("*.py"),
    *(ROOT / "plugins" / "kiln-x86" / "benchmarks").glob("*.py"),
    *(ROOT / "scripts").iterdir(),
]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def kiln_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set(parser._option_string_actions)
    for sub in subparsers(parser).values():
        flags |= kiln_flags(sub)
    return flags


def stale_inline_flags(pages: list[Path], parser: argparse.ArgumentParser) -> list[str]:
    known = kiln_flags(parser) | set(OTHER_TOOLS_FLAGS)
    sources = "".join(s.read_text() for s in SCRIPTS if s.is_file())
    stale = []
    for page in pages:
        text = strip_code(page.read_text())
        for match in INLINE_CODE.finditer(text):
            code = match.group(2).strip()
            if not code.startswith("-"):
                continue  # a command (checked above), a config field, Python...
            for flag in FLAG.findall(code):
                if flag not in known and f'"{flag}"' not in sources and f"'{flag}'" not in sources:
                    line = text.count("\n", 0, match.start()) + 1
                    stale.append(f"{rel(page)}:{line}: no kiln subcommand or script has {flag}")
    return stale


def test_flags_in_prose_exist() -> None:
    stale = stale_inline_flags(PAGES, build_parser())
    assert not stale, "stale flags:\n" + "\n".join(stale)


def test_a_stale_flag_in_prose_is_found(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "`--max-num-seqs 4`, `--max-num-seq`, `--num-prompts` (a script's), `--processor DIR`,\n"
        "`-dp 2 --kv-cache-memry 2`, `mkdocs build --strict` (a command: not a span of flags)\n"
    )
    stale = stale_inline_flags([page], build_parser())
    assert [s.split(": ", 1)[1] for s in stale] == [
        "no kiln subcommand or script has --max-num-seq",
        "no kiln subcommand or script has --kv-cache-memry",
    ]
