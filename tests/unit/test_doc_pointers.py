"""Every pointer into the docs, in code comments and in the docs themselves, lands on a heading.

Three forms name a heading, and each is checked against the Markdown it points at:

* an anchor: a path ending in ``.md#anchor`` (or a Markdown link ``](#anchor)`` inside one doc),
  anchored as GitHub anchors headings;
* a quoted heading: a ``docs`` path, then optionally a comma or colon, then the heading's text in
  double quotes (a numbered heading's number may be left out);
* a numbered section: a ``docs`` path, then ``5b``, ``section 4`` or ``benchmark 4``: a heading
  opening with that number.

A ``docs`` path with nothing after it points at the whole file, which must exist.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
#: Where pointers are written: the packages, both plugins, the tools, the docs, the tests and examples.
SCANNED = ("kvcompose", "plugins", "tools", "docs", "tests", "examples", "scripts")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml")
SUFFIXES = {".py", ".md", ".c", ".toml", ".yaml", ".yml", ".sh", ".cfg"}
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_NUMBER = re.compile(r"^(\d+[a-z]?)\.\s")
# A comment's or docstring's line break, with the next line's comment marker, reads as a space.
_CONTINUATION = re.compile(r"[ \t]*\n[ \t]*(?:#:?|\*|//)?[ \t]*")
_DOC_PATH = r"docs/([\w-]+\.md)"
_ANCHOR = re.compile(r"(?<![\w/.-])((?:\.\./)*(?:[\w-]+/)*[\w-]+\.md)?#([\w-]+)\)?")
_QUOTED = re.compile(_DOC_PATH + r"`{0,2}(?:'s)?[,:]?\s+\"([^\"\n]{1,160})\"")
_NUMBERED = re.compile(_DOC_PATH + r"`{0,2}[,:]?\s+(?:section\s+|benchmark\s+)?(\d+[a-z]?)(?![\w.%/-]|\.\d)")
_BARE = re.compile(r"(?<![\w.-])" + _DOC_PATH)


def _sources() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if path.is_file() and path.suffix in SUFFIXES and not parts & SKIPPED_DIRS:
                if not any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
                    files.append(path)
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def headings(doc: Path) -> tuple[list[str], set[str]]:
    """The headings of a Markdown file (outside code fences) and their anchors."""
    texts: list[str] = []
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in doc.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            text = m.group(2)
            texts.append(text)
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return texts, anchors


def _find_doc(source: Path, target: str) -> Path | None:
    for base in (source.parent, ROOT, DOCS):
        path = (base / target).resolve()
        if path.is_file():
            return path
    if source.suffix != ".md":  # a comment's bare name: the docs folder
        path = DOCS / Path(target).name
        return path if path.is_file() else None
    return None


def _resolves_text(doc: Path, wanted: str) -> bool:
    texts, _ = headings(doc)
    plain = [t.replace("`", "") for t in texts]
    numberless = [_NUMBER.sub("", t) for t in plain]
    return wanted.replace("`", "") in plain + numberless


def _resolves_number(doc: Path, number: str) -> bool:
    return any(t.startswith(f"{number}. ") for t in headings(doc)[0])


def pointer_errors(raw: str, source: Path) -> list[str]:
    """What in ``raw``, the text of ``source``, points at a doc or heading that does not exist."""
    text = _CONTINUATION.sub(" ", raw)
    where = source.relative_to(ROOT)
    errors: list[str] = []
    for m in _BARE.finditer(text):
        if not (DOCS / m.group(1)).is_file():
            errors.append(f"{where}: docs/{m.group(1)} does not exist")
    for m in _ANCHOR.finditer(text):
        target, anchor = m.group(1), m.group(2)
        if target is None:
            # "](#x)" inside a Markdown file; a "#" elsewhere is a comment or a colour, not a pointer.
            if source.suffix != ".md" or text[m.start() - 2 : m.start()] != "](":
                continue
            doc: Path | None = source
        else:
            doc = _find_doc(source, target)
            if doc is None:
                errors.append(f"{where}: {target}#{anchor}: no such file")
                continue
        if doc.suffix == ".md" and anchor not in headings(doc)[1]:
            errors.append(f"{where}: {target or ''}#{anchor}: no such heading in {doc.name}")
    for m in _QUOTED.finditer(text):
        doc = DOCS / m.group(1)
        if doc.is_file() and not _resolves_text(doc, m.group(2)):
            errors.append(f'{where}: docs/{m.group(1)}, "{m.group(2)}": no such heading')
    for m in _NUMBERED.finditer(text):
        doc = DOCS / m.group(1)
        if doc.is_file() and not _resolves_number(doc, m.group(2)):
            errors.append(f"{where}: docs/{m.group(1)} {m.group(2)}: no heading numbered so")
    return errors


def test_every_doc_pointer_lands_on_a_heading() -> None:
    errors = [e for source in _sources() for e in pointer_errors(source.read_text(errors="replace"), source)]
    assert not errors, "pointers into the docs that land nowhere:\n" + "\n".join(errors)


@pytest.mark.parametrize(
    ("line", "lands"),
    [
        ('# the worker step (docs/performance.md, "2. Worker step")', True),
        ('# the worker step (docs/performance.md, "Worker step")', True),
        ('# the worker step (docs/performance.md, "No such step")', False),
        ("# a section (docs/performance.md 5b)", True),
        ("# a section (``docs/performance.md``, benchmark 4)", True),
        ("# a section (docs/performance.md 9z)", False),
        ("# an anchor (docs/performance.md#2-worker-step)", True),
        ("# an anchor (docs/performance.md#no-such-anchor)", False),
        ("# a whole file (docs/no-such-file.md)", False),
        ('# wrapped (docs/performance-history.md,\n#   "Streaming copies")', True),
        ('# wrapped (docs/performance-history.md,\n#   "Streaming pastes")', False),
    ],
)
def test_the_pointer_forms(line: str, lands: bool) -> None:
    errors = pointer_errors(line + "\n", ROOT / "kvcompose" / "probe.py")
    assert (errors == []) is lands, errors
