"""numba for the CPU path's compiled loops: its decorator, and whether it is installed.

numba is the ``jit`` extra. Without it every compiled loop has a numpy or torch twin that
writes the same bytes, slower; importing numba costs ~0.3 s, so callers import this module's
users only when a call needs them.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["available", "jit"]


def available() -> bool:
    """Say whether numba imports (not cached: a test may hide it after it was imported)."""
    try:
        import numba  # noqa: F401 - the import is the test
    except ImportError:
        return False
    return True


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
