"""What caption mode (--encode_captions_each_step) costs next to training on cached embeddings.

    venv/bin/python benchmarks/bench_caption_mode.py [--updates_per_round 4] [--rounds 3]

1. Full-size SDXL, counted (the same on any machine): FLOP of both text encoders' forward for one caption
   (1, 2 or 3 chunks of 75 tokens) against the UNet's forward + backward for one 1024 px image (with
   gradient checkpointing, as the trainer runs it), and the encoders' memory, counted on the meta device.
   Trained encoders (--train_text_encoder) add their backward (about twice the forward) and fp32 weights,
   gradients and 8-bit AdamW state.
2. Tiny pipeline, timed on this machine (1 process, fp32): TrainStep updates over the same in-memory
   batches with cached embeddings, with the frozen text encoders in the step, and with them trained,
   alternating in rounds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

from benchmarks.lib.flops import flop_per_image  # noqa: E402
from benchmarks.lib.timing import time_steps  # noqa: E402
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH  # noqa: E402
from sdxl_trainer.models.sdxl import build_full_size_text_encoders  # noqa: E402

BATCH = 4
SEED = 3
WARMUP_UPDATES = 2


def text_encoder_flops(chunks: int) -> float:
    """FLOP of both full-size encoders' forward over one caption of `chunks` x 77 tokens."""
    with torch.device("meta"):
        encoders = build_full_size_text_encoders()
    token_ids = torch.zeros((chunks, TEXT_MAX_LENGTH), dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        for encoder in encoders:
            encoder(token_ids, output_hidden_states=True)
    return float(counter.get_total_flops())


def counted() -> None:
    with torch.device("meta"):
        parameters = sum(parameter.numel() for encoder in build_full_size_text_encoders() for parameter in encoder.parameters())
    unet = flop_per_image("sdxl", 1024, gradient_checkpointing=True)
    print(f"full-size SDXL, counted: UNet forward + backward per 1024 px image {unet / 1e12:.2f} TFLOP (gradient checkpointing)")
    for chunks in (1, 2, 3):
        text = text_encoder_flops(chunks)
        print(f"  text encoders, {chunks * 75:3d} tokens: {text / 1e9:6.1f} GFLOP per caption = {100 * text / unet:.2f}% of the UNet's")
    print(f"  text encoders' weights: {parameters / 1e6:.0f} M parameters, {parameters * 2 / 1e9:.2f} GB in bf16 per GPU (replicated, frozen)")
    # Trained: fp32 weights (4 bytes) and gradients (4), 8-bit AdamW's two moments (2), sharded over the GPUs.
    print(f"  trained (--train_text_encoder): forward + backward about {3 * text_encoder_flops(1) / 1e9:.1f} GFLOP per 75-token caption, "
          f"{parameters * 10 / 1e9:.1f} GB of fp32 weights, gradients and adamw8bit state over all GPUs")


def timed(updates_per_round: int, rounds: int) -> None:
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.distributed.fsdp import prepare_unet
    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
    from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
    from sdxl_trainer.models.encoders import encode_prompts, load_text_encoders
    from sdxl_trainer.models.tiny import save_tiny_pipeline
    from sdxl_trainer.optimizers.build import build_optimizer
    from sdxl_trainer.training.captions import CaptionVariation, StepCaptionEncoder
    from sdxl_trainer.training.loss import build_noise_scheduler
    from sdxl_trainer.training.lr_schedule import LearningRateSchedule
    from sdxl_trainer.training.noise_settings import NoiseSettings
    from sdxl_trainer.training.step import TrainStep
    from sdxl_trainer.training.trained_models import TrainedModels

    world = init_distributed()
    with tempfile.TemporaryDirectory() as folder:
        pipeline_dir = save_tiny_pipeline(Path(folder) / "tiny", seed=0)
        text_side = load_text_encoders(str(pipeline_dir), world.device, torch.float32)
        captions = [f"sample {index}, a red circle, a blue square, flat illustration, tag {index % 7}" for index in range(64)]
        empty = encode_prompts(*text_side, [""], 1, world.device)
        empty_prompt = (empty.prompt_embeds[0], empty.pooled_prompt_embeds[0])
        steps = {}
        for mode in ("cached embeddings", "caption mode", "trained encoders"):
            unet = prepare_unet(UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet"), world, param_dtype=None)
            unet.enable_gradient_checkpointing()
            trains = mode == "trained encoders"
            mode_text_side = load_text_encoders(str(pipeline_dir), world.device, torch.float32, trained=(True, True)) if trains else text_side
            models = TrainedModels(unet, dict(zip(TEXT_ENCODER_NAMES, mode_text_side[1])) if trains else None)
            optimizer = build_optimizer("adamw", models.parameter_groups(1e-5, dict.fromkeys(TEXT_ENCODER_NAMES, 1e-5)), 1e-5, 1e-2, (0.9, None), 1e-8)
            encoder = None
            if mode != "cached embeddings":
                encoder = StepCaptionEncoder(mode_text_side, captions, CaptionVariation(shuffle_tags=True, keep_tags=1), SEED, 1, world.device, trains)
            steps[mode] = TrainStep(
                unet, optimizer, LearningRateSchedule("constant", 1e-5, 0, 1), build_noise_scheduler(str(pipeline_dir), "epsilon", False),
                NoiseSettings(0.1), empty_prompt, SEED, max_grad_norm=1.0, caption_encoder=encoder,
            )
        batches = []
        for update in range(WARMUP_UPDATES + updates_per_round * rounds):
            items = [(update * BATCH + offset) % len(captions) for offset in range(BATCH)]
            encoded = encode_prompts(*text_side, [captions[item] for item in items], 1, world.device)
            config = steps["caption mode"].unet.config
            batches.append({
                "latents": torch.randn(BATCH, config.in_channels, 32, 32),
                "prompt_embeds": encoded.prompt_embeds,
                "pooled_prompt_embeds": encoded.pooled_prompt_embeds,
                "time_ids": torch.tensor([[256, 256, 0, 0, 256, 256]] * BATCH, dtype=torch.float32),
                "sample_index": torch.tensor(items),
            })
    times = time_steps({mode: lambda update, step=step: step([batches[update]], epoch=0) for mode, step in steps.items()}, WARMUP_UPDATES,
                       updates_per_round, rounds, world)  # fmt: skip
    cached = times["cached embeddings"].seconds_per_step
    print(f"tiny pipeline, timed here (1 process, fp32, batch {BATCH}, 256 px, AdamW):")
    for mode, mode_times in times.items():
        print(f"  {mode:17s}: {mode_times.seconds_per_step * 1000:7.1f} ms/update ({mode_times.seconds_per_step / cached:.3f}x)")
    shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates_per_round", type=int, default=4, help="measured updates of each mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the modes take turns")
    args = parser.parse_args()
    counted()
    timed(args.updates_per_round, args.rounds)


if __name__ == "__main__":
    main()
