"""The composition file: msgspec Structs, safe YAML in, located errors and JSON Schema out.

The YAML is read by :mod:`kvcompose.reader` (plain data only, bounded, every refusal located).
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from kvcompose.contract import RULE_KINDS, RuleKind
from kvcompose.errors import CompositionError, Locator, Problem, did_you_mean
from kvcompose.errors import Path as DocPath
from kvcompose.reader import KEY, MAX_BYTES, MAX_CONNECTORS, parse_yaml, plain_data_problem
from kvcompose.units import ByteSize

T = TypeVar("T")

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
#: A rule by name (``first-wins``) or with parameters (``{use: longest-hit, ...}``).
RuleChoice = str | dict[str, Any]


class Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for every struct of the file: an unknown key is a typo until proven otherwise."""


#: A child's role in P/D disaggregation, as the composition file spells it.
Role = Literal["producer", "consumer", "both"]
#: vLLM's spelling of each role (``kv_role``).
VLLM_ROLES: dict[str, str] = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


class ChildSpec(Spec):
    name: Name
    type: str
    role: Role = "both"
    options: dict[str, Any] = msgspec.field(default_factory=dict)


#: The built-in rule each kind uses when ``rules:`` leaves it out.
DEFAULT_RULES: dict[RuleKind, str] = {
    "load": "first-wins",
    "store": "all",
    "metadata": "merge",
    "params": "owners",
    "completion": "owner",
    "faults": "fail",
}

#: ``rules:``: one field per rule kind (:data:`kvcompose.contract.RULE_KINDS`).
RulesSpec = msgspec.defstruct(
    "RulesSpec",
    [(kind, RuleChoice, DEFAULT_RULES[kind]) for kind in RULE_KINDS],
    bases=(Spec,),
    module=__name__,
)


class Composition(Spec):
    version: Literal[1]
    connectors: Annotated[list[ChildSpec], msgspec.Meta(min_length=1, max_length=MAX_CONNECTORS)]
    rules: RulesSpec = msgspec.field(default_factory=RulesSpec)
    #: What vLLM does with a request whose KV load failed (its ``kv_load_failure_policy``):
    #: ``fail`` ends it with an error, ``recompute`` computes the prompt locally. Unset: vLLM's
    #: default (``fail``).
    load_failure: Literal["fail", "recompute"] | None = None


def dec_hook(type_: type, obj: Any) -> Any:
    if type_ is ByteSize:
        return ByteSize.parse(obj)
    raise NotImplementedError(f"no decoder for {type_!r}")


def enc_hook(obj: Any) -> Any:
    if isinstance(obj, ByteSize):
        return int(obj)
    raise NotImplementedError(f"cannot encode {obj!r}")


def schema_hook(type_: type) -> dict[str, Any]:
    if type_ is ByteSize:
        return {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGT]i?B?|[kKmMgGtT]|B)?\s*$"},
            ],
            "description": "a size: bytes, or a number with a unit (32GiB, 512MiB, 8GB)",
        }
    raise NotImplementedError


def convert(raw: Any, type_: type[T], at: DocPath = ()) -> tuple[T | None, Problem | None]:
    """``raw`` as ``type_`` (msgspec, with the file's sizes), or the problem located at ``at`` plus
    msgspec's path: for options a plugin validates itself, e.g. a list whose entries' type
    depends on a key."""
    try:
        return msgspec.convert(raw, type=type_, dec_hook=dec_hook), None
    except msgspec.ValidationError as exc:
        return None, msgspec_problem(exc, at, type_)


_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_AT = re.compile(r"^(?P<msg>.*?) - at `\$(?P<path>[^`]*)`$", re.S)


def msgspec_problem(exc: msgspec.ValidationError, prefix: DocPath = (), fields: Any = None) -> Problem:
    """Turn msgspec's ``message - at `$.a[0].b``` into a Problem with a path and a hint."""
    text = str(exc)
    m = _AT.match(text)
    msg, path = (m.group("msg"), m.group("path")) if m else (text, "")
    parts: list[str | int] = [int(i) if i else k for k, i in _PATH_PART.findall(path)]
    full = prefix + tuple(parts)
    hint = None
    unknown = re.match(r"Object contains unknown field `(.+)`", msg)
    missing = re.match(r"Object missing required field `(.+)`", msg)
    if unknown:
        full = full + (unknown.group(1), KEY)
        msg = f"unknown key {unknown.group(1)!r}"
        allowed = _fields_at(fields, parts)
        if allowed:
            hint = did_you_mean(unknown.group(1), allowed)
    elif missing:
        msg = f"missing required key {missing.group(1)!r}"
    elif msg.startswith("Invalid enum value"):
        allowed = _literal_at(fields, parts)
        if allowed:
            hint = did_you_mean(msg.split("value", 1)[1].strip(" '\""), allowed)
    elif msg.startswith("Expected `str`, got `bool`"):
        hint = 'YAML reads yes, no, on, off, true and false as booleans: quote it ("on")'
    elif msg.startswith("Expected `str`, got `int`") or msg.startswith("Expected `str`, got `float`"):
        hint = 'quote it to make it text ("123")'
    return Problem(msg, full, hint)


def _struct_at(struct: Any, parts: list[str | int]) -> Any:
    """The Struct type found by following ``parts`` into ``struct``'s annotations, if any."""
    t = struct
    for part in parts:
        t = _unwrap(t)
        if isinstance(part, int):
            args = typing.get_args(t)
            t = args[0] if args else None
        elif isinstance(t, type) and issubclass(t, msgspec.Struct):
            t = typing.get_type_hints(t, include_extras=True).get(part)
        else:
            return None
    return _unwrap(t)


def _unwrap(t: Any) -> Any:
    while typing.get_origin(t) is Annotated:
        t = typing.get_args(t)[0]
    args = (
        [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (typing.Union, types.UnionType)
        else None
    )
    if args and len(args) == 1:
        return _unwrap(args[0])
    return t


def _fields_at(struct: Any, parts: list[str | int]) -> list[str]:
    t = _struct_at(struct, parts)
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return list(t.__struct_fields__)
    return []


def _literal_at(struct: Any, parts: list[str | int]) -> list[str]:
    t = _struct_at(struct, parts)
    if typing.get_origin(t) is Literal:
        return [str(a) for a in typing.get_args(t)]
    return []


class Source(msgspec.Struct, frozen=True):
    """A parsed composition with where it came from (so later errors can carry line numbers)."""

    composition: Composition
    filename: str
    locator: Locator

    def error(self, problems: list[Problem]) -> CompositionError:
        return CompositionError(problems, self.filename).located(self.filename, self.locator)

    def locate(self, problems: list[Problem]) -> tuple[Problem, ...]:
        """The problems with line and column taken from the source (for warnings)."""
        return tuple(self.error(problems).problems)


def load_text(text: str, filename: str = "<composition>") -> Source:
    """Parse and structurally validate a composition (types and options are checked later)."""
    data, locator = parse_yaml(text, filename)
    if not isinstance(data, dict):
        raise CompositionError(
            [Problem("a composition is a mapping with `version:` and `connectors:`", line=1, column=1)], filename
        )
    try:
        comp = msgspec.convert(data, type=Composition, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        problem = msgspec_problem(exc, (), Composition)
        if problem.path == ("version",) or (problem.message.startswith("missing") and "version" in problem.message):
            problem = Problem(problem.message, problem.path, "this file format is version 1: add `version: 1`")
        raise CompositionError([problem], filename).located(filename, locator) from None
    names = [c.name for c in comp.connectors]
    dup = [
        Problem(f"connector name {n!r} is used twice", ("connectors", i, "name"), "names must be unique")
        for i, n in enumerate(names)
        if n in names[:i]
    ]
    if dup:
        raise CompositionError(dup, filename).located(filename, locator)
    return Source(comp, filename, locator)


def load_file(path: str | Path) -> Source:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise CompositionError([Problem(f"cannot read the file: {exc.strerror}")], str(p)) from None
    if len(raw) > MAX_BYTES:
        raise CompositionError(
            [Problem(f"the file is larger than {MAX_BYTES} bytes; a composition is a few lines")], str(p)
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CompositionError(
            [Problem(f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})", hint="save it as UTF-8")],
            str(p),
        ) from None
    return load_text(text, str(p))


def to_builtins(comp: Composition) -> dict[str, Any]:
    """The composition as plain data (what travels inside vLLM's ``kv_connector_extra_config``)."""
    return msgspec.to_builtins(comp, enc_hook=enc_hook)


def from_builtins(data: Any, filename: str = "<kv_connector_extra_config>") -> Source:
    """A composition from plain data (JSON in vLLM's arguments): the same checks as from YAML,
    but for what only YAML can write."""
    problem = plain_data_problem(data)
    if problem is not None:
        raise CompositionError([problem], filename)
    try:
        comp = msgspec.convert(data, type=Composition, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        raise CompositionError([msgspec_problem(exc, (), Composition)], filename) from None
    return Source(comp, filename, Locator({}))
