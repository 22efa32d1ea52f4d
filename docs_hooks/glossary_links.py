"""An mkdocs hook (mkdocs.yml `hooks:`): each term docs/glossary.md defines (in bold) links, at its
first use on every other page, to its definition, where the hook puts an anchor. The glossary
stays the one place a term is defined; the other pages only point at it."""

from __future__ import annotations

import functools
import pathlib
import re

GLOSSARY = pathlib.Path(__file__).parents[1] / "docs" / "glossary.md"
BOLD = re.compile(r"\*\*([^*]+)\*\*")
# What a link must not go into: inline code, links and images, HTML, URLs, bold runs.
KEPT = re.compile(r"`[^`]*`|!?\[[^\]]*\]\([^)]*\)|<[^>]*>|https?://\S+|\*\*[^*]*\*\*")
FENCE = re.compile(r"^\s*```")


def split_terms(bold: str) -> list[str]:
    """The terms one bold run defines: "FSDP / ZeRO" and "TTFT, TPOT" define two each."""
    return [t.strip().strip("`") for t in re.split(r",\s*|\s*/\s*", bold) if t.strip()]


def anchor(term: str) -> str:
    return "term-" + re.sub(r"[^a-z0-9]+", "-", term.lower()).strip("-")


@functools.cache
def terms() -> tuple[str, ...]:
    """Every term of the glossary, longest first, so that "ZeRO-1" is linked before "ZeRO"."""
    found = {t for bold in BOLD.findall(GLOSSARY.read_text()) for t in split_terms(bold)}
    return tuple(sorted(found, key=len, reverse=True))


def _link_first_use(text: str, term: str) -> str:
    """`text` with the first use of `term` outside code, links, HTML, headings and bold linked."""
    word = re.compile(rf"(?<![\w-]){re.escape(term)}(?![\w-])", re.I)
    lines, fenced = text.split("\n"), False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        if fenced or FENCE.match(line) or line.lstrip().startswith("#"):
            continue
        start = 0
        for kept in [*KEPT.finditer(line), None]:
            end = kept.start() if kept else len(line)
            if found := word.search(line, start, end):
                link = f"[{found.group(0)}](glossary.md#{anchor(term)})"
                lines[i] = line[: found.start()] + link + line[found.end() :]
                return "\n".join(lines)
            start = kept.end() if kept else end
    return text


def link_terms(markdown: str) -> str:
    for term in terms():
        markdown = _link_first_use(markdown, term)
    return markdown


def anchor_terms(markdown: str) -> str:
    """The glossary with an anchor before each bold run, one per term it defines."""
    return BOLD.sub(lambda m: "".join(f'<a id="{anchor(t)}"></a>' for t in split_terms(m.group(1))) + m.group(0),
                    markdown)  # fmt: skip


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    return anchor_terms(markdown) if page.file.src_uri == GLOSSARY.name else link_terms(markdown)
