"""The example compositions shipped inside the package (``kvcompose examples`` lists them).

They are package data, so an installed wheel has them wherever it is installed: the demo, the
benchmarks and the engine tests run these files, and the repository's ``examples/*.yaml`` are
links to them. Each file opens with a comment whose first sentence is its summary.
"""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path

#: The folder holding the example files (inside the installed package).
EXAMPLES = Path(__file__).resolve().parent
SUFFIX = ".yaml"
#: The shipped P/D pairs by host tier (``--host-tier``), each the stem of a ``-prefill.yaml`` and a
#: ``-decode.yaml``: vLLM's SimpleCPUOffloadConnector (``cpu-offload``) or its OffloadingConnector
#: (``native-offload``).
HOST_TIERS = {"simple": "pd", "native": "native"}


class ExampleError(ValueError):
    """An unknown example name, or a file ``write`` would overwrite."""


@dataclass(frozen=True)
class Example:
    name: str
    path: Path

    def text(self) -> str:
        return self.path.read_text()

    def summary(self) -> str:
        """The first sentence of the file's opening comment."""
        lines = []
        for line in self.text().splitlines():
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("# ").strip())
        first, _, _ = " ".join(lines).partition(". ")
        return first.rstrip(".")


def all_examples() -> list[Example]:
    """Every shipped example, by name."""
    return [Example(p.name.removesuffix(SUFFIX), p) for p in sorted(EXAMPLES.glob(f"*{SUFFIX}"))]


def example(name: str) -> Example:
    """The example called ``name`` (``.yaml`` optional); :class:`ExampleError` names the ones
    there are."""
    known = {e.name: e for e in all_examples()}
    wanted = name.removesuffix(SUFFIX)
    if wanted in known:
        return known[wanted]
    close = difflib.get_close_matches(wanted, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ExampleError(f"no example named {name!r}{hint}; there are: {', '.join(known)}")


def pd_pair(host_tier: str = "simple") -> tuple[Path, Path]:
    """The shipped prefill and decode files of ``host_tier`` (a name of :data:`HOST_TIERS`); an
    :class:`ExampleError` names the tiers for another."""
    if host_tier not in HOST_TIERS:
        raise ExampleError(f"no host tier named {host_tier!r}; choose from {', '.join(HOST_TIERS)}")
    stem = HOST_TIERS[host_tier]
    return EXAMPLES / f"{stem}-prefill{SUFFIX}", EXAMPLES / f"{stem}-decode{SUFFIX}"


def write(examples: list[Example], folder: Path, force: bool = False) -> list[Path]:
    """Copy ``examples`` into ``folder`` (created if missing) and return the paths written. A file
    already there with other contents is refused unless ``force``; nothing is written then."""
    targets = [(e, folder / e.path.name) for e in examples]
    if not force:
        clash = [str(t) for e, t in targets if t.exists() and t.read_bytes() != e.path.read_bytes()]
        if clash:
            raise ExampleError(f"{', '.join(clash)} already exists with other contents (--force replaces it)")
    folder.mkdir(parents=True, exist_ok=True)
    for e, target in targets:
        shutil.copyfile(e.path, target)
    return [t for _, t in targets]


__all__ = ["EXAMPLES", "HOST_TIERS", "Example", "ExampleError", "all_examples", "example", "pd_pair", "write"]
