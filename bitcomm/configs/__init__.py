"""The topologies and experiments that ship with bitcomm, found by name from any directory.

``topologies/NAME.yaml`` (schema: :mod:`bitcomm.netem.topology`) and ``experiments/NAME.yaml``
(schema: :mod:`bitcomm.netem.experiment`, or :mod:`bitcomm.experiments.digits` for
``kind: train``) are package data, so an installed bitcomm finds them wherever it runs. Every
command that takes a name also takes a path to a file of one's own (``*.yaml``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["KINDS", "names", "path", "find"]

KINDS = ("topologies", "experiments")
"""The kinds of shipped files, each a folder of ``NAME.yaml``."""
_WHAT = {"topologies": "topology", "experiments": "experiment"}


def _folder(kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"expected kind in {KINDS}, got {kind!r}")
    # A regular package on disk (also when installed from a wheel): a real folder.
    return Path(str(resources.files(__name__) / kind))


def names(kind: str) -> list[str]:
    """Return the names of the shipped files of ``kind``, sorted."""
    return sorted(p.stem for p in _folder(kind).glob("*.yaml"))


def path(kind: str, name: str) -> Path | None:
    """Return the shipped file ``kind/NAME.yaml``, or ``None`` if there is none."""
    return _folder(kind) / f"{name}.yaml" if name in names(kind) else None


def find(kind: str, name: str) -> Path:
    """Return the file ``name`` stands for: a ``.yaml`` path as given, or a shipped file's name.

    A name that looks like a path (a ``.yaml``/``.yml`` suffix or a folder) must be an existing
    file; any other must be a shipped name. ``ValueError`` says which, listing the names.
    """
    p = Path(name)
    what = _WHAT.get(kind, kind)
    if p.suffix in (".yaml", ".yml") or len(p.parts) > 1:
        if not p.is_file():
            raise ValueError(f"{p}: no such {what} file")
        return p
    found = path(kind, name)
    if found is None:
        raise ValueError(f"no {what} {name!r}: expected a .yaml path or one of {names(kind)}")
    return found
