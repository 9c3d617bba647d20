"""Upscaling: ESRGAN-family weight files of the real architecture (random weights, tiny widths) loaded through
the user's path, tiling, repeated passes, weight checks, and GFPGAN face restoration with controlled detection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from upscaler_weights import save_weights, tiny_rrdbnet

from sdxl_trainer.preparation.upscale import (
    FACEXLIB_WEIGHT_FILES,
    FaceRestorer,
    Upscaler,
    UpscalerError,
    build_face_helper,
    load_image_model,
    passes_needed,
    pil_to_tensor,
    upscale_tiled,
    weights_problems,
)


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")



@pytest.mark.parametrize(
    "file_name,real_esrgan_layout",
    [("4x_remacri_like.pth", False), ("4x_remacri_like.safetensors", False), ("RealESRGAN_x4plus_like.pth", True)],
)
def test_weight_files_load_with_their_weights(tmp_path, file_name, real_esrgan_layout):
    network = tiny_rrdbnet()
    descriptor = load_image_model(save_weights(network, tmp_path / file_name, real_esrgan_layout), "--upscaler_weights", ("SR",))
    assert descriptor.scale == 4 and descriptor.purpose == "SR"
    image = torch.rand(1, 3, 12, 10, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = network(image).clamp(0, 1)
    assert torch.allclose(descriptor(image), expected, atol=1e-6)  # the file's weights, not fresh random ones



def test_tiled_equals_untiled_with_padding():
    network = tiny_rrdbnet()
    image = torch.rand(1, 3, 40, 36, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = upscale_tiled(network, 4, image, tile_size=0, tile_padding=0)
        tiled = upscale_tiled(network, 4, image, tile_size=16, tile_padding=20)
        seams = upscale_tiled(network, 4, image, tile_size=16, tile_padding=0)
    assert whole.shape == tiled.shape == (1, 3, 160, 144)
    assert (tiled - whole).abs().max().item() < 1e-5
    assert (seams - whole).abs().max().item() > 1e-3  # without padding the tiles' borders differ



@pytest.mark.parametrize("scale,factor,passes", [(4, 1.5, 1), (4, 4.0, 1), (4, 4.1, 2), (2, 4.0, 2), (2, 5.0, 3), (4, 16.0, 2)])
def test_passes_needed(scale, factor, passes):
    assert passes_needed(scale, factor) == passes



def test_upscaler_runs_as_many_passes_as_the_factor_needs(tmp_path):
    descriptor = load_image_model(save_weights(tiny_rrdbnet(scale=2), tmp_path / "2x.pth"), "--upscaler_weights", ("SR",))
    upscaler = Upscaler(descriptor, torch.device("cpu"), torch.float32, tile_size=8, tile_padding=20)
    source = noise(10, 6)
    assert upscaler(source, 1.7).size == (20, 12)
    twice = upscaler(source, 3.0)
    assert twice.size == (40, 24) and twice.mode == "RGB"
    with torch.no_grad():
        expected = descriptor(descriptor(pil_to_tensor(source)))
    assert np.abs(np.asarray(twice).astype(int) - np.asarray(Image.fromarray(expected[0].mul(255).round().byte().permute(1, 2, 0).numpy()))).max() <= 1



def test_weight_file_that_is_not_an_upscaler_is_refused(tmp_path):
    save_file({"weight": torch.zeros(3, 3)}, tmp_path / "random.safetensors")
    with pytest.raises(UpscalerError, match=r"--upscaler_weights .*random.safetensors is not a network spandrel can load"):
        load_image_model(tmp_path / "random.safetensors", "--upscaler_weights", ("SR",))
    one_x = save_weights(tiny_rrdbnet(scale=1), tmp_path / "1x_denoise.pth")
    with pytest.raises(UpscalerError, match=r"--upscaler_weights .*1x_denoise.pth holds a ESRGAN network for Restoration, not SR"):
        load_image_model(one_x, "--upscaler_weights", ("SR",))
    with pytest.raises(UpscalerError, match=r"--gfpgan_weights .*missing.pth not found"):
        load_image_model(tmp_path / "missing.pth", "--gfpgan_weights", ("FaceSR",))



def test_weights_problems_name_the_flags(tmp_path):
    assert weights_problems(0, None, False, None, None) == []
    assert weights_problems(1024, None, False, None, None) == [
        "--upscale_to_resolution needs --upscaler_weights: a local ESRGAN-family file such as RealESRGAN_x4plus.pth or 4x_foolhardy_Remacri.pth"
    ]
    assert weights_problems(0, None, True, None, None) == ["--upscale_use_GFPGAN restores faces of upscaled images: also set --upscale_to_resolution"]
    (tmp_path / "up.pth").write_bytes(b"x")
    (tmp_path / FACEXLIB_WEIGHT_FILES[0]).write_bytes(b"x")
    problems = weights_problems(1024, tmp_path / "up.pth", True, tmp_path / "gfpgan.pth", tmp_path)
    assert problems == [
        f"--gfpgan_weights {tmp_path / 'gfpgan.pth'} not found",
        f"--facexlib_weights_dir {tmp_path} lacks parsing_parsenet.pth (https://github.com/xinntao/facexlib/releases)",
    ]



class OneFaceDetector:
    """Stands in for RetinaFace: one face with eyes, nose and mouth corners at fixed places (x, y in px)."""

    def detect_faces(self, image, confidence_threshold):
        landmarks = [12, 12, 20, 12, 16, 16, 13, 20, 19, 20]
        return np.array([[6, 4, 26, 26, 0.99, *landmarks]], dtype=np.float32)



class NoFaceDetector:
    def detect_faces(self, image, confidence_threshold):
        return np.zeros((0, 15), dtype=np.float32)



class WholeFaceParser(torch.nn.Module):
    """Stands in for ParseNet: every pixel is "skin" (class 1), so the whole aligned face is pasted."""

    def forward(self, face):
        logits = torch.zeros(1, 19, face.shape[2], face.shape[3])
        logits[:, 1] = 1.0
        return logits, None



class RedFaceNetwork(torch.nn.Module):
    """Stands in for GFPGAN (same call and [-1, 1] range): every restored face is pure red."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, face, return_rgb=True):
        self.calls.append(face.clone())
        red = torch.tensor([1.0, -1.0, -1.0]).view(1, 3, 1, 1)
        return red.expand(1, 3, 512, 512).clone(), []



@pytest.fixture(scope="module")
def facexlib_weights_dir(tmp_path_factory) -> Path:
    """Random weights of facexlib's real detector and parser, where build_face_helper reads them (no download)."""
    from facexlib.detection.retinaface import RetinaFace
    from facexlib.parsing.parsenet import ParseNet

    folder = tmp_path_factory.mktemp("facexlib")
    torch.save(RetinaFace(network_name="resnet50", half=False, device="cpu").state_dict(), folder / FACEXLIB_WEIGHT_FILES[0])
    torch.save(ParseNet(in_size=512, out_size=512, parsing_ch=19).state_dict(), folder / FACEXLIB_WEIGHT_FILES[1])
    return folder



def test_face_restorer_pastes_restored_face_into_the_upscaled_image(facexlib_weights_dir):
    helper = build_face_helper(facexlib_weights_dir, torch.device("cpu"))
    helper.face_det, helper.face_parse = OneFaceDetector(), WholeFaceParser()
    network = RedFaceNetwork()
    source = Image.new("RGB", (32, 32), (0, 0, 200))
    upscaled = Image.new("RGB", (128, 128), (0, 0, 200))
    restored = FaceRestorer(network, helper, torch.device("cpu"))(source, upscaled)

    assert restored.size == (128, 128)
    assert len(network.calls) == 1 and network.calls[0].shape == (1, 3, 512, 512)
    assert network.calls[0].min() >= -1 and network.calls[0].max() <= 1  # GFPGAN's input range
    face_centre, far_corner = restored.getpixel((64, 64)), restored.getpixel((2, 125))
    assert face_centre[0] > 200 and face_centre[2] < 50  # the red face is pasted at the detected place (x4)
    assert far_corner == (0, 0, 200)  # the rest is the upscaled image



def test_face_restorer_without_faces_returns_the_upscaled_image(facexlib_weights_dir):
    helper = build_face_helper(facexlib_weights_dir, torch.device("cpu"))
    helper.face_det = NoFaceDetector()
    network = RedFaceNetwork()
    upscaled = noise(64, 64)
    assert FaceRestorer(network, helper, torch.device("cpu"))(noise(16, 16), upscaled) is upscaled
    assert network.calls == []
