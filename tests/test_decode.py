"""data/decode.py: every mode comes out RGB uint8, JPEG draft keeps the short side, bad input raises."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from helpers import encode
from vramfit.data.decode import BACKGROUND_RGB, BadImage, decode_image, describe


def as_item(data: bytes) -> dict:
    return {"bytes": data, "path": None}


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def assert_rgb(img: Image.Image, size: tuple[int, int]) -> np.ndarray:
    assert img.mode == "RGB"
    assert img.size == size
    a = np.asarray(img)
    assert a.dtype == np.uint8 and a.shape == (size[1], size[0], 3)
    return a


# --- modes ------------------------------------------------------------------------------------

ALL_MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr",
             "LAB", "HSV", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_mode_in_memory_becomes_rgb(mode):
    if mode in ("La", "RGBa"):  # PIL can only create these from their straight-alpha twins
        src = Image.fromarray(noise(5, 7)).convert(mode[:-1] + "A").convert(mode)
    else:
        src = Image.fromarray(noise(5, 7)).convert("L").convert(mode)
    assert_rgb(decode_image(src), (7, 5))


@pytest.mark.parametrize("mode,fmt", [
    ("1", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("RGB", "PNG"), ("RGBA", "PNG"),
    ("I;16", "PNG"), ("L", "JPEG"), ("RGB", "JPEG"), ("CMYK", "JPEG"), ("CMYK", "TIFF"),
    ("YCbCr", "TIFF"), ("LAB", "TIFF"), ("I", "TIFF"), ("F", "TIFF"), ("RGB", "WEBP"),
    ("P", "GIF"), ("RGB", "BMP"),
])
def test_encoded_modes_become_rgb(mode, fmt):
    src = Image.fromarray(noise(5, 7)).convert(mode)
    data = encode(src, fmt)
    assert Image.open(io.BytesIO(data)).mode == mode  # the file really holds that mode
    assert_rgb(decode_image(as_item(data)), (7, 5))


@pytest.mark.parametrize("mode", ["RGBA", "RGBa", "LA", "La", "PA"])
def test_transparent_pixels_become_background(mode):
    src = Image.new("RGBA", (4, 3), (250, 10, 10, 0)).convert(mode) if mode != "La" else \
        Image.new("La", (4, 3), (0, 0))
    a = assert_rgb(decode_image(src), (4, 3))
    assert (a == BACKGROUND_RGB).all()


def test_half_alpha_blends_with_background():
    a = np.asarray(decode_image(Image.new("RGBA", (2, 2), (255, 255, 255, 128))))
    expected = np.round(np.array(BACKGROUND_RGB) + (255 - np.array(BACKGROUND_RGB)) * 128 / 255)
    assert np.abs(a[0, 0].astype(int) - expected).max() <= 1


def test_palette_transparency_index_becomes_background():
    p = Image.new("P", (4, 2), 0)
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    p.paste(1, (2, 0, 4, 2))  # right half: palette index 1 (green)
    p.info["transparency"] = 0  # left half (red) is transparent
    for src in (p, *(Image.open(io.BytesIO(encode(p, fmt))) for fmt in ("PNG", "GIF"))):
        a = np.asarray(decode_image(src))
        assert tuple(a[0, 0]) == BACKGROUND_RGB
        assert tuple(a[0, 3]) == (0, 255, 0)


def test_rgb_pixels_pass_through_unchanged():
    a = noise(6, 9)
    assert (np.asarray(decode_image(as_item(encode(Image.fromarray(a), "PNG")))) == a).all()


@pytest.mark.parametrize("mode", ["I;16", "I;16B"])
def test_16bit_gradient_is_scaled_not_saturated(mode):
    ramp = (np.arange(256, dtype=np.uint16) * 257)[None].repeat(3, 0)  # 0 .. 65535
    raw = ramp.astype(">u2" if mode == "I;16B" else "<u2").tobytes()
    src = Image.frombytes(mode, (256, 3), raw)
    png = encode(Image.frombytes("I;16", (256, 3), ramp.astype("<u2").tobytes()), "PNG")
    for img in (src, Image.open(io.BytesIO(png))):
        g = assert_rgb(decode_image(img), (256, 3))[0, :, 0]
        assert (g == np.arange(256)).all()


@pytest.mark.parametrize("mode,lo,hi", [("I", -70_000, 250_000), ("F", -1.0, 3.0)])
def test_wide_range_modes_are_stretched_to_their_own_range(mode, lo, hi):
    ramp = np.linspace(lo, hi, 100)[None].repeat(2, 0)
    src = Image.fromarray(ramp.astype(np.int32 if mode == "I" else np.float32))
    assert src.mode == mode
    g = assert_rgb(decode_image(src), (100, 2))[0, :, 0]
    assert g[0] == 0 and g[-1] == 255 and (np.diff(g.astype(int)) >= 0).all()


def test_constant_and_nonfinite_float_images_do_not_crash():
    assert (np.asarray(decode_image(Image.new("F", (3, 3), 7.0))) == 7).all()
    a = np.array([[0.0, np.nan], [np.inf, 1.0]], np.float32)
    out = np.asarray(decode_image(Image.fromarray(a)))[..., 0]
    assert out[0, 0] == 0 and out[1, 1] == 255
    assert_rgb(decode_image(Image.fromarray(np.full((2, 2), np.nan, np.float32))), (2, 2))


# --- JPEG draft, EXIF ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_jpegs():
    # Flat colour keeps 12 Mpx encodes fast; draft depends only on the header size.
    return {size: encode(Image.new("RGB", size, (200, 120, 40)), "JPEG") for size in
            [(4000, 3000), (3000, 4000)]}


@pytest.mark.parametrize("size", [(4000, 3000), (3000, 4000)])
@pytest.mark.parametrize("target", [224, 375, 376, 1000])
def test_jpeg_draft_keeps_short_side_at_least_target(big_jpegs, size, target):
    img = decode_image(as_item(big_jpegs[size]), target_size=target)
    assert img.mode == "RGB"
    assert target <= min(img.size) <= 3000 // 2  # reduced, but never below the target
    assert img.size[0] < img.size[1] if size[0] < size[1] else img.size[0] > img.size[1]


def test_jpeg_draft_scale_and_no_draft_without_target(big_jpegs):
    assert decode_image(as_item(big_jpegs[(4000, 3000)]), target_size=224).size == (500, 375)
    assert decode_image(as_item(big_jpegs[(4000, 3000)])).size == (4000, 3000)


def test_png_ignores_target_size():
    png = encode(Image.new("RGB", (900, 600)), "PNG")
    assert decode_image(as_item(png), target_size=224).size == (900, 600)


def test_mpo_phone_photo_is_drafted_too():
    im = Image.new("RGB", (2000, 1000), (1, 2, 3))
    data = encode(im, "MPO", save_all=True, append_images=[im])
    assert decode_image(as_item(data), target_size=224).size == (500, 250)


def test_exif_orientation_6_rotates():
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :20] = (255, 0, 0)  # stored left half red, right half blue
    a[:, 20:] = (0, 0, 255)
    src = Image.fromarray(a)
    exif = src.getexif()
    exif[0x0112] = 6  # display = stored rotated 90 degrees clockwise
    data = encode(src, "JPEG", exif=exif.tobytes(), quality=95)
    for target in (None, 8):
        out = decode_image(as_item(data), target_size=target)
        w, h = out.size
        assert h > w
        top, bottom = np.asarray(out)[1, w // 2], np.asarray(out)[-2, w // 2]
        assert top[0] > 200 and top[2] < 60  # the red half is now on top
        assert bottom[2] > 200 and bottom[0] < 60


# --- item kinds ----------------------------------------------------------------------------------

def test_path_only_bytes_only_and_both(tmp_path):
    a = noise(8, 5)
    data = encode(Image.fromarray(a), "PNG")
    f = tmp_path / "x.png"
    f.write_bytes(data)
    for item in ({"bytes": None, "path": str(f)}, {"bytes": data, "path": None},
                 {"bytes": data, "path": "name/only/on/the/hub.png"}, str(f), f, data):
        assert (np.asarray(decode_image(item)) == a).all()


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 1), (6, 4, 2), (6, 4, 3), (6, 4, 4)])
def test_numpy_arrays(shape):
    a = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    out = assert_rgb(decode_image(a), (4, 6))
    if shape[-1] == 3:
        assert (out == a).all()


def test_numpy_rgba_alpha_zero_and_non_contiguous():
    a = np.zeros((3, 4, 4), np.uint8)
    assert (np.asarray(decode_image(a)) == BACKGROUND_RGB).all()
    b = noise(6, 8)[:, ::2]
    assert (np.asarray(decode_image(b)) == b).all()


def test_pil_input_passes_through_and_is_not_mutated():
    a = noise(4, 5)
    assert (np.asarray(decode_image(Image.fromarray(a))) == a).all()
    lazy = Image.open(io.BytesIO(encode(Image.new("RGB", (1600, 1200)), "JPEG")))
    assert decode_image(lazy, target_size=224).size == (1600, 1200)
    assert lazy.size == (1600, 1200)


@pytest.mark.parametrize("size", [(1, 1), (1, 50), (50, 1)])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_tiny_and_extreme_aspect(size, fmt):
    assert_rgb(decode_image(as_item(encode(Image.new("RGB", size, (9, 9, 9)), fmt)), 224), size)


# --- bad input -----------------------------------------------------------------------------------

def bad(item, **kw) -> str:
    with pytest.raises(BadImage) as e:
        decode_image(item, **kw)
    assert e.value.reason == str(e.value)
    return e.value.reason


def test_zero_bytes(tmp_path):
    assert "zero-byte" in bad(as_item(b""))
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert "zero-byte" in bad({"bytes": None, "path": str(tmp_path / "empty.jpg")})


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_is_rejected_not_padded(fmt):
    data = encode(Image.fromarray(noise(64, 64)), fmt)
    assert bad(as_item(data[: len(data) // 2])) == f"truncated {fmt}"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_truncated_jpeg_missing_only_end_marker():
    data = encode(Image.fromarray(noise(64, 64)), "JPEG")
    assert bad(as_item(data[:-2])) == "truncated JPEG"


def test_corrupt_data_stream():
    data = bytearray(encode(Image.fromarray(noise(64, 64)), "PNG"))
    data[60] ^= 0xFF  # inside the first IDAT chunk
    assert bad(as_item(bytes(data))).startswith("corrupt PNG")


def test_not_an_image(tmp_path):
    assert bad(as_item(np.random.default_rng(0).bytes(4096))) == "not an image"
    (tmp_path / "notes.jpg").write_text("this is not a JPEG\n")
    assert bad({"bytes": None, "path": str(tmp_path / "notes.jpg")}) == "not an image"


def test_missing_and_unreadable_paths(tmp_path):
    assert bad({"bytes": None, "path": str(tmp_path / "gone.jpg")}) == "missing file"
    assert bad({"bytes": None, "path": str(tmp_path)}).startswith("unreadable file")
    assert "neither" in bad({"bytes": None, "path": None})


def png_claiming(width: int, height: int) -> bytes:
    """A real 1x1 mode-1 PNG whose IHDR (with a valid CRC) claims width x height."""
    data = bytearray(encode(Image.new("1", (1, 1)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)  # after signature(8) + length(4) + b"IHDR"
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_decompression_bomb_by_header():
    before = Image.MAX_IMAGE_PIXELS
    # Beyond PIL's own hard limit: PIL refuses in open(); still a BadImage.
    assert bad(as_item(png_claiming(20_000, 20_000))).startswith("decompression bomb (400000000")
    # Within PIL's limit but beyond ours: refused from the header, nothing decoded.
    reason = bad(as_item(png_claiming(5_000, 5_000)), max_pixels=1_000_000)
    assert reason == "decompression bomb (25000000 pixels > max_pixels 1000000)"
    real = encode(Image.new("1", (2000, 1000)), "PNG")
    assert bad(as_item(real), max_pixels=1_999_999).startswith("decompression bomb (2000000")
    assert decode_image(as_item(real), max_pixels=2_000_000).size == (2000, 1000)
    assert Image.MAX_IMAGE_PIXELS == before


def test_unsupported_items():
    assert "unsupported array" in bad(np.zeros((4, 4), np.float32))
    assert "unsupported array" in bad(np.zeros((4, 4, 5), np.uint8))
    assert "unsupported array" in bad(np.zeros((0, 4), np.uint8))
    assert "unsupported item type int" == bad(42)
    with pytest.raises(ValueError):
        decode_image(np.zeros((4, 4), np.uint8), target_size=0)


# --- describe ------------------------------------------------------------------------------------

def test_describe():
    assert describe({"bytes": b"abc", "path": "cats/1.jpg"}) == "cats/1.jpg"
    assert describe({"bytes": b"abc", "path": None}) == "<bytes len=3>"
    assert describe({"bytes": None, "path": None}) == "<empty item>"
    assert describe(Image.new("L", (3, 2))) == "<PIL L 3x2>"
    assert describe(np.zeros((2, 3), np.uint8)) == "<array uint8 (2, 3)>"
    assert describe(b"12") == "<bytes len=2>"
