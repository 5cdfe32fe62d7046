"""numba for the CPU path's compiled loops: its decorator, and whether it is installed.

numba is the ``jit`` extra. Without it every compiled loop has a numpy or torch twin that
writes the same bytes, slower; importing numba costs ~0.3 s, so callers import this module's
users only when a call needs them.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["MIN_VALUES", "available", "jit", "worth"]

MIN_VALUES = 1 << 12
"""From how many values a call takes the compiled loops that beat numpy at every size (bits,
counts, the qsgd decode, 1-bit's compression): below, numpy's way costs a few microseconds
more, and a small call imports no numba (~0.3 s). sign's packing, which numpy matches up to
256K elements, keeps its own threshold."""


def available() -> bool:
    """Say whether numba imports (not cached: a test may hide it after it was imported)."""
    try:
        import numba  # noqa: F401 - the import is the test
    except ImportError:
        return False
    return True


def worth(n: int) -> bool:
    """Say whether a call over ``n`` values takes the compiled loops.

    It does where numba imports and ``n`` is at least :data:`MIN_VALUES`.
    """
    return n >= MIN_VALUES and available()


def jit(**options):  # noqa: ANN201 - a numba decorator
    """Return ``numba.njit(cache=True, **options)``, caching privately where it must.

    numba caches next to the compiled module or under $HOME; a non-root user of a read-only
    install (a container, a Slurm job) may have neither, and numba then refuses to compile a
    cached function at all. Such a process caches in a directory of its own under the temp dir.
    """
    import numba

    def decorate(fn):  # noqa: ANN001, ANN202
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as e:
            if "no locator available" not in str(e):
                raise
            numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(),
                                                  f"bitcomm-numba-{os.getuid()}")
            return numba.njit(cache=True, **options)(fn)
    return decorate
