"""How the parameter server's process gives memory back to the system (glibc's malloc; elsewhere nothing).

glibc serves a large allocation with its own ``mmap`` (returned to the system when freed) only while it is
over ``M_MMAP_THRESHOLD``; by default that threshold *rises* to the size of every such block freed (up to
32 MiB), after which tensor-sized blocks come from the heap arenas, and freed ones stay there: each thread
that read update tensors (``asyncio.to_thread``) kept a few of them, model-sized in all (docs/benchmarks.md,
"Model scale"). A fixed threshold keeps every block of :data:`MMAP_THRESHOLD` or more an ``mmap`` of its own.
:func:`release` (``malloc_trim``) hands back what the heaps hold free, after a round.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger("parameter_server")

#: Blocks this large or larger are ``mmap``-ed and unmapped when freed (mallopt's M_MMAP_THRESHOLD).
MMAP_THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def configure_allocator() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (and its heap-trim threshold at twice that);
    False where the C library is not glibc (nothing changed)."""
    libc = _libc()
    if libc is None:
        return False
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    done = bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)) and done
    if not done:
        logger.debug("mallopt refused the thresholds")
    return done


def release() -> None:
    """Collect Python's unreachable cycles (a dropped ``nn.Module`` is one: its tensors would wait for a
    full collection), then give the heaps' free memory back to the system (``malloc_trim(0)``; nothing
    where the C library has none)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
