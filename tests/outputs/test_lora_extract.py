"""LoRA extraction (sdxl_extract_lora.py) on the tiny pipeline: a "fine-tune" made by adding a known rank-2
change plus noise to the layers a LoRA carries. The extracted file, loaded by diffusers' own
`load_lora_weights` into the base pipeline, must bring the UNet's output (and the text encoders') closer to
the tuned model's as the rank grows, and reproduce it at full rank; its keys must be kohya's."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sdxl_trainer.models.single_file import CLIP_G_PREFIX, CLIP_L_PREFIX, UNET_PREFIX, hf_clip_name, pipeline_to_single_file, unet_ldm_names
from sdxl_trainer.outputs.lora_extract import (
    TEXT_ENCODER_BLOCKS,
    UNET_ATTENTION_BLOCKS,
    UNET_CONV_BLOCKS,
    extract_lora,
    lora_metadata,
    save_lora,
    target_layers,
)

FULL_RANK = 10_000  # above every layer's full rank: capped per layer
KEY = re.compile(r"^lora_(unet|te1|te2)_[a-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha)$")


def weights_of(folder):
    from sdxl_trainer.models.weight_files import open_model_weights

    return open_model_weights(str(folder), "--base", str(folder))


def load_pipeline(folder):
    from diffusers import StableDiffusionXLPipeline

    pipeline = StableDiffusionXLPipeline.from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def add_low_rank_change(model: torch.nn.Module, blocks: tuple[str, ...], generator: torch.Generator) -> None:
    """Every LoRA layer of `model` += a rank-2 change of about 15% of its weights' spread, plus 1.5% noise."""
    with torch.no_grad():
        for layer in target_layers(model, blocks).values():
            weight = layer.weight.reshape(layer.weight.shape[0], -1)
            low_rank = torch.randn(weight.shape[0], 2, generator=generator) @ torch.randn(2, weight.shape[1], generator=generator)
            change = 0.15 * weight.std() * (low_rank / 2 + 0.1 * torch.randn(weight.shape, generator=generator))
            layer.weight += change.reshape(layer.weight.shape)


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory, tiny_pipeline_dir):
    """The tiny pipeline with every UNet LoRA layer (transformer and ResNet blocks, samplers) and both text
    encoders changed, saved as a diffusers folder in fp32."""
    pipeline = load_pipeline(tiny_pipeline_dir)
    generator = torch.Generator().manual_seed(0)
    add_low_rank_change(pipeline.unet, UNET_ATTENTION_BLOCKS + UNET_CONV_BLOCKS, generator)
    for encoder in (pipeline.text_encoder, pipeline.text_encoder_2):
        add_low_rank_change(encoder, TEXT_ENCODER_BLOCKS, generator)
    folder = tmp_path_factory.mktemp("tuned") / "pipeline"
    pipeline.save_pretrained(folder)
    return folder


def unet_output(unet) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    sample, hidden = torch.randn(2, 4, 16, 16, generator=generator), torch.randn(2, 77, 80, generator=generator)
    added = {"text_embeds": torch.randn(2, 48, generator=generator), "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]] * 2)}
    with torch.no_grad():
        return unet(sample, torch.tensor([300, 700]), hidden, added_cond_kwargs=added).sample


def text_outputs(pipeline) -> list[torch.Tensor]:
    token_ids = torch.randint(0, 49408, (2, 77), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return [encoder(token_ids, output_hidden_states=True).hidden_states[-2] for encoder in (pipeline.text_encoder, pipeline.text_encoder_2)]


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm())


@pytest.mark.slow
def test_extracted_lora_approaches_the_tuned_model_as_the_rank_grows(tmp_path, tiny_pipeline_dir, tuned_dir):
    base, tuned = load_pipeline(tiny_pipeline_dir), load_pipeline(tuned_dir)
    target_unet, target_text = unet_output(tuned.unet), text_outputs(tuned)
    unet_errors = [relative_error(unet_output(base.unet), target_unet)]  # no LoRA: rank 0
    text_errors = [[relative_error(output, target) for output, target in zip(text_outputs(base), target_text)]]
    kept = []
    for rank in (1, 2, 8, FULL_RANK):
        extraction = extract_lora(weights_of(tiny_pipeline_dir), weights_of(tuned_dir), rank, conv_rank=rank, dtype=torch.float32)
        lora_file = tmp_path / f"rank_{rank}.safetensors"
        save_lora(extraction, lora_metadata(weights_of(tuned_dir), rank, rank, lora_file.stem), lora_file)
        with_lora = load_pipeline(tiny_pipeline_dir)
        with_lora.load_lora_weights(str(lora_file))  # diffusers' kohya-format conversion, then PEFT layers
        unet_errors.append(relative_error(unet_output(with_lora.unet), target_unet))
        text_errors.append([relative_error(output, target) for output, target in zip(text_outputs(with_lora), target_text)])
        kept.append(extraction.components["unet"].kept)
    assert unet_errors == sorted(unet_errors, reverse=True) and len(set(unet_errors)) == len(unet_errors), unet_errors
    assert unet_errors[2] < 0.3 * unet_errors[0]  # rank 2, the planted change's rank, carries most of it
    assert unet_errors[-1] < 1e-4, unet_errors  # full rank: the tuned UNet up to float rounding
    for encoder in range(2):  # both text encoders changed, so both are in the file and load
        errors = [step[encoder] for step in text_errors]
        assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-4, errors
    assert kept == sorted(kept) and kept[-1] == pytest.approx(1.0) and 0.5 < kept[1] < 1.0


def test_keys_shapes_and_metadata_follow_kohyas_layout(tmp_path, tiny_pipeline_dir, tuned_dir):

    base = load_pipeline(tiny_pipeline_dir)
    extraction = extract_lora(weights_of(tiny_pipeline_dir), weights_of(tuned_dir), rank=4, conv_rank=2)
    lora_file = tmp_path / "lora.safetensors"
    save_lora(extraction, lora_metadata(weights_of(tuned_dir), 4, 2, "my_lora"), lora_file)
    tensors = load_file(lora_file)
    assert all(KEY.match(key) for key in tensors) and all(tensor.dtype == torch.float16 for tensor in tensors.values())
    names = {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.removesuffix(".alpha") for key in tensors}
    # A UNet layer is named as in the original (ldm) layout A1111 and ComfyUI map LoRA keys onto: its weight's
    # name in our single-file export with dots as underscores. Text encoders by their Hugging Face names.
    single_file = pipeline_to_single_file(base)
    ldm_layers = {key.removeprefix(UNET_PREFIX).removesuffix(".weight").replace(".", "_") for key in single_file if key.startswith(UNET_PREFIX)}
    unet_names = {name.removeprefix("lora_unet_") for name in names if name.startswith("lora_unet_")}
    assert unet_names <= ldm_layers
    assert {"input_blocks_3_1_transformer_blocks_0_attn2_to_k", "middle_block_1_proj_in", "output_blocks_1_1_transformer_blocks_0_ff_net_0_proj",
            "input_blocks_1_0_in_layers_2", "input_blocks_1_0_emb_layers_1", "input_blocks_2_0_op", "output_blocks_1_2_conv",
            "output_blocks_0_0_skip_connection"} <= unet_names
    assert not any(name.startswith(("conv_in", "out_2", "time_embed", "label_emb")) or "norm" in name for name in unet_names)
    for prefix, encoder in (("lora_te1_", base.text_encoder), ("lora_te2_", base.text_encoder_2)):
        expected = {name if name.startswith("text_model.") else f"text_model.{name}" for name in target_layers(encoder, TEXT_ENCODER_BLOCKS)}
        assert {name.removeprefix(prefix) for name in names if name.startswith(prefix)} == {name.replace(".", "_") for name in expected}
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj" in names and "lora_te2_text_model_encoder_layers_1_mlp_fc2" in names
    # Shapes: down (r, in[, kh, kw]), up (out, r[, 1, 1]), alpha = r; 3x3 convolutions at conv_rank.
    assert tensors["lora_unet_middle_block_1_proj_in.lora_down.weight"].shape == (4, 64)
    assert tensors["lora_unet_middle_block_1_proj_in.lora_up.weight"].shape == (64, 4)
    assert tensors["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"].shape == (2, 32, 3, 3)
    assert tensors["lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight"].shape == (32, 2, 1, 1)
    assert tensors["lora_unet_output_blocks_0_0_skip_connection.lora_down.weight"].shape == (4, 128, 1, 1)
    assert float(tensors["lora_unet_input_blocks_1_0_in_layers_2.alpha"]) == 2 and float(tensors["lora_unet_middle_block_1_proj_in.alpha"]) == 4
    with safe_open(str(lora_file), "pt") as opened:
        metadata = opened.metadata()
    assert metadata["ss_network_module"] == "networks.lora" and metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"]) == ("4", "4.0")
    assert json.loads(metadata["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "2.0"}
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora" and metadata["modelspec.title"] == "my_lora"


@pytest.mark.slow
def test_cli_takes_a_single_file_fine_tune_and_leaves_unchanged_text_encoders_out(tmp_path, tiny_pipeline_dir, capsys):
    """The usual case: a UNet-only fine-tune exported as one fp16 file. Its text encoders differ from the fp32
    base only by rounding, so they are left out; conv_in, which no LoRA key carries, is named as left out."""
    import sdxl_extract_lora
    import sdxl_to_single_file

    tuned = load_pipeline(tiny_pipeline_dir)
    generator = torch.Generator().manual_seed(3)
    add_low_rank_change(tuned.unet, UNET_ATTENTION_BLOCKS, generator)
    with torch.no_grad():
        tuned.unet.conv_in.weight += 0.003 * torch.randn(tuned.unet.conv_in.weight.shape, generator=generator)
    tuned.save_pretrained(tmp_path / "tuned")
    tuned_file = tmp_path / "tuned.safetensors"
    assert sdxl_to_single_file.main(["--pipeline", str(tmp_path / "tuned"), "--output", str(tuned_file), "--save_precision", "fp16"]) == 0
    output = tmp_path / "loras" / "extracted.safetensors"
    argv = ["--base", str(tiny_pipeline_dir), "--tuned", str(tuned_file), "--single_file_config", str(tiny_pipeline_dir), "--rank", "4", "--output", str(output)]
    assert sdxl_extract_lora.main(argv) == 0
    printed = capsys.readouterr().out
    tensors = load_file(output)
    assert tensors and all(key.startswith("lora_unet_") for key in tensors) and all(tensor.dtype == torch.float16 for tensor in tensors.values())
    assert not any("in_layers" in key or "_op." in key for key in tensors)  # no --conv_rank: transformer blocks only
    assert "text_encoder: left out" in printed and "text_encoder_2: left out" in printed
    assert re.search(r"unet: \d+ layers; the LoRA keeps \d+\.\d% of their weight change", printed)
    assert re.search(r"no LoRA key carries.*:\n  unet\.conv_in\.weight: 0\.0\d+\n", printed)
    base = load_pipeline(tiny_pipeline_dir)
    before = relative_error(unet_output(base.unet), unet_output(tuned.unet))
    base.load_lora_weights(str(output))
    assert relative_error(unet_output(base.unet), unet_output(tuned.unet)) < 0.5 * before


def test_cli_refuses_bad_flags_before_loading_anything(tmp_path, capsys):
    import sdxl_extract_lora

    with pytest.raises(SystemExit):
        sdxl_extract_lora.main(["--base", str(tmp_path / "missing"), "--tuned", str(tmp_path), "--rank", "0", "--conv_rank", "-1",
                                "--output", str(tmp_path / "lora.ckpt"), "--device", "gpu"])
    error = capsys.readouterr().err
    for expected in ("--base", "does not exist", "--output must end in .safetensors", "--rank must be at least 1", "--conv_rank must be >= 0", "--device 'gpu'"):
        assert expected in error


@pytest.fixture(scope="module")
def tuned_file(tmp_path_factory, tuned_dir):
    """tuned_dir exported as one fp16 file, as the trainer's --save_single_file writes it."""
    import sdxl_to_single_file

    output = tmp_path_factory.mktemp("tuned_file") / "tuned.safetensors"
    assert sdxl_to_single_file.main(["--pipeline", str(tuned_dir), "--output", str(output), "--save_precision", "fp16"]) == 0
    return output


def refused(argv: list[str], capsys) -> str:
    """sdxl_extract_lora's one-line refusal (SystemExit) for argv, as printed."""
    import sdxl_extract_lora

    with pytest.raises(SystemExit) as info:
        sdxl_extract_lora.main(argv)
    return str(info.value if isinstance(info.value.code, str) else "") + capsys.readouterr().err


def test_the_output_never_replaces_an_input(tmp_path, tiny_pipeline_dir, tuned_file, capsys):
    """--output naming the fine-tuned file (the issue: 21 MB model -> 90 KB LoRA, exit 0), the same file by
    another path or a hard link, or a file inside a model folder, is refused before anything is written."""
    original = tuned_file.read_bytes()
    base = tmp_path / "base"
    shutil.copytree(tiny_pipeline_dir, base)
    link = tmp_path / "link.safetensors"
    os.link(tuned_file, link)
    common = ["--single_file_config", str(tiny_pipeline_dir), "--rank", "2"]
    cases = [
        (tuned_file, f"is the --tuned file {tuned_file}"),
        (tuned_file.parent / ".." / tuned_file.parent.name / tuned_file.name, f"is the --tuned file {tuned_file}"),
        (link, f"is the --tuned file {tuned_file}"),
        (base / "unet" / "diffusion_pytorch_model.safetensors", f"is inside the --base model folder {base}"),
        (base / "lora.safetensors", f"is inside the --base model folder {base}"),
    ]
    for output, message in cases:
        error = refused(["--base", str(base), "--tuned", str(tuned_file), *common, "--output", str(output)], capsys)
        assert f"--output {output} {message}" in error, error
    with_base_file = refused(["--base", str(tuned_file), "--tuned", str(base), *common, "--output", str(link)], capsys)
    assert f"--output {link} is the --base file {tuned_file}" in with_base_file
    assert tuned_file.read_bytes() == original and not (base / "lora.safetensors").exists()


def test_a_base_folder_that_is_not_a_model_is_named_with_what_a_model_folder_holds(tmp_path, tuned_dir, capsys):
    (tmp_path / "not_a_model" / "unet").mkdir(parents=True)
    error = refused(["--base", str(tmp_path / "not_a_model"), "--tuned", str(tuned_dir), "--rank", "2", "--output", str(tmp_path / "lora.safetensors")], capsys)
    assert f"--base {tmp_path / 'not_a_model'} is a folder but not a diffusers model: it has no model_index.json" in error, error
    assert "unet/, text_encoder/, text_encoder_2/ and vae/" in error and "Traceback" not in error


def test_a_single_file_whose_config_is_not_at_hand_offline_says_how_to_give_it(tmp_path, tuned_file, capsys):
    """HF_HUB_OFFLINE is set in the tests: a hub config that is not cached cannot describe the file."""
    argv = ["--base", str(tuned_file), "--tuned", str(tuned_file), "--rank", "2", "--output", str(tmp_path / "lora.safetensors")]
    error = refused([*argv, "--single_file_config", "someone/an-sdxl-model-not-cached"], capsys)
    assert f"--base {tuned_file} is a single file, whose architecture --single_file_config someone/an-sdxl-model-not-cached describes" in error, error
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in error
    assert "Give --single_file_config a diffusers folder" in error and "huggingface-cli download someone/an-sdxl-model-not-cached --include '*.json'" in error


def test_the_device_is_the_gpu_when_there_is_one(tmp_path, tiny_pipeline_dir, tuned_dir):
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.extract_config import ExtractConfig

    config = parse_config(ExtractConfig, ["--base", str(tiny_pipeline_dir), "--tuned", str(tuned_dir), "--rank", "2", "--output", str(tmp_path / "l.safetensors")])
    assert config.device == "auto" and config.resolved_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.slow
def test_unchanged_layers_are_skipped_and_only_changed_ones_are_in_the_file(tmp_path, tiny_pipeline_dir, capsys):
    """A fine-tune that changed two layers, exported in fp16: every other layer equals the fp32 base rounded to
    fp16, so it is skipped (no SVD, no key); the two changed ones are in the file and load in diffusers."""
    import sdxl_extract_lora
    import sdxl_to_single_file

    tuned = load_pipeline(tiny_pipeline_dir)
    layers = target_layers(tuned.unet, UNET_ATTENTION_BLOCKS)
    changed = ["down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", "mid_block.attentions.0.proj_out"]
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name in changed:
            weight = layers[name].weight
            weight += 0.2 * weight.std() * torch.randn(weight.shape[0], 1, generator=generator) @ torch.randn(1, weight.shape[1], generator=generator)
    tuned.save_pretrained(tmp_path / "tuned")
    tuned_file = tmp_path / "tuned.safetensors"
    assert sdxl_to_single_file.main(["--pipeline", str(tmp_path / "tuned"), "--output", str(tuned_file), "--save_precision", "fp16"]) == 0
    output = tmp_path / "lora.safetensors"
    argv = ["--base", str(tiny_pipeline_dir), "--tuned", str(tuned_file), "--single_file_config", str(tiny_pipeline_dir), "--rank", "4", "--output", str(output)]
    assert sdxl_extract_lora.main(argv) == 0
    printed = capsys.readouterr().out
    ldm = unet_ldm_names([f"{name}.weight" for name in changed], dict(tuned.unet.config))
    expected = {"lora_unet_" + ldm[f"{name}.weight"].removesuffix(".weight").replace(".", "_") for name in changed}
    assert {key.split(".")[0] for key in load_file(output)} == expected
    assert f"unet: 2 layers; the LoRA keeps 100.0% of their weight change" in printed
    assert f"{len(layers) - 2} unchanged layers skipped (equal to --base's in float16, the coarser of the two files' dtypes)" in printed
    base = load_pipeline(tiny_pipeline_dir)
    before = relative_error(unet_output(base.unet), unet_output(tuned.unet))
    base.load_lora_weights(str(output))
    assert relative_error(unet_output(base.unet), unet_output(tuned.unet)) < 0.05 * before


@pytest.mark.slow
def test_a_base_the_tuned_model_was_not_fine_tuned_from_is_warned_about(tmp_path, tiny_pipeline_dir, capsys):
    """Same architecture, other weights (the tiny pipeline of another seed): the LoRA is written, with a warning
    whose figure says why."""
    import sdxl_extract_lora
    from sdxl_trainer.models.tiny import save_tiny_pipeline

    other = save_tiny_pipeline(tmp_path / "other", seed=1)
    output = tmp_path / "lora.safetensors"
    assert sdxl_extract_lora.main(["--base", str(tiny_pipeline_dir), "--tuned", str(other), "--rank", "2", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    warning = re.search(r"Warning: (\d+) of (\d+) UNet layers changed by more than 50% of their weights' norm", printed)
    assert warning and int(warning[1]) > 0.5 * int(warning[2]), printed
    assert "is --base the model the fine-tune started from" in printed and output.exists()


def test_sharded_weights_read_as_the_model_saved_them(tmp_path, tiny_pipeline_dir):
    """diffusers shards a component above its max_shard_size (SDXL's fp32 UNet, 10.3 GB, is two shards): the
    reader follows the index, and every weight reads back as the model holds it."""
    from sdxl_trainer.models.weight_files import open_model_weights

    pipeline = load_pipeline(tiny_pipeline_dir)
    pipeline.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert len(list((tmp_path / "sharded" / "unet").glob("*.safetensors"))) > 2
    weights = open_model_weights(str(tmp_path / "sharded"), "--base", str(tmp_path / "sharded")).weights
    for component in ("unet", "vae"):
        state = getattr(pipeline, component).state_dict()
        assert weights[component].keys() == state.keys()
        assert all(torch.equal(weights[component][name].read(), state[name]) for name in state), component


@pytest.mark.slow
def test_a_single_file_reads_back_every_weight_of_every_component(tmp_path, tiny_pipeline_dir):
    """The single-file names read backwards: ldm UNet and VAE names (attention as 1x1 convolutions), CLIP-L's
    Hugging Face names, OpenCLIP's fused q/k/v thirds and transposed projection."""
    import sdxl_to_single_file
    from sdxl_trainer.models.single_file import hf_clip_names
    from sdxl_trainer.models.weight_files import open_model_weights

    single_file = tmp_path / "model.safetensors"
    assert sdxl_to_single_file.main(["--pipeline", str(tiny_pipeline_dir), "--output", str(single_file), "--save_precision", "fp32"]) == 0
    weights = open_model_weights(str(single_file), "--tuned", str(tiny_pipeline_dir)).weights
    pipeline = load_pipeline(tiny_pipeline_dir)
    for component in ("unet", "vae", "text_encoder", "text_encoder_2"):
        state = getattr(pipeline, component).state_dict()
        state = hf_clip_names(state) if component.startswith("text") else state
        assert weights[component].keys() == state.keys(), component
        assert all(torch.equal(weights[component][name].read(), state[name]) for name in state), component


def test_the_lora_tool_refuses_object_storage_and_replaces_only_a_lora_it_wrote(tmp_path, tiny_pipeline_dir, tuned_dir, capsys, monkeypatch):
    """--output s3://... is refused (it wrote into a local s3: folder); an existing --output is replaced when it is
    a LoRA this tool wrote (its metadata says so), any other file only with --overwrite, refused before loading."""
    import sdxl_extract_lora
    from safetensors.torch import save_file

    from sdxl_trainer.runtime.tensor_files import WRITER_KEY

    monkeypatch.chdir(tmp_path)
    common = ["--base", str(tiny_pipeline_dir), "--tuned", str(tuned_dir), "--rank", "2"]
    error = refused([*common, "--output", "s3://bucket/loras/tuned.safetensors"], capsys)
    assert error.splitlines()[-1].endswith(
        "error: argument --output: s3://bucket/loras/tuned.safetensors: writing to object storage is not supported yet; write a local file "
        "and copy it to the bucket (aws s3 cp, rclone)"
    )
    assert list(tmp_path.iterdir()) == []
    output = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_up.weight": torch.ones(2, 1)}, str(output), metadata={"ss_network_module": "networks.lora"})  # kohya's
    kohyas = output.read_bytes()
    error = refused([*common, "--output", str(output)], capsys)
    assert (
        f"--output {output} exists and was not written by this tool (its metadata has no {WRITER_KEY} = lora): choose another name, "
        "or add --overwrite to replace it"
    ) in error
    assert output.read_bytes() == kohyas
    assert sdxl_extract_lora.main([*common, "--output", str(output), "--overwrite"]) == 0
    with safe_open(str(output), framework="pt") as handle:
        assert handle.metadata()[WRITER_KEY] == "lora" and "lora_unet_x.lora_up.weight" not in handle.keys()
    assert sdxl_extract_lora.main(["--base", str(tiny_pipeline_dir), "--tuned", str(tuned_dir), "--rank", "1", "--output", str(output)]) == 0
    assert load_file(output)["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"].shape[0] == 1  # its own LoRA: replaced


def a1111_applied_layers(lora_names: set[str], single_file_keys) -> set[str]:
    """The layers of a kohya-layout SDXL LoRA that AUTOMATIC1111's built-in Lora extension applies to a model
    whose single file holds `single_file_keys`: its rule transcribed (extensions-builtin/Lora/networks.py:
    load_network's name matching, network_apply_weights), not run; A1111 is no dependency of ours.
    - A1111 names a model's modules by their single-file paths, dots as underscores: the UNet's after
      `diffusion_model_`, CLIP-L's after `0_transformer_`, OpenCLIP-G's after `1_model_`.
    - lora_unet_X is the UNet module X; lora_te1_text_model_X CLIP-L's text_model_X: each Linear or Conv2d
      applies its own change when it runs.
    - lora_te2_text_model_encoder_layers_N_Y is OpenCLIP's resblock N, Y renamed (self_attn -> attn, mlp_fc1 ->
      mlp_c_fc, mlp_fc2 -> mlp_c_proj). The MLP's Linears apply theirs. The attention is one nn.MultiheadAttention
      (q, k, v fused in in_proj_weight; out_proj's weight used without out_proj running): q/k/v keys match the
      attention module by their prefix, and the attention applies its change only when all four of its
      projections, q, k, v and out_proj, are in the LoRA; otherwise none of them."""
    prefixes = {UNET_PREFIX: "diffusion_model.", CLIP_L_PREFIX: "0.transformer.", CLIP_G_PREFIX: "1.model."}
    modules = {(ours + key.rsplit(".", 1)[0].removeprefix(theirs)).replace(".", "_")
               for key in single_file_keys for theirs, ours in prefixes.items() if key.startswith(theirs)}
    applied, attention_parts = set(), {}
    for name in lora_names:
        if name.startswith("lora_unet_") and "diffusion_model_" + name.removeprefix("lora_unet_") in modules:
            applied.add(name)
        elif name.startswith("lora_te1_text_model_") and "0_transformer_" + name.removeprefix("lora_te1_") in modules:
            applied.add(name)
        elif match := re.fullmatch(r"lora_te2_text_model_encoder_layers_(\d+)_(.+)", name):
            rest = match.group(2).replace("self_attn", "attn").replace("mlp_fc1", "mlp_c_fc").replace("mlp_fc2", "mlp_c_proj")
            module = f"1_model_transformer_resblocks_{match.group(1)}_{rest}"
            projection = re.fullmatch(r"(.*_attn)_(q_proj|k_proj|v_proj|out_proj)", module)
            if projection and projection.group(1) in modules:
                attention_parts.setdefault(projection.group(1), {})[projection.group(2)] = name
            elif module in modules:
                applied.add(name)
    for parts in attention_parts.values():
        if set(parts) == {"q_proj", "k_proj", "v_proj", "out_proj"}:
            applied.update(parts.values())
    return applied


def test_a_change_in_one_projection_loads_whole_in_diffusers_and_a1111(tmp_path, tiny_pipeline_dir):
    """Extraction skips unchanged layers, so a text-encoder attention layer could appear with only some of its
    projections: diffusers then dropped q/k/v with only a warning (an MLP key but no out_proj) or refused the file
    (q/k/v alone: ValueError), and A1111 applies OpenCLIP-G's attention only with q, k, v and out_proj all there.
    Each such layer's missing projections are written as zero factors: every loader applies every layer of the
    file, the zeros add exactly 0, and the text encoders come out as the tuned ones."""
    import logging

    from peft.tuners.lora import LoraLayer

    tuned = load_pipeline(tiny_pipeline_dir)
    generator = torch.Generator().manual_seed(5)
    changed = [  # one projection of an attention layer each, and an MLP layer beside an attention layer's projection
        (tuned.text_encoder_2, "text_model.encoder.layers.0.self_attn.q_proj"),
        (tuned.text_encoder, "text_model.encoder.layers.0.self_attn.v_proj"),
        (tuned.text_encoder, "text_model.encoder.layers.1.mlp.fc1"),
        (tuned.unet, "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"),
    ]
    with torch.no_grad():
        for model, name in changed:
            layer = {hf_clip_name(key) if model is not tuned.unet else key: module for key, module in model.named_modules()}[name]
            layer.weight += 0.5 * layer.weight.std() * torch.randn(layer.weight.shape[0], 1, generator=generator) @ torch.randn(1, layer.weight.shape[1], generator=generator)
    tuned.save_pretrained(tmp_path / "tuned")
    extraction = extract_lora(weights_of(tiny_pipeline_dir), weights_of(tmp_path / "tuned"), FULL_RANK, dtype=torch.float32)
    lora_file = tmp_path / "lora.safetensors"
    save_lora(extraction, lora_metadata(weights_of(tmp_path / "tuned"), FULL_RANK, 0, "one_projection"), lora_file)
    tensors = load_file(lora_file)
    names = {key.split(".")[0] for key in tensors}
    base = load_pipeline(tiny_pipeline_dir)
    assert a1111_applied_layers(names, pipeline_to_single_file(base)) == names
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in ("diffusers", "peft")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        base.load_lora_weights(str(lora_file))
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert warnings == []  # no key left unconverted or unexpected
    with_adapter = set()  # the file's names of the layers that got a LoRA adapter
    for model, prefix in ((base.unet, "lora_unet_"), (base.text_encoder, "lora_te1_"), (base.text_encoder_2, "lora_te2_")):
        for key, module in model.named_modules():
            if isinstance(module, LoraLayer) and module.lora_A:
                name = unet_ldm_names([f"{key}.weight"], dict(base.unet.config))[f"{key}.weight"].removesuffix(".weight") if model is base.unet else hf_clip_name(key)
                with_adapter.add(prefix + name.replace(".", "_"))
    assert with_adapter == names
    for output, target in zip(text_outputs(base), text_outputs(tuned)):
        assert relative_error(output, target) < 1e-5
    assert relative_error(unet_output(base.unet), unet_output(tuned.unet)) < 1e-5
    attention = "lora_te{}_text_model_encoder_layers_0_self_attn_{}"
    expected = {attention.format(encoder, projection) for encoder in (1, 2) for projection in ("q_proj", "k_proj", "v_proj", "out_proj")}
    expected |= {"lora_te1_text_model_encoder_layers_1_mlp_fc1", "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q"}
    assert names == expected
    for encoder, real in ((2, "q_proj"), (1, "v_proj")):
        rank = tensors[f"{attention.format(encoder, real)}.lora_down.weight"].shape[0]
        for projection in {"q_proj", "k_proj", "v_proj", "out_proj"} - {real}:
            padded = attention.format(encoder, projection)
            assert not tensors[f"{padded}.lora_up.weight"].any() and not tensors[f"{padded}.lora_down.weight"].any()
            assert tensors[f"{padded}.lora_down.weight"].shape[0] == rank and float(tensors[f"{padded}.alpha"]) == rank
    assert (extraction.components["text_encoder"].padded, extraction.components["text_encoder_2"].padded) == (3, 3)

