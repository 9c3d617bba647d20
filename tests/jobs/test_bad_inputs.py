"""The bad-input zoo through the whole caching path: every odd file is cached correctly or skipped with one
log line naming it and the reason; the run ends with counts, and nothing is written into the data folder."""

from __future__ import annotations

import io
import re

import numpy as np
from conftest import process_data_dir
from image_files import png_header_only
from PIL import Image

from sdxl_trainer.cache.reader import load_manifest


def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
    array = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(array, "RGB").convert(mode)


def encoded(image: Image.Image, format: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **kwargs)
    return buffer.getvalue()


def build_zoo(folder) -> dict[str, str]:
    """Writes the zoo; returns file name -> what must happen ('cached' or the skip reason's key)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways
    sixteen = Image.fromarray((np.random.default_rng(1).integers(0, 65535, (300, 280))).astype(np.uint16))
    animated = [noise(300, 300, "P"), noise(300, 300, "P").rotate(90)]
    files = {
        "good.png": (encoded(noise(300, 300), "PNG"), "a good picture", "cached"),
        "cmyk.jpg": (encoded(noise(300, 300, "CMYK"), "JPEG"), "cmyk", "cached"),
        "sixteen_bit.png": (encoded(sixteen, "PNG"), "16-bit", "cached"),
        "palette.png": (encoded(noise(300, 300, "P"), "PNG"), "palette", "cached"),
        "gray.png": (encoded(noise(300, 300, "L"), "PNG"), "gray", "cached"),
        "animated.gif": (encoded(animated[0], "GIF", save_all=True, append_images=animated[1:]), "animated", "cached"),
        "rotated.jpg": (encoded(noise(400, 300), "JPEG", exif=exif), "rotated", "cached"),
        "jpeg_named.png": (encoded(noise(300, 300), "JPEG"), "wrong extension", "cached"),
        "empty.png": (b"", "zero bytes", "unreadable image"),
        "truncated.jpg": (encoded(noise(300, 300), "JPEG")[:2000], "truncated", "unreadable image"),
        "text.png": (b"this is a text file", "not an image", "unreadable image"),
        "bomb.png": (png_header_only(30000, 30000), "decompression bomb", "unreadable image"),
        "no_caption.png": (encoded(noise(300, 300), "PNG"), None, "missing caption"),
        "empty_caption.png": (encoded(noise(300, 300), "PNG"), " \n ", "empty caption"),
        "latin1_caption.png": (encoded(noise(300, 300), "PNG"), "caf\xe9".encode("latin-1"), "caption not UTF-8"),
    }
    folder.mkdir()
    for name, (data, caption, _) in files.items():
        (folder / name).write_bytes(data)
        if caption is not None:
            caption_path = (folder / name).with_suffix(".txt")
            caption_path.write_bytes(caption if isinstance(caption, bytes) else caption.encode())
    return {name: outcome for name, (_, _, outcome) in files.items()}


def snapshot(folder) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns) for path in sorted(folder.rglob("*"))}


def test_bad_input_zoo(tmp_path, tiny_pipeline_dir, capsys):
    data_dir, cache_dir = tmp_path / "data", tmp_path / "cache"
    expected = build_zoo(data_dir)
    before = snapshot(data_dir)
    code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         "--min_resolution", "256", "--max_resolution", "256"]
    )
    assert code == 0
    assert snapshot(data_dir) == before  # nothing written, nothing touched in the dataset

    rows = {row["image_path"]: row for row in load_manifest(cache_dir).to_pylist()}
    assert set(rows) == {name for name, outcome in expected.items() if outcome == "cached"}
    assert (rows["rotated.jpg"]["original_width"], rows["rotated.jpg"]["original_height"]) == (300, 400)  # upright
    assert (rows["sixteen_bit.png"]["original_width"], rows["sixteen_bit.png"]["original_height"]) == (280, 300)

    (log_path,) = (cache_dir / "logs").iterdir()
    lines = log_path.read_text().splitlines()
    skipped = {name: outcome for name, outcome in expected.items() if outcome != "cached"}
    assert sorted(line.split(":")[0] for line in lines) == sorted(skipped)  # one line per skipped file
    by_file = {line.split(":")[0]: line for line in lines}
    assert "0 bytes" in by_file["empty.png"]
    assert "truncated" in by_file["truncated.jpg"]
    assert "not an image in a format Pillow can read" in by_file["text.png"]
    assert "900000000 pixels" in by_file["bomb.png"] and "decompression bomb" in by_file["bomb.png"]
    assert "no caption file no_caption.txt" in by_file["no_caption.png"]
    assert "is empty" in by_file["empty_caption.png"]
    assert "not UTF-8" in by_file["latin1_caption.png"]

    out = capsys.readouterr().out
    assert re.search(r"cached: 8, upscaled: 0\.", out)
    assert "skipped 7 (caption not UTF-8: 1, empty caption: 1, missing caption: 1, unreadable image: 4)" in out
