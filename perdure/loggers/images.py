"""Images for the loggers: any common tensor layout to an HWC uint8 array, and a PNG encoder without PIL."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np

from perdure.errors import PerdureError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = (1, 3, 4)
_COLOR_TYPES = {1: 0, 3: 2, 4: 6}  # channels -> PNG colour type: grey, RGB, RGBA


class ImageFormatError(PerdureError, ValueError):
    """An image passed to `log_image` has a shape or dtype perdure cannot turn into a picture."""


def to_image_array(image: Any) -> np.ndarray:
    """Return `image` as a contiguous HWC `uint8` array with C in (1, 3, 4).

    Accepts a `torch.Tensor` or a `numpy.ndarray` shaped HW, HWC or CHW (a leading batch axis of size 1 is dropped).
    When both the first and the last axis could be channels (e.g. 3x8x3), a torch tensor is read as CHW (torch's
    convention) and a numpy array as HWC. Floats are taken to lie in [0, 1] (clipped, NaN -> 0); bool maps to 0 / 255;
    other integer types must already lie in [0, 255].
    """
    array = _as_numpy(image)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 2:
        array = array[:, :, None]
    elif array.ndim == 3:
        last, first = array.shape[2] in _CHANNELS, array.shape[0] in _CHANNELS
        channels_first = first and (not last or _is_tensor(image))
        if channels_first:
            array = array.transpose(1, 2, 0)
        elif not last:
            shape = tuple(array.shape)
            raise ImageFormatError(f"image of shape {shape}: neither axis 0 nor axis 2 holds 1, 3 or 4 channels")
    else:
        raise ImageFormatError(f"image of shape {tuple(array.shape)}: expected HW, HWC or CHW")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageFormatError(f"image of shape {tuple(array.shape)} is empty")
    return np.ascontiguousarray(_to_uint8(array))


def _is_tensor(image: Any) -> bool:
    return type(image).__module__.startswith("torch")


def _as_numpy(image: Any) -> np.ndarray:
    if _is_tensor(image):
        image = image.detach().cpu()
        if image.is_floating_point():
            image = image.float()  # bf16 / fp16 have no numpy dtype worth keeping
        return image.numpy()
    if isinstance(image, np.ndarray):
        return image
    raise ImageFormatError(f"log_image takes a torch.Tensor or a numpy.ndarray, got {type(image).__name__}")


def _to_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        scaled = np.nan_to_num(array.astype(np.float64), nan=0.0, posinf=1.0, neginf=0.0)
        return np.rint(np.clip(scaled, 0.0, 1.0) * 255.0).astype(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        if array.size and (array.min() < 0 or array.max() > 255):
            low, high = array.min(), array.max()
            raise ImageFormatError(f"integer image with values in [{low}, {high}]: use uint8 or floats in [0, 1]")
        return array.astype(np.uint8)
    raise ImageFormatError(f"image of dtype {array.dtype}: use uint8, bool or a float dtype")


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an HWC `uint8` array (C = 1 grey, 3 RGB, 4 RGBA), 8 bits per sample, no filtering."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in _COLOR_TYPES:
        raise ImageFormatError(f"encode_png takes an HWC uint8 array with C in (1, 3, 4), got {image.shape}")
    height, width, channels = image.shape
    rows = np.ascontiguousarray(image).reshape(height, width * channels)
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rows], axis=1).tobytes()  # filter byte 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPES[channels], 0, 0, 0)
    return b"".join(
        (PNG_SIGNATURE, _chunk(b"IHDR", header), _chunk(b"IDAT", zlib.compress(raw, 6)), _chunk(b"IEND", b""))
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
