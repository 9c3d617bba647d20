"""The exported model as other tools read it: the diffusers folder under the older stack kohya sd-scripts pins
(transformers 4.54, diffusers 0.32), and the files beside a single-file export.

The project's environment holds transformers 5 only, and a second environment with 4.x in CI would cost
minutes of installs per run, so these tests pin down what 4.x reads instead (which files, which weight names,
which variant names); each was also checked by hand once with transformers 4.54.1 and diffusers 0.32.2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, run_processes, trainer_flags
from safetensors.torch import load_file

PROMPTS = ["a photo of a cat", "Ein Hund, der über die Straße läuft!!", "portrait, 85mm, f/1.8, (masterpiece:1.2)", ""]
# The files transformers 4.x's slow CLIPTokenizer reads; it never opens tokenizer.json.
SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def single_file_base(tmp_path_factory, tiny_pipeline_dir) -> Path:
    import sdxl_to_single_file

    base_file = tmp_path_factory.mktemp("base") / "base.safetensors"
    assert sdxl_to_single_file.main(["--pipeline", str(tiny_pipeline_dir), "--output", str(base_file), "--save_precision", "fp32"]) == 0
    return base_file


@pytest.fixture(scope="module")
def fp16_export(tmp_path_factory, tiny_pipeline_dir, single_file_base) -> Path:
    """An fp16 folder export whose base model was a single file: diffusers' single-file loader builds the
    text encoders, the case that lost the `text_model.` names."""
    from sdxl_trainer.outputs.export import save_pipeline

    output_dir = tmp_path_factory.mktemp("export") / "pipeline"
    save_pipeline({}, str(single_file_base), output_dir, "fp16", single_file_config=str(tiny_pipeline_dir), model_title="test")
    return output_dir


def test_tokenizers_load_from_the_files_the_slow_tokenizer_reads(fp16_export, tmp_path):
    """transformers 4.x loads the pipeline's CLIPTokenizer (model_index.json names it) as the slow, Python
    tokenizer, which reads vocab.json and merges.txt and fails without them; transformers 5 saves only
    tokenizer.json. Loaded from the slow tokenizer's files alone, the installed CLIPTokenizer must give the
    exported tokenizer's ids, padding included (tokenizer_2 pads with "!")."""
    from transformers import CLIPTokenizer

    for name in ("tokenizer", "tokenizer_2"):
        slow_files = tmp_path / name
        slow_files.mkdir()
        for file in SLOW_TOKENIZER_FILES:
            shutil.copy(fp16_export / name / file, slow_files)
        # 4.x's slow tokenizer skips the first line of merges.txt, the "#version" header.
        assert (slow_files / "merges.txt").read_text(encoding="utf-8").startswith("#version")
        exported, from_vocabulary = CLIPTokenizer.from_pretrained(fp16_export / name), CLIPTokenizer.from_pretrained(slow_files)
        assert from_vocabulary.special_tokens_map == exported.special_tokens_map
        for prompt in PROMPTS:
            settings = dict(padding="max_length", max_length=exported.model_max_length, truncation=True)
            assert from_vocabulary(prompt, **settings).input_ids == exported(prompt, **settings).input_ids, (name, prompt)


def test_a_process_reads_a_models_tokenizers_once_until_their_files_change(tiny_pipeline_dir, tmp_path):
    from sdxl_trainer.models.single_file import load_pipeline, load_tokenizers

    model = shutil.copytree(tiny_pipeline_dir, tmp_path / "model")
    pipeline = load_pipeline(str(model), str(model), torch.float32)
    first = load_tokenizers(str(model))
    assert first == (pipeline.tokenizer, pipeline.tokenizer_2)  # the same objects: read once
    assert load_pipeline(str(model), str(model), torch.float32).tokenizer is first[0]
    settings_file = model / "tokenizer_2" / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text(encoding="utf-8"))
    assert settings["model_max_length"] == 77
    settings_file.write_text(json.dumps({**settings, "model_max_length": 60}), encoding="utf-8")
    changed = load_tokenizers(str(model))
    assert changed[1] is not first[1] and changed[1].model_max_length == 60  # read again: its file changed
    assert first[1].model_max_length == 77


def test_text_encoder_weights_have_the_names_transformers_4_loads(fp16_export, tiny_pipeline_dir):
    """transformers 4.x's CLIPTextModel holds its layers under `text_model.` (as its save_pretrained and the
    SDXL base repository write them); without the prefix 4.x loads CLIP-L with random weights and only warns.
    transformers 5's CLIPTextModel dropped that wrapper and puts the prefix back on save only for a model it
    loaded from a file that had it, not for one built by diffusers' single-file loader."""
    from diffusers import StableDiffusionXLPipeline

    base = StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_dir, torch_dtype=torch.float16)
    for name in ("text_encoder", "text_encoder_2"):
        written = load_file(fp16_export / name / "model.safetensors")
        base_weights = getattr(base, name).state_dict()
        expected = {key if key.startswith(("text_model.", "text_projection.")) else f"text_model.{key}": value for key, value in base_weights.items()}
        assert written.keys() == expected.keys(), name
        assert all(torch.equal(written[key], expected[key]) for key in expected), name
    reloaded = StableDiffusionXLPipeline.from_pretrained(fp16_export, torch_dtype=torch.float16)  # and transformers 5 still reads them
    for key, value in base.text_encoder.state_dict().items():
        assert torch.equal(reloaded.text_encoder.state_dict()[key], value), key


def _weight_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("*/*.safetensors") if not path.name.endswith(".fp16.safetensors"))


def test_fp16_export_also_loads_as_variant_fp16_in_no_extra_space(fp16_export):
    """kohya's folder loader asks diffusers for variant="fp16" at fp16 (`unet/diffusion_pytorch_model.fp16.safetensors`
    ...), a load without a variant reads the plain names; both name the same bytes (hard links)."""
    from diffusers import StableDiffusionXLPipeline

    weight_files = _weight_files(fp16_export)
    assert {path.parent.name for path in weight_files} == {"unet", "vae", "text_encoder", "text_encoder_2"}
    for plain in weight_files:
        assert plain.with_suffix(".fp16.safetensors").samefile(plain), plain
    variant = StableDiffusionXLPipeline.from_pretrained(fp16_export, variant="fp16", torch_dtype=torch.float16)
    plain = StableDiffusionXLPipeline.from_pretrained(fp16_export, torch_dtype=torch.float16)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert all(torch.equal(value, getattr(plain, name).state_dict()[key]) for key, value in getattr(variant, name).state_dict().items()), name


def test_fp16_variant_is_a_copy_where_hard_links_fail_and_absent_at_other_precisions(tmp_path, tiny_pipeline_dir, monkeypatch):
    from sdxl_trainer.outputs.export import save_pipeline

    save_pipeline({}, str(tiny_pipeline_dir), tmp_path / "bf16", "bf16", model_title="test")
    assert not list((tmp_path / "bf16").glob("*/*.fp16.safetensors"))

    def no_hard_links(source, target):
        raise PermissionError(1, "Operation not permitted", str(target))

    monkeypatch.setattr(os, "link", no_hard_links)  # as on file systems without hard links
    save_pipeline({}, str(tiny_pipeline_dir), tmp_path / "fp16", "fp16", model_title="test")
    for plain in _weight_files(tmp_path / "fp16"):
        variant = plain.with_suffix(".fp16.safetensors")
        assert not variant.samefile(plain) and variant.read_bytes() == plain.read_bytes(), plain


def test_single_file_export_carries_its_scheduler_config(tmp_path, tiny_pipeline_dir):
    """diffusers' from_single_file ignores the file's `v_pred` / `ztsnr` keys and samples an SDXL file as
    epsilon; with --no-save_diffusers, the scheduler config beside the file is what tells diffusers users
    the objective (docs/exporting.md: from_single_file, then the scheduler from this config)."""
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionXLPipeline

    from sdxl_trainer.outputs.export import save_pipeline

    single_file = tmp_path / "pipeline.safetensors"
    v_prediction = dict(prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing")
    save_pipeline({}, str(tiny_pipeline_dir), None, "fp32", v_prediction, single_file=single_file, model_title="test")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pipeline.safetensors", "pipeline.scheduler_config.json"]
    scheduler_config = json.loads((tmp_path / "pipeline.scheduler_config.json").read_text())
    pipeline = StableDiffusionXLPipeline.from_single_file(single_file, config=str(tiny_pipeline_dir))
    pipeline.scheduler = DPMSolverMultistepScheduler.from_config(scheduler_config)
    assert {key: pipeline.scheduler.config[key] for key in v_prediction} == v_prediction


def test_the_single_file_is_never_written_into_the_pipeline_it_converts(tiny_pipeline_dir, tmp_path, capsys):
    """No output of a script may be one of its inputs: a file inside --pipeline is refused before anything loads."""
    import sdxl_to_single_file

    pipeline = tmp_path / "pipeline"
    shutil.copytree(tiny_pipeline_dir, pipeline)
    before = sorted(path.relative_to(pipeline) for path in pipeline.rglob("*"))
    for output in (pipeline / "model.safetensors", pipeline / "unet" / "diffusion_pytorch_model.safetensors"):
        with pytest.raises(SystemExit):
            sdxl_to_single_file.main(["--pipeline", str(pipeline), "--output", str(output)])
        assert f"--output {output} is inside --pipeline {pipeline}" in capsys.readouterr().err
    assert sorted(path.relative_to(pipeline) for path in pipeline.rglob("*")) == before


def test_the_single_file_tool_refuses_object_storage_instead_of_writing_a_local_s3_folder(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    """--output s3://... was the local path s3:/bucket/...: the tool wrote there and said "Wrote s3:/...", so on a
    cloud node the model stayed on the scratch disk. Refused now, before anything loads, with what to do."""
    import sdxl_to_single_file

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:
        sdxl_to_single_file.main(["--pipeline", str(tiny_pipeline_dir), "--output", "s3://bucket/models/tuned.safetensors"])
    assert refused.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith(
        "error: argument --output: s3://bucket/models/tuned.safetensors: writing to object storage is not supported yet; write a local file "
        "and copy it to the bucket (aws s3 cp, rclone)"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_single_file_tool_replaces_only_a_file_it_wrote_unless_told_to(tiny_pipeline_dir, tmp_path, capsys):
    """An existing --output is replaced when its metadata says this project's single-file writer made it (a
    re-run, or the trainer's --save_single_file); any other file (another model, a LoRA, not safetensors at all)
    only with --overwrite. The refusal comes before anything loads and leaves the file as it was."""
    import sdxl_to_single_file
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sdxl_trainer.runtime.tensor_files import WRITER_KEY

    output = tmp_path / "model.safetensors"
    save_file({"weight": torch.ones(2)}, str(output), metadata={"format": "pt", "modelspec.title": "someone else's model"})
    unrelated = output.read_bytes()
    argv = ["--pipeline", str(tiny_pipeline_dir), "--output", str(output)]
    for content in (unrelated, b"not a safetensors file"):
        output.write_bytes(content)
        with pytest.raises(SystemExit) as refused:
            sdxl_to_single_file.main(argv)
        assert refused.value.code == 2
        assert (
            f"--output {output} exists and was not written by this tool (its metadata has no {WRITER_KEY} = single_file): choose another "
            "name, or add --overwrite to replace it"
        ) in capsys.readouterr().err
        assert output.read_bytes() == content
    assert sdxl_to_single_file.main([*argv, "--overwrite"]) == 0
    with safe_open(str(output), framework="pt") as handle:
        assert handle.metadata()[WRITER_KEY] == "single_file" and "model.diffusion_model.input_blocks.0.0.weight" in handle.keys()
    assert sdxl_to_single_file.main([*argv, "--save_precision", "fp32"]) == 0  # its own file: replaced
    with safe_open(str(output), framework="pt") as handle:
        assert handle.get_tensor("model.diffusion_model.input_blocks.0.0.weight").dtype == torch.float32


def test_an_export_names_its_base_model_as_users_know_it_not_by_a_local_path(tiny_pipeline_dir, fp16_export, single_file_base, tmp_path):
    """model_index.json's _name_or_path (and the UNet's and VAE's configs') recorded where the base model lay on
    the machine that exported it: the export names it by what users know, the hub id or the file or folder name
    (a folder of the Hugging Face cache by its model id)."""
    from sdxl_trainer.outputs.export import save_pipeline

    for base, export, name in ((tiny_pipeline_dir, tmp_path / "pipeline", "tiny_sdxl"), (single_file_base, fp16_export, "base.safetensors")):
        if base == tiny_pipeline_dir:
            save_pipeline({}, str(base), export, "fp32", model_title="test")
        assert json.loads((export / "model_index.json").read_text())["_name_or_path"] == name
        for component in ("unet", "vae"):
            assert json.loads((export / component / "config.json").read_text())["_name_or_path"] == name
        assert not [path for path in export.rglob("*.json") if str(base.parent) in path.read_text()]
    from sdxl_trainer.outputs.export import known_model_name

    snapshot = tmp_path / "hub" / "models--stabilityai--stable-diffusion-xl-base-1.0" / "snapshots" / "462165984030d82259a11f4367a4eed129e94a7b"
    snapshot.mkdir(parents=True)
    (tmp_path / "my_models" / "sdxl_base").mkdir(parents=True)
    assert known_model_name(str(snapshot)) == "stabilityai/stable-diffusion-xl-base-1.0"
    assert known_model_name(str(tmp_path / "my_models" / "sdxl_base") + "/") == "sdxl_base"
    assert known_model_name("stabilityai/stable-diffusion-xl-base-1.0") == "stabilityai/stable-diffusion-xl-base-1.0"  # a hub id stays


# ---- non-finite weights -----------------------------------------------------------------------------------


def test_weights_that_are_not_finite_are_never_exported_and_the_earlier_export_stays(tmp_path, tiny_pipeline_dir):
    """A run whose last update blew the weights up exported a UNet of NaN/inf with exit code 0, over the last good
    export. Now the export names the first tensor that is not finite (at the export precision: an fp32 value past
    fp16's 65,504 is inf in the file) and writes nothing, so the earlier export stays whole."""
    from sdxl_trainer.outputs.export import ExportError, save_pipeline

    unet = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    names = list(unet)
    output_dir = tmp_path / "pipeline"
    save_pipeline({"unet": unet}, str(tiny_pipeline_dir), output_dir, "fp32", model_title="good")
    good = {path.relative_to(output_dir): path.read_bytes() for path in output_dir.rglob("*") if path.is_file()}

    diverged = dict(unet)
    for name in names[3:]:
        diverged[name] = torch.full_like(unet[name], float("nan"))
    diverged[names[5]] = torch.full_like(unet[names[5]], float("inf"))
    with pytest.raises(ExportError) as refused:
        save_pipeline({"unet": diverged}, str(tiny_pipeline_dir), output_dir, "fp32", single_file=tmp_path / "pipeline.safetensors", model_title="bad")
    message = str(refused.value)
    assert message.startswith(f"Not exporting the model to {output_dir} and {tmp_path / 'pipeline.safetensors'}: its weights are not finite.")
    assert f"UNet tensor {names[3]}: all {unet[names[3]].numel():,} values are NaN or inf at fp32" in message
    assert "earlier export there is kept" in message and "--load_saved_state" in message
    assert {path.relative_to(output_dir): path.read_bytes() for path in output_dir.rglob("*") if path.is_file()} == good
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pipeline"]  # no single file, no temporary folder

    too_large = dict(unet)
    too_large[names[7]] = unet[names[7]].clone()
    too_large[names[7]].view(-1)[:2] = torch.tensor([1e6, -3e5])  # finite in fp32, inf in fp16
    with pytest.raises(ExportError) as refused:
        save_pipeline({"unet": too_large}, str(tiny_pipeline_dir), output_dir, "fp16", model_title="bad")
    assert f"UNet tensor {names[7]}: 2 of {unet[names[7]].numel():,} values are NaN or inf at fp16" in str(refused.value)
    assert "its trained values are finite, up to 1e+06, beyond fp16's largest (65504)" in str(refused.value)
    assert {path.relative_to(output_dir): path.read_bytes() for path in output_dir.rglob("*") if path.is_file()} == good


@pytest.mark.multiprocess
def test_a_two_process_run_whose_weights_diverged_exports_nothing_and_says_why(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """The export is a collective: rank 0 gathers the weights and finds them not finite, every rank stops with its
    message (exit code 1), and the state is saved before it (the run's end saves the state, then exports)."""
    flags = trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "diverged", "--optimizer", "adamw", "--learning_rate", "1e30",
                          "--learning_rate_scheduler", "constant", "--max_train_updates", "1", "--save_diffusers", "--save_precision", "fp16")
    result = run_processes(2, REPO_ROOT / "sdxl_FSDP_train.py", flags, expect_success=False)
    assert result.returncode == 1
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"Not exporting the model to {tmp_path / 'diverged' / 'pipeline'}: its weights are not finite. UNet tensor "), last
    assert "values are NaN or inf at fp16 (its trained values are finite, up to 1e+30" in last
    assert not (tmp_path / "diverged" / "pipeline").exists()
    assert (tmp_path / "diverged" / "checkpoints" / "update_00000001" / "trainer_state.json").is_file()
