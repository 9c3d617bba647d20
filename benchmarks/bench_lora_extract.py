"""Peak memory and time of LoRA extraction (sdxl_extract_lora.py) on a full-size SDXL pair with random weights.

It writes, once, into --work_dir:
  base/   SDXL's architecture (models/sdxl.py's published configs) with random weights in fp32, as the hub's
          stabilityai/stable-diffusion-xl-base-1.0 publishes its plain weights (14 GB);
  tuned/  the same in fp16, as the trainer exports by default (7 GB): every weight is the base's rounded to fp16
          (what a fine-tune that left it alone exports), except --changed_share of the UNet's LoRA layers
          (spread evenly), changed by a rank-8 update of 2% of their norm.
Both are diffusers folders written one tensor at a time (no model is built: names and shapes come from
meta-device modules), so writing them needs a few hundred MB.

Then it runs sdxl_extract_lora.py on them in a child process, as a user would (`--rank 32`, device cpu unless
--device), and reports the child's peak resident memory (getrusage of the child, as /usr/bin/time -v shows
it) and its wall time, and checks that the LoRA holds exactly the changed layers. A fine-tune changes every
layer; the time that would take is projected from the factorisation time of each distinct layer shape,
measured here, times the number of layers of that shape (the reading and comparing time is in the run's).

Run: nice -n 10 venv/bin/python benchmarks/bench_lora_extract.py --work_dir /tmp/lora_bench [--changed_share 0.1] [--size tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from safetensors import safe_open  # noqa: E402

from sdxl_trainer.models.components import TEXT_ENCODER_NAMES  # noqa: E402
from sdxl_trainer.models.single_file import hf_clip_name  # noqa: E402
from sdxl_trainer.models.weight_files import COMPONENTS, meta_module  # noqa: E402
from sdxl_trainer.outputs.lora_extract import UNET_ATTENTION_BLOCKS, low_rank_factors, target_layers  # noqa: E402

SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16"}
WEIGHT_FILES = {"unet": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
                "text_encoder": "model.safetensors", "text_encoder_2": "model.safetensors"}
CHANGE_RANK, CHANGE_SIZE = 8, 0.02  # the planted change: rank and norm relative to the layer's weights
LORA_RANK = 32


def configs(size: str) -> dict[str, dict]:
    """Each component's config (as its config.json holds it) at full SDXL size or the tests' tiny size."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig

    if size == "full":
        from sdxl_trainer.models.sdxl import SDXL_TEXT_ENCODER_CONFIGS, SDXL_UNET_CONFIG, SDXL_VAE_CONFIG

        unet, vae, texts = SDXL_UNET_CONFIG, SDXL_VAE_CONFIG, SDXL_TEXT_ENCODER_CONFIGS
    else:
        from sdxl_trainer.models.tiny import TINY_TEXT_WIDTHS, TINY_UNET_CONFIG, TINY_VAE_CONFIG

        unet, vae = TINY_UNET_CONFIG, TINY_VAE_CONFIG
        texts = [dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2, num_attention_heads=4, projection_dim=width)
                 for width in TINY_TEXT_WIDTHS]
    with torch.device("meta"):
        return {
            "unet": dict(UNet2DConditionModel(**unet).config),
            "vae": dict(AutoencoderKL(**vae).config),
            **{name: CLIPTextConfig(vocab_size=49408, max_position_embeddings=77, **text).to_dict() for name, text in zip(TEXT_ENCODER_NAMES, texts)},
        }


def write_folder_configs(folder: Path, component_configs: dict[str, dict]) -> None:
    from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG

    classes = {"unet": ("diffusers", "UNet2DConditionModel"), "vae": ("diffusers", "AutoencoderKL"), "text_encoder": ("transformers", "CLIPTextModel"),
               "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"), "scheduler": ("diffusers", "EulerDiscreteScheduler")}
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline", **classes}, indent=1))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "EulerDiscreteScheduler", **SDXL_SCHEDULER_CONFIG}))
    for component, config in component_configs.items():
        (folder / component).mkdir(exist_ok=True)
        (folder / component / "config.json").write_text(json.dumps(config, indent=1, default=list))


class StreamedFile:
    """A safetensors file written tensor by tensor: the header first (every name, dtype and shape known in
    advance), then each tensor's bytes in the header's order."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        header, offset = {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.order, self.dtype = list(shapes), dtype
        self.handle = open(path, "wb")
        self.handle.write(len(encoded).to_bytes(8, "little") + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert name == self.order.pop(0), name
        self.handle.write(tensor.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        assert not self.order
        self.handle.close()


def write_pair(work_dir: Path, size: str, changed_share: float) -> list[str]:
    """base/ and tuned/ (module docstring); returns the changed UNet weights' names."""
    component_configs = configs(size)
    generator = torch.Generator().manual_seed(0)
    changed = []
    for folder in ("base", "tuned"):
        write_folder_configs(work_dir / folder, component_configs)
    for component in COMPONENTS:
        module = meta_module(component, component_configs[component])
        shapes = {(hf_clip_name(key) if component in TEXT_ENCODER_NAMES else key): tuple(value.shape)
                  for key, value in module.state_dict().items() if value.is_floating_point()}
        lora_weights = [f"{name}.weight" for name in target_layers(module, UNET_ATTENTION_BLOCKS)] if component == "unet" else []
        every = max(1, round(1 / changed_share)) if changed_share > 0 else 0
        to_change = set(lora_weights[::every]) if every else set()
        changed += sorted(to_change)
        files = [StreamedFile(work_dir / folder / component / WEIGHT_FILES[component], shapes, dtype)
                 for folder, dtype in (("base", torch.float32), ("tuned", torch.float16))]
        for name, shape in shapes.items():
            weight = torch.randn(shape, generator=generator) * (0.02 if len(shape) > 1 else 1.0)
            files[0].write(name, weight)
            if name in to_change:
                matrix = weight.reshape(shape[0], -1)
                update = torch.randn(matrix.shape[0], CHANGE_RANK, generator=generator) @ torch.randn(CHANGE_RANK, matrix.shape[1], generator=generator)
                weight = weight + (CHANGE_SIZE * matrix.norm() / update.norm() * update).reshape(shape)
            files[1].write(name, weight)
        for file in files:
            file.close()
        print(f"wrote {component}: {len(shapes)} weights, {len(to_change)} changed", flush=True)
    return changed


def projected_factorisation_s(work_dir: Path, size: str) -> tuple[float, int]:
    """Seconds to factorise every UNet LoRA layer at --rank LORA_RANK on this CPU: each distinct shape timed
    once on a random change, times its count. Also the number of layers."""
    module = meta_module("unet", configs(size)["unet"])
    shapes = Counter(tuple(layer.weight.shape) for layer in target_layers(module, UNET_ATTENTION_BLOCKS).values())
    total = 0.0
    for shape, count in shapes.items():
        delta = torch.randn(shape)
        started = time.perf_counter()
        low_rank_factors(delta, LORA_RANK)
        total += (time.perf_counter() - started) * count
    return total, sum(shapes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", type=Path, required=True, help="where the pair and the LoRA are written (21 GB at full size)")
    parser.add_argument("--changed_share", type=float, default=0.1, help="share of the UNet's LoRA layers the tuned copy changes")
    parser.add_argument("--size", choices=("full", "tiny"), default="full", help="full-size SDXL, or the tests' tiny architecture (a quick check)")
    parser.add_argument("--device", default="cpu", help="--device of the extraction")
    args = parser.parse_args()
    marker = args.work_dir / f"pair-{args.size}-{args.changed_share}.json"
    if marker.is_file():
        changed = json.loads(marker.read_text())
    else:
        started = time.perf_counter()
        changed = write_pair(args.work_dir, args.size, args.changed_share)
        marker.write_text(json.dumps(changed))
        print(f"wrote the pair in {time.perf_counter() - started:.0f} s")
    output = args.work_dir / "lora.safetensors"
    command = [sys.executable, str(REPO_ROOT / "sdxl_extract_lora.py"), "--base", str(args.work_dir / "base"), "--tuned", str(args.work_dir / "tuned"),
               "--rank", str(LORA_RANK), "--device", args.device, "--output", str(output)]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # kB on Linux
    print(result.stdout)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    with safe_open(str(output), "pt") as lora:
        layers = {key.split(".")[0] for key in lora.keys()}
    projected_s, layer_count = projected_factorisation_s(args.work_dir, args.size)
    print(json.dumps({
        "size": args.size, "changed_layers": len(changed), "unet_lora_layers": layer_count, "layers_in_lora": len(layers),
        "peak_rss_gib": round(peak_gib, 2), "wall_s": round(wall_s, 1),
        "projected_factorisation_s_all_layers_changed": round(projected_s, 1), "torch_threads": torch.get_num_threads(),
    }, indent=1))
    assert len(layers) == len(changed), (len(layers), len(changed))


if __name__ == "__main__":
    main()
