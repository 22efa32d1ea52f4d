"""The code blocks of README.md and docs/*.md, each with the marker on the line right before its
opening fence: `<!-- runnable: NAME -->` (a test runs it, reading it with `runnable_block`),
`<!-- not-run: REASON -->`, or `<!-- test-command -->` (the README's test command, run by .ci/run)."""

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
MARKER = re.compile(r"^<!-- (runnable|not-run|test-command)(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^```(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repo root
    line: int  # the opening fence's, from 1
    language: str
    kind: str | None  # runnable, not-run, test-command, or None: unmarked
    label: str  # a runnable block's name, a not-run block's reason
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language or 'no language'})"


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: pathlib.Path) -> list[Block]:
    """Every fenced block of a page (fences start a line; a page's blocks do not nest)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fence that never closes"
        marker = MARKER.match(lines[i - 1]) if i else None
        found.append(
            Block(
                page=str(page.relative_to(ROOT)), line=i + 1, language=opening.group(1).strip(),
                kind=marker.group(1) if marker else None, label=(marker.group(2) or "") if marker else "",
                code="\n".join(lines[i + 1 : end]) + "\n",
            )
        )  # fmt: skip
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def runnable_block(page: str, name: str) -> str:
    """The code of the block marked `<!-- runnable: NAME -->` on `page` (e.g. 'docs/serving.md')."""
    found = [b.code for b in blocks(ROOT / page) if b.kind == "runnable" and b.label == name]
    assert len(found) == 1, f"{page} has {len(found)} blocks marked <!-- runnable: {name} -->"
    return found[0]
