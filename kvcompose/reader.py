"""The YAML reader of composition files: safe, bounded, and every refusal located.

A composition is plain data: mappings with text keys, lists, text, finite numbers, booleans and
null. Everything else is refused before the document is built, with the line and column where
it starts, never with a traceback:

* bytes that are not text (NUL and other control characters), and syntax errors;
* explicit tags (``!!python/object``, ``!include``, ``!!binary``, ...) and values YAML would
  build into something else than plain data (an unquoted ``2024-01-01`` is a date);
* a key written twice in one mapping, at any depth (YAML's loader keeps the last silently);
* keys that are not text, numbers that are not finite or do not fit vLLM's int64 fields;
* documents beyond the bounds below: bytes, nodes (alias expansions counted), depth, the
  length of one value, the number of connectors.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from kvcompose.errors import CompositionError, Locator, Problem
from kvcompose.errors import Path as DocPath

MAX_BYTES = 1 << 20
MAX_NODES = 20_000
MAX_DEPTH = 32
#: The longest scalar: a path on Linux (PATH_MAX) fits, a pasted blob does not.
MAX_SCALAR = 4096
MAX_CONNECTORS = 32
#: vLLM's integer fields are int64; a larger number would overflow them.
MAX_INT = 2**63 - 1
#: Path suffix under which a mapping key's own position is recorded.
KEY = "\0key"

_CORE = "tag:yaml.org,2002:"
#: The tags plain data resolves to (``<<`` is a merge key, which expands an anchor in place).
PLAIN_TAGS = frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge"))
#: Python types of plain data, after construction.
_PLAIN = (str, int, float, bool, type(None), list, dict)


class _Refused(Exception):
    def __init__(self, problem: Problem) -> None:
        self.problem = problem


def _at(node: yaml.Node, message: str, hint: str | None = None, path: DocPath = ()) -> _Refused:
    return _Refused(Problem(message, path, hint, node.start_mark.line + 1, node.start_mark.column + 1))


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class _Scan:
    """One pass over the composed node graph: positions of every path, and every bound checked.

    Aliases share nodes: a node already scanned is charged its expanded size without a second
    walk, so an alias bomb is stopped after a few thousand steps, not after expanding it.
    """

    def __init__(self, loader: yaml.SafeLoader) -> None:
        self.loader = loader
        self.marks: dict[DocPath, tuple[int, int]] = {}
        self.left = MAX_NODES
        self.sizes: dict[int, int] = {}
        self.aliased = False
        self.duplicates: list[Problem] = []

    def walk(self, node: yaml.Node, path: DocPath, depth: int) -> None:
        self.marks.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        size = self.sizes.get(id(node))
        if size is not None:  # an alias: charge the size of what it repeats
            self.aliased = True
            self._charge(node, size, path)
            return
        if depth > MAX_DEPTH:
            raise _at(node, f"nested more than {MAX_DEPTH} levels deep; a composition needs a few", path=path)
        before = self.left
        self._charge(node, 1, path)
        self._check_tag(node, path)
        if isinstance(node, yaml.ScalarNode):
            if len(node.value) > MAX_SCALAR:
                raise _at(
                    node,
                    f"a value of {len(node.value)} characters; at most {MAX_SCALAR} are accepted",
                    "is this the right file?",
                    path,
                )
        elif isinstance(node, yaml.MappingNode):
            seen: dict[object, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    self._check_tag(key, path)
                    k: str | int = key.value
                    ident = self._key_identity(key)
                    if ident in seen and key.tag != _CORE + "merge":
                        self.duplicates.append(
                            Problem(
                                f"key {_short(key.value)!r} is written twice in this mapping: "
                                f"on line {seen[ident]} and on line {key.start_mark.line + 1}",
                                path + (k, KEY),
                                "YAML would keep only the last one silently; delete one of them",
                                key.start_mark.line + 1,
                                key.start_mark.column + 1,
                            )
                        )
                    seen.setdefault(ident, key.start_mark.line + 1)
                else:
                    raise _at(key, "a key must be text, not a list or mapping", path=path)
                self.marks.setdefault(path + (k, KEY), (key.start_mark.line + 1, key.start_mark.column + 1))
                self.walk(value, path + (k,), depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            if path == ("connectors",) and len(node.value) > MAX_CONNECTORS:
                raise _at(
                    node,
                    f"{len(node.value)} connectors; a composition has at most {MAX_CONNECTORS}",
                    "one engine composes a few connectors; split the file per instance",
                    path,
                )
            for i, item in enumerate(node.value):
                self.walk(item, path + (i,), depth + 1)
        self.sizes[id(node)] = before - self.left

    def _charge(self, node: yaml.Node, n: int, path: DocPath) -> None:
        self.left -= n
        if self.left >= 0:
            return
        if self.aliased:
            raise _at(
                node,
                f"aliases expand the document to more than {MAX_NODES} nodes (each expansion counted; "
                "an alias bomb?); the count passed the limit here",
                "a composition has a few dozen nodes; write it out without nested aliases",
                path,
            )
        raise _at(
            node,
            f"the document has more than {MAX_NODES} nodes (values, lists and mappings counted); "
            "the count passed the limit here",
            "a composition has a few dozen nodes; is this the right file?",
            path,
        )

    def _check_tag(self, node: yaml.Node, path: DocPath) -> None:
        if node.tag in PLAIN_TAGS:
            return
        if node.tag == _CORE + "timestamp":
            raise _at(node, f"{node.value!r} reads as a date in YAML", f'quote it: "{node.value}"', path)
        raise _at(
            node,
            f"tag {node.tag!r} is refused: only plain YAML is accepted (no tags that build Python objects, "
            "read files or decode binary)",
            "remove the tag",
            path,
        )

    def _key_identity(self, key: yaml.ScalarNode) -> object:
        """The key as the loader would store it: ``yes`` and ``true`` (or ``1`` and ``0x1``) are
        one dict key and overwrite each other."""
        try:
            value = self.loader.construct_object(key)
        except yaml.YAMLError:
            return (key.tag, key.value)
        try:
            hash(value)
        except TypeError:
            return (key.tag, key.value)
        return value


def _check_values(data: Any, path: DocPath) -> None:
    """Plain data only, after construction: text keys, finite numbers that fit int64."""
    if isinstance(data, dict):
        for k, v in data.items():
            if not isinstance(k, str):
                what = "a boolean" if isinstance(k, bool) else type(k).__name__
                raise _Refused(
                    Problem(
                        f"key {k!r} is {what}, not text",
                        path + (str(k), KEY),
                        "quote it" + (" (YAML reads yes/no/on/off as booleans)" if isinstance(k, bool) else ""),
                    )
                )
            _check_values(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_values(v, path + (i,))
    elif isinstance(data, bool) or data is None or isinstance(data, str):
        return
    elif isinstance(data, int):
        if abs(data) > MAX_INT:
            raise _Refused(Problem(f"{data} does not fit in 64 bits (at most {MAX_INT})", path))
    elif isinstance(data, float):
        if not math.isfinite(data):
            raise _Refused(Problem(f"{data} is not a finite number", path, "give a number"))
    elif not isinstance(data, _PLAIN):
        raise _Refused(Problem(f"a {type(data).__name__} is not plain data", path, "quote the value"))


def plain_data_problem(data: Any) -> Problem | None:
    """What makes already-built data (JSON, say) not a composition's plain data, if anything."""
    try:
        _check_values(data, ())
    except _Refused as refused:
        return refused.problem
    except RecursionError:
        return Problem(f"nested too deeply; a composition is at most {MAX_DEPTH} levels deep")
    return None


def parse_yaml(text: str, filename: str = "<composition>") -> tuple[Any, Locator]:
    """Safe-load one YAML document of plain data; return it and a locator for its paths."""
    if len(text.encode("utf-8", "replace")) > MAX_BYTES:
        raise CompositionError(
            [Problem(f"the file is larger than {MAX_BYTES} bytes; a composition is a few lines", line=1, column=1)],
            filename,
        )
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark is not content
    loader: yaml.SafeLoader | None = None
    scan: _Scan | None = None
    try:
        loader = yaml.SafeLoader(text)  # the reader checks for unprintable characters here
        node = loader.get_single_node()
        if node is None:
            raise CompositionError(
                [Problem("the file is empty", hint="start with `version: 1` and a `connectors:` list")], filename
            )
        scan = _Scan(loader)
        scan.walk(node, (), 0)
        if scan.duplicates:
            raise CompositionError(scan.duplicates, filename)
        data = loader.construct_document(node)
        _check_values(data, ())
    except _Refused as refused:
        problem = refused.problem
        if problem.line is None and scan is not None:
            line, column = Locator(scan.marks)(problem.path)
            problem = Problem(problem.message, problem.path, problem.hint, line, column)
        raise CompositionError([problem], filename) from None
    except yaml.reader.ReaderError as exc:
        line, column = _line_column(text, exc.position)
        char = chr(exc.character) if isinstance(exc.character, int) else str(exc.character)
        what = "a NUL byte" if char == "\0" else f"character U+{ord(char[:1] or ' '):04X}"
        raise CompositionError(
            [Problem(f"{what} is not allowed in YAML text", (), "is this a text file?", line, column)], filename
        ) from None
    except yaml.MarkedYAMLError as exc:
        raise CompositionError([_marked_problem(exc)], filename) from None
    except yaml.YAMLError as exc:
        raise CompositionError([Problem(f"not valid YAML: {exc}", line=1, column=1)], filename) from None
    except RecursionError:
        raise CompositionError(
            [Problem(f"nested too deeply to read; a composition is at most {MAX_DEPTH} levels deep", line=1, column=1)],
            filename,
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    assert scan is not None
    return data, Locator(scan.marks)


def _line_column(text: str, position: int) -> tuple[int, int]:
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def _marked_problem(exc: yaml.MarkedYAMLError) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    msg = " ".join(str(x) for x in (exc.context, exc.problem) if x)
    hint = None
    if "'\\t'" in msg:
        hint = "YAML indents with spaces, not tabs"
    elif "python/" in msg or "could not determine a constructor" in msg:
        msg += "; only plain YAML is accepted (no tags that build Python objects)"
    elif "expected a single document" in msg:
        hint = "a composition is one document: remove the second `---`"
    return Problem(msg, (), hint, mark.line + 1 if mark else None, mark.column + 1 if mark else None)
