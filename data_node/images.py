"""Image-folder datasets for ``hypha-data prepare-images``: finding the images, decoding and resizing them.

Layout: ``ROOT/<class name>/<image files>`` (files found recursively under each class directory). Classes are
the non-hidden subdirectories of ``ROOT`` sorted by name, numbered ``0..K-1`` in that order; hidden files and
directories (``.*``) are skipped, and so are files whose suffix is not an image suffix (:data:`IMAGE_SUFFIXES`).

Decoding: binary PGM/PPM (``P5``/``P6``, 8 or 16 bits) is read by this module with the standard library,
whether or not Pillow is installed, so a PPM dataset prepares the same everywhere. Every other format needs
Pillow (``PIL``), imported only when such a file is decoded; without it they are refused.

Each image becomes ``channels`` planes of ``size × size`` float values (channel-first), scaled to 0..1 by the
image's maximum value and normalised with mean 0.5 and std 0.5, i.e. to -1..1. Colour → grey is the ITU-R
601-2 luma (``0.299 R + 0.587 G + 0.114 B``, like Pillow's ``convert("L")``); grey → colour repeats the plane.
Resizing squashes to ``size × size`` (the aspect ratio is not kept) with an antialiased bilinear (triangle)
filter: Pillow's ``Image.resize(..., BILINEAR)`` for images Pillow decodes, and the same filter implemented
here for PGM/PPM (float arithmetic: it differs from Pillow only by rounding). An image already ``size × size``
is not resampled.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

NETPBM_SUFFIXES = frozenset({".ppm", ".pgm", ".pnm"})
IMAGE_SUFFIXES = NETPBM_SUFFIXES | frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
)
MEAN = 0.5
STD = 0.5
_WHITESPACE = b" \t\r\n\x0b\x0c"


class ImageError(Exception):
    """An image folder or an image in it cannot be used (missing, empty, unreadable or undecodable)."""


@dataclass(frozen=True)
class ImageSample:
    path: Path
    label: int


@dataclass(frozen=True)
class ImageFolder:
    classes: list[str]
    """Class names; a class's label id is its index."""
    samples: list[ImageSample]
    """Every image, by class then path (sorted)."""
    ignored: int
    """Non-hidden files skipped because their suffix is not an image suffix."""


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def image_folder(root: Path) -> ImageFolder:
    """The classes and images of ``root``; raises :class:`ImageError` if it is not a directory, has no class
    directory, or a class directory holds no image."""
    if not root.is_dir():
        raise ImageError(f"input {root} is not a directory")
    classes = sorted(
        entry.name for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith(".")
    )
    if not classes:
        raise ImageError(f"{root} holds no class directories ({root}/<class name>/<images>)")
    samples: list[ImageSample] = []
    ignored = 0
    for label, name in enumerate(classes):
        directory = root / name
        files = sorted(p for p in directory.rglob("*") if p.is_file() and _visible(p, directory))
        images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        ignored += len(files) - len(images)
        if not images:
            raise ImageError(
                f"class directory {directory} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})"
            )
        samples.extend(ImageSample(path=path, label=label) for path in images)
    return ImageFolder(classes=classes, samples=samples, ignored=ignored)


def pillow() -> ModuleType | None:
    """``PIL.Image`` if Pillow is installed, else None (imported lazily: it is optional)."""
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


def needs_pillow(path: Path) -> bool:
    """Whether decoding ``path`` needs Pillow (judged by its suffix: only PGM/PPM are decoded without it)."""
    return path.suffix.lower() not in NETPBM_SUFFIXES


def read_netpbm(path: Path) -> tuple[int, int, int, int, Sequence[int]]:
    """Decode a binary PGM (``P5``) or PPM (``P6``): ``(width, height, channels, maxval, values)`` with the
    values row-major and channel-interleaved (``channels`` is 1 or 3; 16-bit samples are big-endian on disk).
    Only the first image of a multi-image file is read. Raises :class:`ImageError` if it is not one."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ImageError(f"cannot read {path}: {error}") from error
    magic = data[:2]
    if magic not in (b"P5", b"P6"):
        raise ImageError(f"{path} is not a binary PGM/PPM (it does not start with P5 or P6)")
    fields: list[int] = []
    position = 2
    while len(fields) < 3:
        if position >= len(data) or data[position] not in _WHITESPACE:
            raise ImageError(f"{path}: malformed PGM/PPM header")
        while position < len(data) and (data[position] in _WHITESPACE or data[position] == ord("#")):
            if data[position] == ord("#"):  # a comment runs to the end of the line
                end = data.find(b"\n", position)
                position = len(data) if end < 0 else end
            position += 1
        start = position
        while position < len(data) and 48 <= data[position] <= 57:
            position += 1
        if start == position:
            raise ImageError(f"{path}: malformed PGM/PPM header")
        fields.append(int(data[start:position]))
    width, height, maxval = fields
    if position >= len(data) or data[position] not in _WHITESPACE:
        raise ImageError(f"{path}: malformed PGM/PPM header")
    position += 1  # exactly one whitespace character before the raster
    if width < 1 or height < 1 or not 1 <= maxval <= 65535:
        raise ImageError(f"{path}: bad PGM/PPM size {width}×{height} or maximum value {maxval}")
    channels = 3 if magic == b"P6" else 1
    sample_bytes = 1 if maxval < 256 else 2
    needed = width * height * channels * sample_bytes
    raster = data[position : position + needed]
    if len(raster) < needed:
        raise ImageError(f"{path} is truncated: {len(raster)} of {needed} raster bytes")
    if sample_bytes == 1:
        return width, height, channels, maxval, raster
    wide = array("H")
    wide.frombytes(raster)
    if sys.byteorder == "little":
        wide.byteswap()
    return width, height, channels, maxval, wide


def _coefficients(in_size: int, out_size: int) -> list[tuple[int, list[float]]]:
    """Per output index: the first input index and the normalised triangle-filter weights (Pillow's
    ``precompute_coeffs`` with support 1, widened by the downscaling factor so it antialiases)."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = filter_scale
    result = []
    for index in range(out_size):
        center = (index + 0.5) * scale
        low = max(int(center - support + 0.5), 0)
        high = min(int(center + support + 0.5), in_size)
        weights = [max(0.0, 1.0 - abs((j - center + 0.5) / filter_scale)) for j in range(low, high)]
        total = sum(weights)
        if total <= 0.0:  # cannot happen for a triangle over ≥ 1 pixel; keep the nearest pixel anyway
            low, weights, total = min(int(center), in_size - 1), [1.0], 1.0
        result.append((low, [weight / total for weight in weights]))
    return result


def resize_plane(plane: Sequence[float], width: int, height: int, size: int) -> list[float]:
    """Resample one row-major ``width × height`` plane to ``size × size`` (horizontal pass, then vertical)."""
    columns = _coefficients(width, size)
    rows = []
    for y in range(height):
        row = plane[y * width : (y + 1) * width]
        rows.append(
            [
                sum(
                    weight * value
                    for weight, value in zip(weights, row[low : low + len(weights)], strict=True)
                )
                for low, weights in columns
            ]
        )
    result: list[float] = []
    for low, weights in _coefficients(height, size):
        accumulated = [0.0] * size
        for weight, row in zip(weights, rows[low : low + len(weights)], strict=True):
            accumulated = [total + weight * value for total, value in zip(accumulated, row, strict=True)]
        result.extend(accumulated)
    return result


def _planes(values: Sequence[int], source_channels: int, channels: int) -> list[Sequence[float]]:
    """Channel-interleaved values → ``channels`` planes (colour → luma, or grey repeated)."""
    if source_channels == channels:
        return [values[c::channels] for c in range(channels)]
    if channels == 3:  # grey → RGB
        grey = values[0::1]
        return [grey, grey, grey]
    red, green, blue = values[0::3], values[1::3], values[2::3]
    return [[0.299 * r + 0.587 * g + 0.114 * b for r, g, b in zip(red, green, blue, strict=True)]]


def _normalised(planes: Sequence[Sequence[float]], maxval: int, out: array) -> None:
    factor = 1.0 / (maxval * STD)
    offset = MEAN / STD
    for plane in planes:
        out.extend(value * factor - offset for value in plane)


def load_image(path: Path, *, size: int, channels: int, image_module: ModuleType | None, out: array) -> None:
    """Append the image at ``path`` to the float array ``out`` as ``channels × size × size`` normalised values
    (see the module docstring). ``image_module`` is ``PIL.Image`` or None; raises :class:`ImageError`."""
    if not needs_pillow(path):
        width, height, source_channels, maxval, values = read_netpbm(path)
        planes = _planes(values, source_channels, channels)
        if (width, height) != (size, size):
            planes = [resize_plane(plane, width, height, size) for plane in planes]
        _normalised(planes, maxval, out)
        return
    if image_module is None:
        raise ImageError(
            f"decoding {path} needs Pillow (pip install pillow); without it only PGM/PPM are read"
        )
    from PIL import ImageOps

    try:
        with image_module.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB" if channels == 3 else "L")
            if image.size != (size, size):
                resampling = getattr(image_module, "Resampling", image_module)
                image = image.resize((size, size), resampling.BILINEAR)
            pixels = image.tobytes()
    except (OSError, ValueError, SyntaxError, image_module.DecompressionBombError) as error:
        raise ImageError(f"cannot decode {path}: {error}") from error
    _normalised(_planes(pixels, channels, channels), 255, out)
