"""Turn one dataset image item into an RGB PIL image, or a `BadImage` saying why not.

Items are what HF `datasets` yields for `datasets.Image(decode=False)` (`{"bytes", "path"}`), an
already-decoded PIL image, or a uint8 numpy array. Every failure becomes `BadImage(reason)` so the
loader can skip and count the sample instead of crashing the run (README, "Nothing lost").
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from PIL.JpegImagePlugin import JpegImageFile

# Transparent pixels become the ImageNet mean (uint8): after normalisation they are ~0, the least
# informative input, where black or white would be strong, class-correlated signals.
BACKGROUND_RGB = (124, 116, 104)

# PIL's own hard limit at its default settings (2 * Image.MAX_IMAGE_PIXELS).
DEFAULT_MAX_PIXELS = 178_956_970

_ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")


class BadImage(Exception):
    """An item that cannot be decoded; `reason` is short enough for one log line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def decode_image(
    item, target_size: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Image.Image:
    """Return an RGB PIL image (mode exactly 'RGB'), or raise BadImage with a short reason.

    `target_size` lets a JPEG decode at a reduced DCT scale whose shorter side is still
    >= target_size; other formats ignore it. Resizing to the final size is the transform's job.
    """
    return decode_with_size(item, target_size, max_pixels)[0]


def decode_with_size(
    item, target_size: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[Image.Image, tuple[int, int]]:
    """`decode_image`, and the stored size (width, height) of the image before any draft or rotation.

    PIL's DecompressionBombWarning is not raised (see `quiet_bomb_warnings`); the caller decides,
    from the size, what to say.
    """
    if target_size is not None and target_size < 1:
        raise ValueError(f"target_size must be >= 1, got {target_size}")
    fmt = "image"
    try:
        with quiet_bomb_warnings():
            img, owned = _open(item)
        fmt = img.format or fmt
        size = img.size
        # Checked on the header size, before any pixel is decoded; PIL's own check only warns
        # below 2 * MAX_IMAGE_PIXELS and honours whatever global limit someone else set.
        pixels = img.width * img.height
        if pixels > max_pixels:
            raise BadImage(f"decompression bomb ({pixels} pixels > max_pixels {max_pixels})")
        if owned and target_size and isinstance(img, JpegImageFile):  # MPO is a JpegImageFile
            # draft() picks the largest 1/2, 1/4, 1/8 scale with scale <= min(W // w, H // h), so
            # a square (t, t) request already makes the shorter side the binding one (whatever
            # the aspect ratio or EXIF rotation): the result's short side stays >= t.
            # Measured on 2 CPU cores, 4000x3000 q90 JPEG -> 500x375 for target 224: decode alone
            # 1.6x (3.1 MB, noisy) to 3.7x (0.3 MB, smooth) faster; decode + resize to 224 short
            # side 3.5x to 11x, because the transform no longer resizes 12 Mpx.
            img.draft("RGB", (target_size, target_size))
        # Force the decode here, inside the guard: Image.open is lazy, and without load() a
        # truncated file would only fail later in a transform (or, with LOAD_TRUNCATED_IMAGES,
        # be silently padded with grey).
        img.load()
        if owned:
            ImageOps.exif_transpose(img, in_place=True)
        else:
            img = ImageOps.exif_transpose(img)  # a copy: never mutate the caller's image
        return _to_rgb(img), size
    except BadImage:
        raise
    except Exception as exc:  # PIL plugins raise almost any type on malformed input
        raise BadImage(_reason(exc, fmt)) from exc


@contextlib.contextmanager
def quiet_bomb_warnings():
    """Silence PIL's DecompressionBombWarning (images between Image.MAX_IMAGE_PIXELS and twice that;
    PIL checks on open and again on crop): it prints once per file and process, where callers say
    once what matters. Images above our own `max_pixels` still fail as BadImage."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def describe(item) -> str:
    """A short identifier for log lines: the path if known, else a size or shape."""
    if isinstance(item, dict):
        if item.get("path"):
            return str(item["path"])
        data = item.get("bytes")
        return f"<bytes len={len(data)}>" if data is not None else "<empty item>"
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return f"<bytes len={len(item)}>"
    if isinstance(item, Image.Image):
        name = getattr(item, "filename", "")
        return name or f"<PIL {item.mode} {item.width}x{item.height}>"
    if isinstance(item, np.ndarray):
        return f"<array {item.dtype} {item.shape}>"
    return f"<{type(item).__name__}>"


def _open(item) -> tuple[Image.Image, bool]:
    """The (possibly still lazy) image, and whether we own it (may draft / mutate it)."""
    if isinstance(item, Image.Image):
        return item, False
    if isinstance(item, np.ndarray):
        return _from_array(item), True
    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
    elif isinstance(item, (bytes, bytearray, memoryview)):
        data, path = item, None
    elif isinstance(item, (str, os.PathLike)):
        data, path = None, item
    else:
        raise BadImage(f"unsupported item type {type(item).__name__}")
    # Hub datasets carry both; their `path` is only the original file name, so bytes win.
    if data is None:
        if not path:
            raise BadImage("item has neither bytes nor path")
        data = read_file(path)
    if len(data) == 0:
        raise BadImage("zero-byte file")
    # Always decode from memory: Image.open(path) keeps multi-frame files (GIF, TIFF, MPO) open
    # after load(), which exhausts file descriptors in long-lived loader workers.
    return Image.open(io.BytesIO(data)), True


def read_file(path) -> bytes:
    """The bytes of an image file, or BadImage saying why they cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise BadImage("missing file") from None
    except OSError as exc:
        raise BadImage(f"unreadable file ({exc.strerror or exc})") from exc


def _from_array(a: np.ndarray) -> Image.Image:
    if a.dtype != np.uint8 or a.size == 0 or a.ndim not in (2, 3):
        raise BadImage(f"unsupported array {a.dtype} {a.shape}")
    if a.ndim == 3:
        if a.shape[2] == 1:
            a = a[:, :, 0]
        elif a.shape[2] not in (2, 3, 4):  # L+A, RGB, RGBA
            raise BadImage(f"unsupported array {a.dtype} {a.shape}")
    return Image.fromarray(np.ascontiguousarray(a))


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode.startswith("I;16"):
        # 65535 / 257 == 255 exactly; convert("RGB") would clip everything above 255 to white.
        gray = (np.asarray(img).astype(np.uint32) + 128) // 257
        return Image.fromarray(gray.astype(np.uint8)).convert("RGB")
    if img.mode in ("I", "F"):
        return Image.fromarray(_stretch(np.asarray(img))).convert("RGB")
    if img.mode == "La":
        img = img.convert("LA")  # PIL has no direct La -> RGBA conversion
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")  # also unpremultiplies RGBa and applies tRNS / palette alpha
        out = Image.new("RGB", img.size, BACKGROUND_RGB)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img if img.mode == "RGB" else img.convert("RGB")


def _stretch(a: np.ndarray) -> np.ndarray:
    """32-bit int / float pixels have no fixed range, so map the image's own min..max to 0..255."""
    a = a.astype(np.float64)
    finite = np.isfinite(a)
    if not finite.any():
        return np.zeros(a.shape, np.uint8)
    lo, hi = a[finite].min(), a[finite].max()
    a = np.where(finite, a, lo)
    if hi == lo:  # constant image: nothing to stretch, keep its value where it is representable
        return np.full(a.shape, np.clip(np.round(lo), 0, 255), np.uint8)
    return np.round((a - lo) * (255.0 / (hi - lo))).astype(np.uint8)


def _reason(exc: Exception, fmt: str) -> str:
    msg = str(exc)
    if isinstance(exc, UnidentifiedImageError):
        return "not an image"
    if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        pixels = re.search(r"\d+", msg)  # PIL: "Image size (N pixels) exceeds limit of ..."
        return f"decompression bomb ({pixels.group() if pixels else '?'} pixels > PIL's limit)"
    if isinstance(exc, EOFError) or "truncated" in msg.lower():
        return f"truncated {fmt}"
    if len(msg) > 120:
        msg = msg[:117] + "..."
    return f"corrupt {fmt} ({type(exc).__name__}: {msg})"
