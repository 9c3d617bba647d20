"""Extract a LoRA from a fine-tune: the difference between the fine-tuned and the base SDXL model, factored
per layer into its best low-rank approximation, written in the kohya / A1111 LoRA layout that diffusers'
`load_lora_weights`, ComfyUI, A1111/Forge and kohya load (which layers and why: sdxl_trainer/outputs/lora_extract.py).

    venv/bin/python sdxl_extract_lora.py --base stabilityai/stable-diffusion-xl-base-1.0 \\
        --tuned output/my_run/pipeline --rank 32 --output my_run_lora.safetensors

--base and --tuned each take a diffusers folder, a single-file .safetensors (described by
--single_file_config) or a Hugging Face model id. Both are read one weight at a time from their files (a
full-size SDXL pair in well under 16 GB of memory); layers the fine-tune left unchanged are skipped, and the
factorisations run on the GPU when there is one.
"""

from __future__ import annotations

import sys

from sdxl_trainer.config import parse_config
from sdxl_trainer.jobs.extract_config import ExtractConfig
from sdxl_trainer.models.weight_files import ModelFilesError, open_model_weights
from sdxl_trainer.outputs.export import SAVE_DTYPES
from sdxl_trainer.outputs.lora_extract import architecture_problem, extract_lora, lora_metadata, save_lora


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ExtractConfig, argv, description=__doc__)
    try:
        base, tuned = (open_model_weights(getattr(config, flag), f"--{flag}", config.config_source()) for flag in ("base", "tuned"))
        problem = architecture_problem(base, tuned)
        if problem:
            raise SystemExit(f"Cannot extract a LoRA: {problem}.")
        device = config.resolved_device()
        print(f"Extracting a LoRA of rank {config.rank} (convolutions: {config.conv_rank or 'none'}) on {device}")
        extraction = extract_lora(base, tuned, config.rank, config.conv_rank, config.min_diff, SAVE_DTYPES[config.save_precision], device, progress=True)
    except ModelFilesError as error:
        raise SystemExit(f"Cannot extract a LoRA: {error}") from None
    save_lora(extraction, lora_metadata(tuned, config.rank, config.conv_rank, config.output.stem), config.output)
    for component, report in extraction.components.items():
        skipped = (
            f"; {report.skipped} unchanged layers skipped (equal to --base's in {', '.join(sorted(extraction.compared_in))}, the coarser of the two files' dtypes)"
            if report.skipped else ""
        )
        padded = (
            f"; {report.padded} unchanged attention projections written as zeros, so that diffusers and A1111 apply each attention layer whole"
            if report.padded else ""
        )
        print(f"{component}: {report.layers} layers; the LoRA keeps {report.kept:.1%} of their weight change (squared Frobenius norm){skipped}{padded}")
    for component, largest in extraction.skipped_text_encoders.items():
        print(f"{component}: left out, its largest weight change {largest:.3g} is at most --min_diff {config.min_diff:g}")
    if extraction.left_out:
        print("Largest weight changes no LoRA key carries:")
        for name, change in extraction.left_out:
            print(f"  {name}: {change:.3g}")
    unrelated = extraction.unrelated_base()
    if unrelated:
        print(
            f"Warning: {unrelated}: is --base the model the fine-tune started from (its --pretrained_model_name_or_path)? "
            "The LoRA is written, but applied to --base it will not give the tuned model"
        )
    print(f"Wrote {config.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
