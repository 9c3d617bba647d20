"""Upscaling low-resolution images before bucketing, with optional GFPGAN face restoration.

Networks are loaded with spandrel, which detects the architecture from the weight file's keys: Real-ESRGAN
(RealESRGAN_x4plus.pth), old-format ESRGAN files such as 4x_foolhardy_Remacri.pth, and GFPGAN v1.3/v1.4,
from .pth (read by spandrel's restricted unpickler: tensors and plain containers only, no code) or
.safetensors. spandrel does not tile, so `upscale_tiled` runs large images in overlapping tiles: each tile
sees `tile_padding` px of its neighbours, so the seams match an untiled run while memory stays bounded.

GFPGAN restores aligned 512-px faces only; facexlib's FaceRestoreHelper finds and aligns the faces on the
low-resolution image and pastes the restored ones back into the upscaled image (as GFPGAN's own code does).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:  # imported when an upscaler loads: a run without upscaling need not import it
    from spandrel import ImageModelDescriptor

# facexlib's detector and face-parsing weights, looked up by these names in --facexlib_weights_dir.
FACEXLIB_WEIGHT_FILES = ("detection_Resnet50_Final.pth", "parsing_parsenet.pth")
FACEXLIB_RELEASES = "https://github.com/xinntao/facexlib/releases"
GFPGAN_FACE_SIZE = 512


class UpscalerError(ValueError):
    """An upscaler or face-restorer weight file is missing or not usable; the message names the flag."""


def load_image_model(path: Path, flag: str, purposes: tuple[str, ...]) -> ImageModelDescriptor:
    """Load a weight file through spandrel and check it is the kind of network `flag` asks for."""
    from spandrel import ImageModelDescriptor, ModelLoader, UnsupportedModelError

    if not path.is_file():
        raise UpscalerError(f"{flag} {path} not found: give the path of a local weight file (.pth or .safetensors)")
    try:
        descriptor = ModelLoader().load_from_file(path)
    except (UnsupportedModelError, ValueError, RuntimeError, KeyError) as error:
        raise UpscalerError(f"{flag} {path} is not a network spandrel can load ({type(error).__name__}: {error})") from error
    if not isinstance(descriptor, ImageModelDescriptor) or descriptor.purpose not in purposes:
        raise UpscalerError(
            f"{flag} {path} holds a {descriptor.architecture.name} network for {descriptor.purpose}, "
            f"not {' / '.join(purposes)}: choose another file"
        )
    return descriptor


def upscale_tiled(model: Callable[[torch.Tensor], torch.Tensor], scale: int, image: torch.Tensor, tile_size: int, tile_padding: int) -> torch.Tensor:
    """Run `model` (x`scale`) over image (1, C, H, W) tile by tile; tile_size 0 = the whole image at once.

    Each tile_size square is upscaled together with up to tile_padding px around it, and only the square's
    own part of the output is kept, so a network whose receptive field is within the padding gives exactly
    the untiled result."""
    _, channels, height, width = image.shape
    if tile_size == 0 or (height <= tile_size and width <= tile_size):
        return model(image)
    output = image.new_zeros(1, channels, height * scale, width * scale)
    for top in range(0, height, tile_size):
        for left in range(0, width, tile_size):
            bottom, right = min(top + tile_size, height), min(left + tile_size, width)
            outer_top, outer_left = max(top - tile_padding, 0), max(left - tile_padding, 0)
            outer_bottom, outer_right = min(bottom + tile_padding, height), min(right + tile_padding, width)
            upscaled = model(image[:, :, outer_top:outer_bottom, outer_left:outer_right])
            inner_top, inner_left = (top - outer_top) * scale, (left - outer_left) * scale
            output[:, :, top * scale : bottom * scale, left * scale : right * scale] = upscaled[
                :, :, inner_top : inner_top + (bottom - top) * scale, inner_left : inner_left + (right - left) * scale
            ]
    return output


def passes_needed(scale: int, factor: float) -> int:
    """How many runs of a x`scale` network reach an enlargement of at least `factor`."""
    return max(1, math.ceil(math.log(factor) / math.log(scale) - 1e-9))


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).unsqueeze(0).float().div(255.0)


def tensor_to_pil(tensor: torch.Tensor) -> Image.Image:
    array = tensor[0].float().clamp(0, 1).mul(255.0).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(array, "RGB")


class FaceRestorer:
    """GFPGAN over every face that `face_helper` (a facexlib FaceRestoreHelper) finds in the source image."""

    def __init__(self, network: torch.nn.Module, face_helper, device: torch.device):
        self.network = network.eval().to(device)
        self.face_helper = face_helper
        self.device = device

    @torch.no_grad()
    def __call__(self, source: Image.Image, upscaled: Image.Image) -> Image.Image:
        helper = self.face_helper
        helper.clean_all()
        helper.set_upscale_factor(upscaled.width // source.width)
        helper.read_image(np.ascontiguousarray(np.asarray(source)[:, :, ::-1]))  # facexlib works in BGR
        helper.get_face_landmarks_5(only_center_face=False, eye_dist_threshold=5)
        helper.align_warp_face()
        if not helper.cropped_faces:
            return upscaled
        for face in helper.cropped_faces:
            # GFPGAN's input and output range is [-1, 1] (as in GFPGAN's own inference code).
            face_rgb = torch.from_numpy(np.ascontiguousarray(face[:, :, ::-1])).permute(2, 0, 1).unsqueeze(0)
            restored = self.network(face_rgb.to(self.device).float().div(127.5).sub(1.0), return_rgb=False)[0]
            restored_rgb = restored[0].float().clamp(-1, 1).add(1.0).mul(127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            helper.add_restored_face(np.ascontiguousarray(restored_rgb[:, :, ::-1]))
        helper.get_inverse_affine(None)
        pasted = helper.paste_faces_to_input_image(upsample_img=np.ascontiguousarray(np.asarray(upscaled)[:, :, ::-1]))
        return Image.fromarray(np.ascontiguousarray(np.clip(pasted, 0, 255).astype(np.uint8)[:, :, ::-1]), "RGB")


def build_face_helper(weights_dir: Path, device: torch.device):
    """facexlib's FaceRestoreHelper with its RetinaFace detector and ParseNet from a local folder (facexlib
    would otherwise download them into that folder)."""
    from facexlib.utils.face_restoration_helper import FaceRestoreHelper

    return FaceRestoreHelper(
        upscale_factor=1,
        face_size=GFPGAN_FACE_SIZE,
        crop_ratio=(1, 1),
        det_model="retinaface_resnet50",
        save_ext="png",
        use_parse=True,
        device=device,
        model_rootpath=str(weights_dir),
    )


class Upscaler:
    """Enlarges an image by at least a given factor with an SR network (repeated if one pass is not enough),
    then restores faces if asked. Thread-safe: the I/O threads share one network, one image at a time."""

    def __init__(
        self,
        descriptor: ImageModelDescriptor,
        device: torch.device,
        dtype: torch.dtype,
        tile_size: int,
        tile_padding: int,
        face_restorer: FaceRestorer | None = None,
    ):
        supported = dtype == torch.float32 or (dtype == torch.float16 and descriptor.supports_half) or (dtype == torch.bfloat16 and descriptor.supports_bfloat16)
        self.dtype = dtype if supported else torch.float32
        self.model = descriptor.to(device).to(self.dtype).eval()
        self.device = device
        self.tile_size = tile_size
        self.tile_padding = tile_padding
        self.face_restorer = face_restorer
        self._lock = threading.Lock()

    @property
    def scale(self) -> int:
        return self.model.scale

    def __call__(self, image: Image.Image, factor: float) -> Image.Image:
        with self._lock:
            tensor = pil_to_tensor(image).to(self.device, self.dtype)
            for _ in range(passes_needed(self.scale, factor)):
                tensor = upscale_tiled(self.model, self.scale, tensor, self.tile_size, self.tile_padding)
            upscaled = tensor_to_pil(tensor)
            if self.face_restorer is not None:
                upscaled = self.face_restorer(image, upscaled)
        return upscaled


def weights_problems(upscale_to_resolution: int, upscaler_weights: Path | None, use_gfpgan: bool, gfpgan_weights: Path | None, facexlib_weights_dir: Path | None) -> list[str]:
    """Missing weight files for the features asked for, each naming its flag: checked before any work."""
    problems = []
    if not upscale_to_resolution:
        if use_gfpgan:
            problems.append("--upscale_use_GFPGAN restores faces of upscaled images: also set --upscale_to_resolution")
        return problems
    if upscaler_weights is None:
        problems.append("--upscale_to_resolution needs --upscaler_weights: a local ESRGAN-family file such as RealESRGAN_x4plus.pth or 4x_foolhardy_Remacri.pth")
    elif not upscaler_weights.is_file():
        problems.append(f"--upscaler_weights {upscaler_weights} not found")
    if use_gfpgan:
        if gfpgan_weights is None:
            problems.append("--upscale_use_GFPGAN needs --gfpgan_weights: a local GFPGANv1.3.pth or GFPGANv1.4.pth")
        elif not gfpgan_weights.is_file():
            problems.append(f"--gfpgan_weights {gfpgan_weights} not found")
        if facexlib_weights_dir is None:
            problems.append(f"--upscale_use_GFPGAN needs --facexlib_weights_dir: a folder with {' and '.join(FACEXLIB_WEIGHT_FILES)} ({FACEXLIB_RELEASES})")
        else:
            missing = [name for name in FACEXLIB_WEIGHT_FILES if not (facexlib_weights_dir / name).is_file()]
            if missing:
                problems.append(f"--facexlib_weights_dir {facexlib_weights_dir} lacks {', '.join(missing)} ({FACEXLIB_RELEASES})")
    return problems


def load_upscaler(
    upscaler_weights: Path,
    gfpgan_weights: Path | None,
    facexlib_weights_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    tile_size: int,
    tile_padding: int,
) -> Upscaler:
    descriptor = load_image_model(upscaler_weights, "--upscaler_weights", ("SR",))
    face_restorer = None
    if gfpgan_weights is not None:
        gfpgan = load_image_model(gfpgan_weights, "--gfpgan_weights", ("FaceSR",))
        face_restorer = FaceRestorer(gfpgan.model, build_face_helper(facexlib_weights_dir, device), device)
    return Upscaler(descriptor, device, dtype, tile_size, tile_padding, face_restorer)
