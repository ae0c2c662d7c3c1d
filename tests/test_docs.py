"""The README and docs/ against the code and against each other: the generated flag table, the
commands CI reads from the README, and every relative link. Pure Python: no model, no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stopline.settings import flags_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
REGENERATE = "python -m stopline --help-markdown"


def between(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1, f"expected one {start} and one {end}"
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def test_the_flag_table_is_the_one_the_flags_generate():
    committed = between(CONFIGURATION.read_text(), "<!-- flags-table -->", "<!-- /flags-table -->")
    assert committed == flags_table(), (
        "docs/configuration.md's flag table differs from FLAGS in stopline/settings.py: put the output of "
        f"`{REGENERATE}` between <!-- flags-table --> and <!-- /flags-table --> in docs/configuration.md"
    )


def test_the_readme_keeps_the_two_commands_ci_and_readers_run():
    # .ci/run takes the test command from the second line after its marker; a reader copies both.
    lines = README.read_text().splitlines()
    for marker, command in [
        ("<!-- run-command -->", "    pip install -e . && python -m stopline"),
        ("<!-- test-command -->", '    pip install -e ".[test]" && python -m pytest -n 2 --dist worksteal'),
    ]:
        assert lines.count(marker) == 1, marker
        at = lines.index(marker)
        assert lines[at + 1 : at + 3] == ["", command], (marker, lines[at + 1 : at + 3])
    # The README is a door: what it does not say fits in docs/.
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def outside_code(text: str) -> list[str]:
    """The lines of ``text`` outside its fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def links(page: Path) -> list[str]:
    """Where the links of ``page`` point; brackets in code are not links."""
    return [
        target
        for line in outside_code(page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))
    ]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``: lower case, punctuation dropped,
    spaces as hyphens, a repeated one numbered."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in outside_code(page.read_text()):
        heading = re.match(r"#{1,6} (.+)", line.replace("`", ""))
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = counts.get(slug, 0)
            counts[slug] = count + 1
            found.add(f"{slug}-{count}" if count else slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
