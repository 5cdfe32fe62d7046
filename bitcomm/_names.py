"""Names that become directory names (an experiment's results go to ``results/NAME/``).

>>> check("table1-chain", "name")
'table1-chain'
"""

from __future__ import annotations

import re

__all__ = ["check"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check(value: object, where: str) -> str:
    """Return ``value`` if it is a safe name; ``ValueError`` naming ``where`` otherwise.

    1-64 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit: no path
    separators, no ``..``, nothing hidden, so ``results/NAME`` stays inside ``results/``.
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{where}: expected 1-64 letters, digits, '.', '_' or '-', starting "
                         f"with a letter or digit (it names a results directory), got {value!r}")
    return value
