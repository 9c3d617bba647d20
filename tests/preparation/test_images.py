"""Reading source images (images.py) and finding + preparing image/caption pairs (sources.py).

All images are made in memory with PIL; files go to pytest's tmp_path.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import unprivileged
from image_files import png_header_only
from PIL import Image

from sdxl_trainer.cache.buckets import Bucket, crop_into, micro_conditioning, plan_crop
from sdxl_trainer.cache.format import sha256_bytes
from sdxl_trainer.preparation import images
from sdxl_trainer.preparation.folders import scan_images
from sdxl_trainer.preparation.images import UnreadableImage, decode_image, resize_and_crop, to_model_input, to_pil
from sdxl_trainer.preparation.items import SkippedItem, prepare_item, read_caption, read_source
from sdxl_trainer.preparation.scan import DataScan, SourcePair, worker_of

# --- helpers ----------------------------------------------------------------------------------------------


def encode(image: Image.Image, format: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **kwargs)
    return buffer.getvalue()



def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(int)



def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")



def write_pair(folder: Path, name: str, image: Image.Image | None = None, caption: str | bytes | None = "a caption") -> SourcePair:
    """Write NAME.png (and NAME.txt unless caption is None); returns its SourcePair relative to folder."""
    image_path = folder / f"{name}.png"
    image_path.parent.mkdir(parents=True, exist_ok=True)
    (image or noise_image(8, 8)).save(image_path)
    if caption is not None:
        caption_path = image_path.with_suffix(".txt")
        if isinstance(caption, bytes):
            caption_path.write_bytes(caption)
        else:
            caption_path.write_text(caption, encoding="utf-8")
    return SourcePair(image_path, f"{name}.png")



def test_rgba_transparency_becomes_white_and_opaque_colours_stay():
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque
    rgba[0, 1] = (10, 20, 30, 0)  # fully transparent
    rgba[0, 2] = (0, 0, 0, 128)  # half-transparent black
    result = decode_image(encode(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert result.mode == "RGB" and result.size == (3, 2)
    out = pixels(result)
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert tuple(out[0, 1]) == (255, 255, 255)
    assert tuple(out[1, 0]) == (255, 255, 255)  # zeros everywhere else: transparent
    assert all(126 <= value <= 128 for value in out[0, 2])  # black at ~50% over white



def test_palette_png_with_transparent_index_becomes_white():
    palette_image = Image.new("P", (4, 4), 0)
    palette_image.putpalette([255, 0, 0, 0, 0, 255] + [0] * (256 * 3 - 6))
    palette_image.putpixel((0, 0), 1)  # one blue pixel, the rest index 0 (transparent red)
    result = decode_image(encode(palette_image, "PNG", transparency=0))
    assert result.mode == "RGB"
    assert result.getpixel((0, 0)) == (0, 0, 255)
    assert result.getpixel((2, 3)) == (255, 255, 255)



def test_la_grayscale_with_alpha_becomes_white_where_transparent():
    la = Image.fromarray(np.array([[[0, 0], [100, 255]]], dtype=np.uint8), "LA")
    result = decode_image(encode(la, "PNG"))
    assert pixels(result).tolist() == [[[255, 255, 255], [100, 100, 100]]]



def test_grayscale_becomes_rgb_with_equal_channels():
    gray = Image.fromarray(np.array([[0, 100, 255]], dtype=np.uint8), "L")
    result = decode_image(encode(gray, "PNG"))
    assert result.mode == "RGB"
    assert pixels(result).tolist() == [[[0, 0, 0], [100, 100, 100], [255, 255, 255]]]



def test_16_bit_grayscale_is_scaled_to_8_bits():
    sixteen = Image.fromarray(np.array([[65535, 32768, 0, 257]], dtype=np.uint16))
    assert sixteen.mode == "I;16"
    result = decode_image(encode(sixteen, "PNG"))
    # v / 65535 * 255, rounded: 255, 128 (127.5 + 0.5), 0, 1
    assert result.mode == "RGB"
    assert pixels(result)[0, :, 0].tolist() == [255, 128, 0, 1]
    assert (pixels(result)[..., 0] == pixels(result)[..., 2]).all()



def test_dark_16_bit_image_stays_dark():
    dark = Image.fromarray(np.array([[0, 255]], dtype=np.uint16))  # 255 / 65535 = 0.4% grey
    slightly_brighter = Image.fromarray(np.array([[0, 256]], dtype=np.uint16))
    assert pixels(decode_image(encode(slightly_brighter, "PNG")))[0, 1, 0] == 1
    assert pixels(decode_image(encode(dark, "PNG")))[0, 1, 0] == 1  # today: 255 (white)



def test_cmyk_jpeg_becomes_rgb():
    cyan = decode_image(encode(Image.new("CMYK", (16, 16), (255, 0, 0, 0)), "JPEG"))
    paper = decode_image(encode(Image.new("CMYK", (16, 16), (0, 0, 0, 0)), "JPEG"))
    assert cyan.mode == "RGB" and paper.mode == "RGB"
    r, g, b = cyan.getpixel((8, 8))
    assert r <= 5 and g >= 250 and b >= 250
    assert all(v >= 250 for v in paper.getpixel((8, 8)))



def test_exif_orientation_is_applied():
    stored = Image.new("RGB", (60, 40), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 30, 40))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    result = decode_image(encode(stored, "JPEG", exif=exif, quality=95))
    assert result.size == (40, 60)  # upright: taller than wide
    # Rotating clockwise moves the left (red) half to the top.
    top_r, _, top_b = result.getpixel((20, 10))
    bottom_r, _, bottom_b = result.getpixel((20, 50))
    assert top_r > 240 and top_b < 15
    assert bottom_b > 240 and bottom_r < 15



def test_jpeg_without_exif_keeps_its_size():
    assert decode_image(encode(Image.new("RGB", (60, 40), (9, 9, 9)), "JPEG")).size == (60, 40)



def test_animated_gif_uses_first_frame():
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    result = decode_image(data)
    assert result.mode == "RGB" and result.getpixel((4, 4)) == (255, 0, 0)



def test_webp_lossless_round_trips():
    image = noise_image(16, 12)
    assert np.array_equal(pixels(decode_image(encode(image, "WEBP", lossless=True))), pixels(image))



@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="zero-bytes"),
        pytest.param(b"this is not an image at all", id="text"),
        pytest.param(encode(noise_image(64, 64), "JPEG")[:700], id="truncated-jpeg"),
    ],
)
def test_unreadable_bytes_raise_with_a_message(data):
    with pytest.raises(UnreadableImage, match="not a readable image|not an image in a format Pillow can read"):
        decode_image(data)



def test_truncated_jpeg_message_says_truncated():
    data = encode(noise_image(64, 64), "JPEG")
    with pytest.raises(UnreadableImage, match="truncated"):
        decode_image(data[: len(data) // 2])



def test_header_above_pixel_limit_is_refused():
    # 20000 x 20000 = 4e8 px > 16384^2: refused from the header alone, before any pixel is decoded.
    with pytest.raises(UnreadableImage, match=r"400000000 pixels|20000x20000"):
        decode_image(png_header_only(20000, 20000))
    with pytest.raises(UnreadableImage):
        decode_image(png_header_only(40000, 40000))  # beyond Pillow's own hard limit too



def test_module_pixel_limit_is_used(monkeypatch):
    data = encode(noise_image(20, 20), "PNG")
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 400)
    assert decode_image(data).size == (20, 20)  # exactly at the limit: fine
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(UnreadableImage, match=r"20x20 px is above the 100 px limit"):
        decode_image(data)



@pytest.mark.parametrize("size", [(1536, 1024), (1024, 1536), (700, 700), (1001, 517)])
def test_resize_and_crop_gives_the_bucket_size(size):
    plan = plan_crop(*size, 256, 1024)
    result = resize_and_crop(noise_image(*size), plan)
    assert result.size == (plan.bucket.width, plan.bucket.height)



def test_resize_and_crop_takes_the_centre():
    # 12x4 image in three 4-px vertical stripes; bucket 4x4 needs no resize, so the crop is the middle stripe.
    image = Image.new("RGB", (12, 4), (255, 0, 0))
    image.paste((0, 255, 0), (4, 0, 8, 4))
    image.paste((0, 0, 255), (8, 0, 12, 4))
    plan = crop_into(12, 4, Bucket(4, 4), 256)
    assert (plan.resized_width, plan.crop_left) == (12, 4)
    result = resize_and_crop(image, plan)
    assert {result.getpixel((x, y)) for x in range(4) for y in range(4)} == {(0, 255, 0)}



def test_to_model_input_range_and_exact_values():
    array = np.zeros((2, 3, 3), dtype=np.uint8)
    array[0, 1] = 255  # one white pixel
    array[1, 2] = (255, 0, 128)
    tensor = to_model_input(Image.fromarray(array, "RGB"))
    assert tensor.shape == (3, 2, 3) and tensor.dtype == torch.float32
    assert tensor.min() >= -1 and tensor.max() <= 1
    assert tensor[:, 0, 0].tolist() == [-1.0, -1.0, -1.0]  # black
    assert tensor[:, 0, 1].tolist() == [1.0, 1.0, 1.0]  # white
    assert tensor[0, 1, 2].item() == 1.0 and tensor[1, 1, 2].item() == -1.0
    assert tensor[2, 1, 2].item() == pytest.approx(128 / 127.5 - 1, abs=1e-6)



def test_to_pil_round_trips_every_uint8_value():
    values = np.arange(256, dtype=np.uint8)
    array = np.stack([values.reshape(16, 16), values[::-1].reshape(16, 16), np.roll(values, 7).reshape(16, 16)], axis=-1)
    image = Image.fromarray(array, "RGB")
    (back,) = to_pil(to_model_input(image).unsqueeze(0))
    assert back.mode == "RGB"
    assert np.array_equal(np.asarray(back), array)



def test_to_pil_clamps_out_of_range():
    (image,) = to_pil(torch.tensor([[[[-3.0, 3.0]]] * 3]))
    assert pixels(image).tolist() == [[[0, 0, 0], [255, 255, 255]]]



def test_scan_images_recursive_skips_hidden_and_non_images(tmp_path):
    for relative in ["b.png", "a.jpg", "nested/deeper/c.webp", "nested/D.JPEG", ".hidden/e.png", "nested/.cache/f.png", ".g.png"]:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not decoded by scan_images")
    for relative in ["a.txt", "notes.md", "nested/readme.txt"]:
        (tmp_path / relative).write_text("x")
    (tmp_path / "folder.png").mkdir()  # a folder named like an image is not an image

    scan = scan_images(tmp_path)
    assert [pair.relative_path for pair in scan.pairs] == ["a.jpg", "b.png", "nested/D.JPEG", "nested/deeper/c.webp"]
    assert scan.pairs[0].image_path == tmp_path / "a.jpg" and scan.pairs[0].caption_path == tmp_path / "a.txt"
    assert [(problem.relative_path, problem.category) for problem in scan.problems] == [("folder.png", "not a file")]



def test_scan_images_empty_folder(tmp_path):
    assert scan_images(tmp_path) == DataScan([], [])



def test_scan_names_and_counts_what_looks_like_data_but_cannot_be_used(public_tmp_path):
    tmp_path = public_tmp_path
    (tmp_path / "good.png").write_bytes(b"x")
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    (tmp_path / "loop.jpg").symlink_to(tmp_path / "loop.jpg")
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "album.jpg").mkdir()
    (tmp_path / "album.jpg" / "inside.png").write_bytes(b"x")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "hidden_from_us.png").write_bytes(b"x")
    locked.chmod(0)
    try:
        with unprivileged():
            scan = scan_images(tmp_path)
    finally:
        locked.chmod(0o755)
    found = {problem.relative_path: problem for problem in scan.problems}
    assert [pair.relative_path for pair in scan.pairs] == ["album.jpg/inside.png", "good.png"]
    assert found["dangling.png"].category == "broken symlink" and "No such file or directory" in found["dangling.png"].reason
    assert found["loop.jpg"].category == "broken symlink" and "symbolic links" in found["loop.jpg"].reason
    assert found["pipe.png"].category == "not a file" and "FIFO" in found["pipe.png"].reason
    assert found["album.jpg"].category == "not a file"
    assert found["locked"].category == "unreadable folder" and "Permission denied" in found["locked"].reason



def test_captions_match_in_any_case_and_images_sharing_a_name_are_reported(tmp_path):
    (tmp_path / "x.JPG").write_bytes(b"x")
    (tmp_path / "x.TXT").write_text("upper case caption")
    for name in ("a.png", "a.jpg", "a.webp"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "a.txt").write_text("one caption")
    scan = scan_images(tmp_path)
    assert [(pair.relative_path, pair.caption_path.name) for pair in scan.pairs] == [("a.jpg", "a.txt"), ("x.JPG", "x.TXT")]
    assert read_caption(scan.pairs[1]) == "upper case caption"
    assert [(problem.relative_path, problem.category) for problem in scan.problems] == [("a.png", "duplicate name"), ("a.webp", "duplicate name")]
    assert "same name (a.jpg)" in scan.problems[0].reason



def test_unreadable_caption_is_skipped_with_its_reason(public_tmp_path):
    tmp_path = public_tmp_path
    source = write_pair(tmp_path, "cat", caption="a cat")
    (tmp_path / "cat.txt").chmod(0)
    with unprivileged(), pytest.raises(SkippedItem) as info:
        read_caption(source)
    assert info.value.category == "unreadable caption"
    assert "cannot read the caption file cat.txt (Permission denied)" in str(info.value)



def test_read_caption_collapses_whitespace_and_keeps_one_caption_per_line(tmp_path):
    source = write_pair(tmp_path, "cat", caption="  a photo  of a\tcat  \r\n")
    assert read_caption(source) == "a photo of a cat"
    source = write_pair(tmp_path, "dog", caption="  a photo\n\nof a\tdog  \r\n \n")
    assert read_caption(source) == "a photo\nof a dog"



def test_read_caption_strips_utf8_bom(tmp_path):
    source = write_pair(tmp_path, "cat", caption="\ufeffcafé au lait".encode("utf-8"))
    assert read_caption(source) == "café au lait"



def test_missing_caption(tmp_path):
    source = write_pair(tmp_path, "cat", caption=None)
    with pytest.raises(SkippedItem) as info:
        read_caption(source)
    assert info.value.category == "missing caption"
    assert "cat.txt" in str(info.value)
    assert info.value.source == source



def test_empty_caption(tmp_path):
    source = write_pair(tmp_path, "cat", caption=" \n\t \n")
    with pytest.raises(SkippedItem) as info:
        read_caption(source)
    assert info.value.category == "empty caption"
    assert "cat.txt" in str(info.value)



def test_caption_not_utf8(tmp_path):
    source = write_pair(tmp_path, "cat", caption=b"\xff\xfe\xfa bad")
    with pytest.raises(SkippedItem) as info:
        read_caption(source)
    assert info.value.category == "caption not UTF-8"
    assert "UTF-8" in str(info.value) and "cat.txt" in str(info.value)



def test_read_source_returns_bytes_hash_and_caption(tmp_path):
    source = write_pair(tmp_path, "cat", caption="a cat")
    data, digest, caption = read_source(source)
    assert data == source.image_path.read_bytes()
    assert digest == sha256_bytes(data) and len(digest) == 64
    assert caption == "a cat"



def test_read_source_empty_image_file(tmp_path):
    source = write_pair(tmp_path, "cat")
    source.image_path.write_bytes(b"")
    with pytest.raises(SkippedItem) as info:
        read_source(source)
    assert info.value.category == "unreadable image" and "0 bytes" in str(info.value)



def test_worker_of_is_stable_across_calls_and_machines():
    # Fixed values: the assignment is a SHA-1 of the path, so it must never depend on the process or machine.
    assert worker_of("cats/cat_001.jpg", 4) == 3
    assert worker_of("cats/cat_001.jpg", 8) == 7
    assert worker_of("a.png", 1000) == 457
    assert worker_of("nested/deeper/x.webp", 4) == 0
    assert [worker_of("cats/cat_001.jpg", 4) for _ in range(5)] == [3] * 5



def test_worker_of_spreads_paths_evenly():
    counts = Counter(worker_of(f"images/{index:05d}.jpg", 4) for index in range(1000))
    assert set(counts) == {0, 1, 2, 3}
    assert all(180 <= count <= 320 for count in counts.values()), counts



def test_worker_of_single_worker():
    assert {worker_of(f"x/{i}.png", 1) for i in range(50)} == {0}



def test_prepare_item_too_small(tmp_path):
    source = write_pair(tmp_path, "tiny", noise_image(100, 80))
    data, digest, caption = read_source(source)
    with pytest.raises(SkippedItem) as info:
        prepare_item(source, data, digest, caption, 512, 1024)
    assert info.value.category == "too small"
    assert "100x80" in str(info.value) and "512" in str(info.value)



def test_prepare_item_unreadable(tmp_path):
    source = write_pair(tmp_path, "broken")
    source.image_path.write_bytes(b"garbage, not a png")
    data, digest, caption = read_source(source)
    with pytest.raises(SkippedItem) as info:
        prepare_item(source, data, digest, caption, 512, 1024)
    assert info.value.category == "unreadable image"



def test_prepare_item_and_manifest_row(tmp_path):
    source = write_pair(tmp_path, "photo", noise_image(900, 600), caption="a  photo")
    data, digest, caption = read_source(source)
    item = prepare_item(source, data, digest, caption, 512, 768)
    assert (item.original_width, item.original_height) == (900, 600)
    assert item.plan == plan_crop(900, 600, 512, 768)
    assert item.pixels.shape == (3, item.plan.bucket.height, item.plan.bucket.width)
    assert item.pixels.min() >= -1 and item.pixels.max() <= 1

    row = item.manifest_row()
    original_h, original_w, crop_top, crop_left, target_h, target_w = micro_conditioning(900, 600, item.plan)
    assert row == {
        "image_path": "photo.png",
        "image_sha256": digest,
        "caption": "a photo",
        "bucket_width": target_w,
        "bucket_height": target_h,
        "original_width": original_w,
        "original_height": original_h,
        "crop_top": crop_top,
        "crop_left": crop_left,
        # 900x600 is resized to 864x576 for the 832x576 bucket and cropped from x = 16; mirrored, the crop
        # starts 864 - 832 - 16 = 16 from the mirrored image's left edge
        "crop_left_flipped": 16,
        "upscaled": False,
        "has_loss_mask": False,  # no mask file, no --alpha_mask
        "mask_sha256": None,
    }
    assert (row["original_width"], row["original_height"]) == (900, 600)
    assert (row["bucket_width"], row["bucket_height"]) == (item.plan.bucket.width, item.plan.bucket.height)



def test_prepare_item_uses_upright_size(tmp_path):
    # Stored 900x600 with EXIF orientation 6: upright it is 600x900, and that is the "original size".
    exif = Image.Exif()
    exif[0x0112] = 6
    image_path = tmp_path / "phone.jpg"
    noise_image(900, 600).save(image_path, "JPEG", exif=exif)
    image_path.with_suffix(".txt").write_text("sideways photo")
    source = SourcePair(image_path, "phone.jpg")
    item = prepare_item(source, *read_source(source), 512, 768)
    assert (item.original_width, item.original_height) == (600, 900)
    assert item.plan.bucket.height > item.plan.bucket.width
    row = item.manifest_row()
    assert (row["original_width"], row["original_height"]) == (600, 900)
