"""Model-sized tensors the parameter server reuses from round to round instead of allocating them anew.

Why: a round makes model-sized results (the accumulator, ``u``, the new momentum, the new weights). Filling
a *fresh* allocation costs the page faults of every page (31–55 ms for 102 MB on a 2-core VM, 200–550 ms
for 500 MB) where refilling memory already in use costs 4–7 ms per 102 MB (docs/benchmarks.md, "Parameter
server aggregation"): most of a round's step was page faults.

The rule the pool keeps: **a tensor is handed out again only when nothing else holds any part of it.** The
published weights of round r (served, checkpointed, read by the eval thread) are never mutated while a
reader holds them, because the pool does not count on being told when a reader is done: it asks torch.
Every storage the pool allocated is kept with one ``UntypedStorage`` object of its own, and torch counts the
holders of a storage (``torch._C._storage_Use_Count``: one for the pool's object, one per tensor or view on
it, one per other storage object), and Python counts the references to the storage object itself (torch
hands out the pool's own object for ``tensor.untyped_storage()``). A storage with no holder but the pool has
no tensor, no view, no storage object and no NumPy array (``Tensor.numpy()`` holds the tensor) left
anywhere: no reader can reach its memory, so it may be refilled. (``_storage_Use_Count`` is private torch
API, and the Python count depends on how torch keeps a storage's object alive: tests/parameter_server/
test_buffer_pool.py pins both, so a torch that changes them fails there.) Nothing has to release a buffer
explicitly: dropping the last reference (the coordinator replacing its
weights, the eval thread finishing, a served result being pruned) frees it for the next round.

Buffers come in *sets*: one tensor per name of a signature (name → shape, dtype), like a state dict, all on
one storage. A set is reused only as a whole, when nothing holds any part of it, so that a reader holding one
tensor of the weights of round r (``weights["wte"]``) keeps that round's whole set untouched.

Thread safety: :meth:`BufferPool.take` may be called from several threads (a lock guards the pool's lists);
a set handed out belongs to its caller.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping

import torch

StateDict = dict[str, torch.Tensor]
Signature = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""name → (shape, dtype) of a set of buffers."""

_Key = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
#: Byte alignment of each tensor in a set's storage (a cache line; what torch's CPU allocator gives).
ALIGNMENT = 64


def _use_count(storage: torch.UntypedStorage) -> int:
    """How many holders ``storage``'s memory has (the pool's object counts one)."""
    return torch._C._storage_Use_Count(storage._cdata)


def _key(signature: Signature) -> _Key:
    return tuple(sorted((name, tuple(shape), dtype) for name, (shape, dtype) in signature.items()))


class _Set:
    """One set: a single storage the pool allocated, cut into a tensor per name of its signature (each at
    an offset aligned to :data:`ALIGNMENT` bytes). One allocation per set rather than one per tensor: a
    model-sized block is always its own ``mmap``, which goes back to the system when the pool drops it,
    where tensor-sized ones land in the C allocator's heap among short-lived tensors (and stay there)."""

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.layout: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        offset = 0
        for name, shape, dtype in key:
            offset = -(-offset // ALIGNMENT) * ALIGNMENT
            self.layout.append((name, shape, dtype, offset))
            offset += math.prod(shape) * dtype.itemsize
        self.nbytes = offset
        self.storage = torch.UntypedStorage(max(offset, 1))
        #: Python references to the storage object when only this set holds it (how ``sys.getrefcount``
        #: counts differs between Python versions: measured, not assumed).
        self._own_references = sys.getrefcount(self.storage)

    def is_free(self) -> bool:
        return self.held_only_by(0)

    def held_only_by(self, tensors: int) -> bool:
        """Whether the set's memory has no holder but the pool and ``tensors`` tensor objects on it: no other
        tensor, view or storage object in C++ (torch's use count), and no Python reference to the storage
        object besides the pool's (``tensor.untyped_storage()`` gives the pool's own object back)."""
        count = _use_count(self.storage)
        # While any tensor holds the storage, torch keeps its Python object alive with one reference of its
        # own (PyObject preservation): one more, however many tensors.
        return count == 1 + tensors and sys.getrefcount(self.storage) == self._own_references + (count > 1)

    def tensors(self) -> StateDict:
        """New tensor objects on the set's storage (their contents are whatever was written last)."""
        return {
            name: torch.empty(0, dtype=dtype).set_(self.storage, offset // dtype.itemsize, shape)
            for name, shape, dtype, offset in self.layout
        }

    def holds(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` are exactly this set's tensors (names, storage, offsets, shapes, dtypes)."""
        if len(tensors) != len(self.layout):
            return False
        for name, shape, dtype, offset in self.layout:
            tensor = tensors.get(name)
            # torch keeps one Python object per storage while it lives: the set's object *is* the tensor's.
            if (
                tensor is None
                or tensor.untyped_storage() is not self.storage
                or tensor.dtype != dtype
                or tuple(tensor.shape) != shape
                or tensor.storage_offset() * dtype.itemsize != offset
                or not tensor.is_contiguous()
            ):
                return False
        return True


class BufferPool:
    """Sets of CPU tensors handed out by signature and taken back, implicitly, when nothing holds them.

    * :meth:`take` returns a state dict of new tensor objects with the signature's shapes and dtypes and
      *undefined* contents: the storages of a free set of that signature when the pool has one, else a new
      set (counted in :attr:`allocated`). The caller owns it; the pool hands those storages out again only
      after every tensor on them is gone.
    * :meth:`owns` and :meth:`held_elsewhere` let the owner of a set decide to write into it in place:
      a set no one else holds may be overwritten without any reader seeing it change.
    * :meth:`trim` drops free sets beyond a number (memory the next round will not need).
    """

    def __init__(self) -> None:
        self._sets: list[_Set] = []
        self._lock = threading.Lock()
        self.allocated = 0
        """Sets allocated so far (a take that found no free set)."""
        self.reused = 0
        """Takes served by a free set."""

    def take(self, signature: Signature) -> StateDict:
        """A set of tensors of ``signature`` (CPU, contiguous, contents undefined)."""
        key = _key(signature)
        with self._lock:
            for candidate in self._sets:
                if candidate.key == key and candidate.is_free():
                    self.reused += 1
                    # Handed out under the lock: its tensors hold the storage before another take looks.
                    return candidate.tensors()
            made = _Set(key)
            self._sets.append(made)
            self.allocated += 1
            return made.tensors()

    def owns(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` are exactly the tensors of one set this pool handed out."""
        return self._set_of(tensors) is not None

    def held_elsewhere(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether anything besides the tensor objects of ``tensors`` holds their memory: another tensor or
        view on it, or a storage object (True also for tensors that are not one of this pool's sets). The
        caller must be the only holder of those tensor objects (it never hands them out): references to the
        same tensor *object* are not counted, other tensor objects (``detach()``, views) are."""
        found = self._set_of(tensors)
        if found is None:
            return True
        return not found.held_only_by(len(found.layout))

    def _set_of(self, tensors: Mapping[str, torch.Tensor]) -> _Set | None:
        with self._lock:
            for candidate in self._sets:
                if candidate.holds(tensors):
                    return candidate
        return None

    def trim(self, spare: int) -> None:
        """Keep at most ``spare`` free sets per signature; the others' memory goes back to the allocator."""
        with self._lock:
            kept: list[_Set] = []
            free: dict[_Key, int] = {}
            for candidate in self._sets:
                if candidate.is_free():
                    free[candidate.key] = free.get(candidate.key, 0) + 1
                    if free[candidate.key] > spare:
                        continue
                kept.append(candidate)
            self._sets = kept

    @property
    def sets(self) -> int:
        """Sets the pool holds (free or handed out)."""
        return len(self._sets)

    @property
    def free_sets(self) -> int:
        with self._lock:
            return sum(candidate.is_free() for candidate in self._sets)

    @property
    def nbytes(self) -> int:
        """Bytes of all the sets the pool holds, free or handed out."""
        with self._lock:
            return sum(candidate.nbytes for candidate in self._sets)
