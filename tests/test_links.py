"""Every relative link in README.md and docs/*.md resolves: to a file that exists (relative to
the page that links it) and, with a `#fragment`, to a heading of that file whose GitHub-style
anchor is the fragment. README.md stays a page a newcomer reads in five minutes (at most 260
lines) and links every page of docs/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 260

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) or [text](target "title"), images too; the text may hold code spans and wrap lines
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\(\s*(?P<target><[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks (fenced lines blanked, so line numbers stay)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links as their text), lowercased, punctuation
    other than '-' and '_' removed, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings, a repeated one numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every markdown link outside code."""
    text = prose(path.read_text())
    # a code span's text is not markdown; blank it (newlines kept) so `[a](b)` in code is no link
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)) if "](" in m.group(0) else m.group(0), text)
    for m in LINK.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group("target").strip("<>")


def broken(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the page's relative links, one line each (empty: nothing)."""
    problems = []
    for line, target in links(path):
        if EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(root).as_posix()}:{line}"
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not target:
            problems.append(f"{where}: an empty link")
        elif not dest.exists():
            problems.append(f"{where}: {target}: no file {file_part}")
        elif fragment and (dest.is_dir() or dest.suffix != ".md"):
            problems.append(f"{where}: {target}: a #fragment into a file that is not markdown")
        elif fragment and unquote(fragment) not in anchors(dest):
            problems.append(f"{where}: {target}: no heading #{fragment} in {dest.name}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_readme_is_short_and_links_every_page_of_the_docs() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines (at most {README_MAX_LINES}): move text to docs/"
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs, "no docs/*.md"
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README) if not EXTERNAL.match(t)}
    assert [d.name for d in docs if d.resolve() not in linked] == [], "docs README.md does not link"


def test_a_broken_link_or_fragment_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Quotas and backpressure\n\n## Linear: the first activity after `created`\n\n"
        "## Linear: the first activity after `created`\n\n```\n# not a heading\n[no](link.md)\n```\n"
    )
    page = tmp_path / "README.md"
    good = [
        "[ok](docs/a.md) [ok](docs/a.md#quotas-and-backpressure) [ok](#top) [ext](https://example.com/x#y)",
        "[ok](docs/a.md#linear-the-first-activity-after-created)",
        "[ok](docs/a.md#linear-the-first-activity-after-created-1) (the same heading again, numbered)",
        '`[code](nowhere.md)` [ok](<docs/a.md> "title")',
        "",
        "# Top",
        "",
    ]
    bad = [
        "[gone](docs/missing.md) [bad fragment](docs/a.md#quotas) [bad](#nowhere)",
        "[wrapped",
        "text](docs/a.md#not-a-heading)",
    ]
    page.write_text("\n".join(good + bad) + "\n")
    assert broken(page, tmp_path) == [
        "README.md:8: docs/missing.md: no file docs/missing.md",
        "README.md:8: docs/a.md#quotas: no heading #quotas in a.md",
        "README.md:8: #nowhere: no heading #nowhere in README.md",
        "README.md:9: docs/a.md#not-a-heading: no heading #not-a-heading in a.md",
    ]
    assert broken(tmp_path / "docs" / "a.md", tmp_path) == []
