"""MkDocs hooks (``hooks:`` in mkdocs.yml): make the pages, written for GitHub, render the same.

The pages stay plain GitHub Markdown; two habits of it that Python-Markdown reads otherwise are
rewritten on the fly, never in the files:

- a fence's info string with tags after the language (``python file=src/x.py``, which
  tests/test_plugin_guide.py reads) is cut to the language: Python-Markdown's fenced-code
  extension does not recognise such a fence and renders its ``#`` comments as headings;
- a list that starts right after a paragraph line gets the blank line Python-Markdown needs to
  see a list there.
"""

from __future__ import annotations

import re

FENCE = re.compile(r"^(\s*)(```+|~~~+)(\S*)\s.*$")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")


def rewrite(markdown: str) -> str:
    """The page's Markdown as Python-Markdown should read it (see the module docstring)."""
    out: list[str] = []
    in_fence = False
    for line in markdown.split("\n"):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            if not in_fence:
                line = FENCE.sub(r"\1\2\3", line)
            in_fence = not in_fence
        elif not in_fence and LIST_ITEM.match(line) and out:
            previous = out[-1]
            if previous.strip() and not LIST_ITEM.match(previous) and not previous.startswith(" "):
                out.append("")
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    return rewrite(markdown)
