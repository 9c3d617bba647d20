"""Extract a LoRA from a fine-tune: the difference between the fine-tuned and the base SDXL model, factored
per layer by SVD, written in the kohya / A1111 LoRA layout that diffusers' `load_lora_weights`, ComfyUI,
A1111/Forge and kohya load (which layers and why: sdxl_trainer/lora_extract.py).

    venv/bin/python sdxl_extract_lora.py --base stabilityai/stable-diffusion-xl-base-1.0 \\
        --tuned output/my_run/pipeline --rank 32 --output my_run_lora.safetensors

--base and --tuned each take a diffusers folder, a single-file .safetensors (described by
--single_file_config) or a Hugging Face model id. Both models are held in CPU memory in fp32 (about 28 GB
for SDXL).
"""

from __future__ import annotations

import sys

import torch

from sdxl_trainer.config import parse_config
from sdxl_trainer.jobs.extract_config import ExtractConfig
from sdxl_trainer.models.single_file import load_pipeline
from sdxl_trainer.outputs.export import SAVE_DTYPES
from sdxl_trainer.outputs.lora_extract import architecture_problem, extract_lora, lora_metadata, save_lora


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ExtractConfig, argv, description=__doc__)
    base, tuned = (load_pipeline(model, config.single_file_config, torch.float32) for model in (config.base, config.tuned))
    problem = architecture_problem(base, tuned)
    if problem:
        raise SystemExit(f"Cannot extract a LoRA: {problem}.")
    extraction = extract_lora(base, tuned, config.rank, config.conv_rank, config.min_diff, SAVE_DTYPES[config.save_precision], torch.device(config.device))
    save_lora(extraction, lora_metadata(tuned, config.rank, config.conv_rank, config.output.stem), config.output)
    for component, report in extraction.components.items():
        print(f"{component}: {report.layers} layers; the LoRA keeps {report.kept:.1%} of their weight change (squared Frobenius norm)")
    for component, largest in extraction.skipped_text_encoders.items():
        print(f"{component}: left out, its largest weight change {largest:.3g} is at most --min_diff {config.min_diff:g}")
    if extraction.left_out:
        print("Largest weight changes no LoRA key carries (exporting at a lower precision alone changes weights by up to about 1e-3):")
        for name, change in extraction.left_out:
            print(f"  {name}: {change:.3g}")
    print(f"Wrote {config.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
