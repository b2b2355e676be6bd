"""Errors that point at the place in a composition file that caused them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

Path = tuple["str | int", ...]


def render_path(path: Path) -> str:
    """``("connectors", 1, "type")`` -> ``connectors[1].type`` (the key a user would search for)."""
    out = ""
    for part in path:
        if part == "\0key":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def did_you_mean(value: object, allowed: Iterable[str]) -> str:
    """A hint naming the closest allowed value, or listing them all when nothing is close."""
    allowed = sorted(allowed)
    close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    if not allowed:
        return "nothing is available: is the plugin that provides it installed?"
    return "allowed: " + ", ".join(allowed)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a composition, located by its path in the document."""

    message: str
    path: Path = ()
    hint: str | None = None
    line: int | None = None  # 1-based, filled in when the source text is known
    column: int | None = None
    #: A warning: said by ``kvcompose check``, but the composition still runs.
    warning: bool = False

    def render(self, filename: str = "<composition>") -> str:
        where = filename
        if self.line is not None:
            where += f":{self.line}:{self.column or 1}"
        key = render_path(self.path)
        text = f"{where}: {key}: {'warning: ' if self.warning else ''}{self.message}"
        if self.hint:
            text += f" ({self.hint})"
        return text


@dataclass
class CompositionError(ValueError):
    """A composition that cannot run. ``str()`` gives one ``FILE:LINE:COL: ...`` line per problem."""

    problems: list[Problem]
    filename: str = "<composition>"
    _located: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(p.render(self.filename) for p in self.problems)

    def located(self, filename: str, locate: Locator) -> CompositionError:
        """The same problems with line and column taken from the source document."""
        problems = []
        for p in self.problems:
            line, col = locate(p.path)
            problems.append(replace(p, line=p.line or line, column=p.column or col))
        return CompositionError(problems, filename, True)


class Locator:
    """Maps a document path to the (line, column) of the deepest node that exists on it."""

    def __init__(self, marks: dict[Path, tuple[int, int]]) -> None:
        self._marks = marks

    def __call__(self, path: Sequence[str | int]) -> tuple[int | None, int | None]:
        path = tuple(path)
        while True:
            if path in self._marks:
                return self._marks[path]
            if not path:
                return None, None
            path = path[:-1]
