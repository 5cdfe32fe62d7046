"""Element counts as people write them: ``4096``, ``128K``, ``16M``, ``1G`` (binary multiples).

The one grammar of the CLI's ``--size``/``--sizes`` options and of experiment files.

>>> parse("16M"), parse("128KiB"), parse(4096), human(3 << 20), human(1000)
(16777216, 131072, 4096, '3M', '1000')
"""

from __future__ import annotations

import re

__all__ = ["parse", "human", "FORMS"]

FORMS = "4096, 128K, 16M or 1G"
"""The accepted forms, as error messages name them."""

_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)i?B?\s*", re.IGNORECASE)
_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30}


def parse(value: object) -> int:
    """Return the positive count ``value`` stands for; ``ValueError`` naming the forms if none."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
    else:
        m = _SIZE.fullmatch(str(value))
        if m and int(m.group(1)) > 0:
            return int(m.group(1)) << _SHIFT[m.group(2).upper()]
    raise ValueError(f"expected a size like {FORMS}, got {value!r}")


def human(n: int) -> str:
    """Return ``n`` in the largest binary unit that divides it (``3145728`` -> ``"3M"``)."""
    for unit in ("G", "M", "K"):
        shift = _SHIFT[unit]
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)
