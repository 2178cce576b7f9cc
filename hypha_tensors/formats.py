"""What an encoding is, without torch: its name, its block size, and the safetensors metadata that says it.

An encoded update or result is one safetensors file whose header metadata names its encoding:

* ``hypha.encoding``: ``float32`` (the default, and what a file without the key is: Hypha's executors write
  none), ``float16``, ``bfloat16`` or ``int8``;
* ``hypha.block_size``: for ``int8`` only, the number of consecutive values (of the flattened tensor) that
  share one scale.

The control plane imports this module (job specs name an encoding); the tensor work is in
:mod:`hypha_tensors.encoding`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
INT8 = "int8"
#: Every encoding, lossless first.
ENCODINGS = (FLOAT32, FLOAT16, BFLOAT16, INT8)
DEFAULT_ENCODING = FLOAT32
#: Values per int8 scale: 256 values cost 256 bytes plus a 4-byte scale (1.6 % over one byte per value), and
#: a block that small keeps one outlier from coarsening the quantum of many values.
DEFAULT_BLOCK_SIZE = 256
#: Below 16 the scales cost more than a quarter of the values; above 2^20 one outlier sets the quantum of a
#: million values.
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 1 << 20

ENCODING_KEY = "hypha.encoding"
BLOCK_SIZE_KEY = "hypha.block_size"
#: The metadata keys an encoded file carries (``hypha_tensors.weights.save`` lets these ``hypha.`` keys
#: through).
METADATA_KEYS = frozenset({ENCODING_KEY, BLOCK_SIZE_KEY})
#: An int8 tensor ``name`` travels with its per-block scales under ``name + SCALE_SUFFIX``.
SCALE_SUFFIX = ".__scale__"


class EncodingError(ValueError):
    """An encoding that does not exist, metadata that names none, or tensors that cannot be encoded or
    decoded (non-finite values, a wrong dtype or scale shape). ``name`` is the tensor's name when one is
    at fault (else None); ``reason`` is a short phrase."""

    def __init__(self, reason: str, *, name: str | None = None) -> None:
        super().__init__(reason if name is None else f"tensor {name!r}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class Encoding:
    """A job's encoding of pseudo-gradients and results. ``block_size`` matters for ``int8`` only: the
    others are normalised to :data:`DEFAULT_BLOCK_SIZE`, so that two encodings are equal exactly when they
    encode alike. Invalid values raise :class:`EncodingError`."""

    name: str = DEFAULT_ENCODING
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.name not in ENCODINGS:
            raise EncodingError(f"unknown encoding {self.name!r}; expected one of {', '.join(ENCODINGS)}")
        size = self.block_size
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not MIN_BLOCK_SIZE <= size <= MAX_BLOCK_SIZE
        ):
            raise EncodingError(
                f"block size must be an integer from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, got {size!r}"
            )
        if self.name != INT8:
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)

    @property
    def lossy(self) -> bool:
        """Whether decoding loses something (every encoding but float32): error feedback is kept then."""
        return self.name != FLOAT32

    def metadata(self) -> dict[str, str]:
        """The safetensors header entries that say this encoding."""
        if self.name == INT8:
            return {ENCODING_KEY: INT8, BLOCK_SIZE_KEY: str(self.block_size)}
        return {ENCODING_KEY: self.name}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str] | None) -> Encoding:
        """The encoding a file's header metadata says: float32 without ``hypha.encoding``; ``int8`` must
        say its block size. :class:`EncodingError` for anything else."""
        metadata = metadata or {}
        name = metadata.get(ENCODING_KEY, FLOAT32)
        if name not in ENCODINGS:
            raise EncodingError(f"the file's {ENCODING_KEY} {name[:40]!r} is not an encoding")
        if name != INT8:
            return cls(name)
        text = metadata.get(BLOCK_SIZE_KEY, "")
        if not (text.isascii() and text.isdigit() and len(text) <= 8):
            raise EncodingError(f"an int8 file needs {BLOCK_SIZE_KEY} (an integer), got {text[:40]!r}")
        return cls(INT8, int(text))

    def __str__(self) -> str:
        return f"int8 (blocks of {self.block_size})" if self.name == INT8 else self.name
