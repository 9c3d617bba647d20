"""--train_text_encoder: both text encoders train with the UNet in caption mode, each at its own peak rate
(0 keeps one frozen), sharded on 2 processes, on a caption-file cache and a Parquet-table cache together; a resumed run equals
the straight one bitwise for all three models; the pipeline folder and the single file hold the trained
encoders; a checkpoint with trained encoders is resumed only with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, run_processes, scalars, trainer_flags
from safetensors.torch import load_file
from trainer_runs import RESUME_AT, VARIATION_FLAGS, exported_unet, resumed_copy, train
from unet_batches import trainer_state_for

from sdxl_trainer.cache.reader import load_manifest
from sdxl_trainer.config import parse_config
from sdxl_trainer.models.single_file import hf_clip_names
from sdxl_trainer.state.checkpoint_layout import METADATA_FILE, CheckpointError
from sdxl_trainer.state.trainer_state import TrainerState
from sdxl_trainer.training.lr_schedule import LR_SCALE, set_learning_rate

TEXT_ENCODER_FILES = {name: Path(name) / "model.safetensors" for name in ("text_encoder", "text_encoder_2")}


def exported_text_encoders(pipeline_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each encoder's weights under the standard `text_model.` names, which the export writes and the tiny
    base model (built by transformers 5, whose CLIPTextModel dropped that wrapper) lacks."""
    return {name: hf_clip_names(load_file(pipeline_dir / path)) for name, path in TEXT_ENCODER_FILES.items()}


def bitwise_equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.multiprocess
def test_trained_encoders_resume_bitwise_and_are_exported(tmp_path, tag_cache, table_cache, tiny_pipeline_dir):
    """Multi-line tag captions and a Parquet table's tags (with score tags, repeated 2.5 times an epoch),
    shuffled and dropped, train the UNet and both encoders on 2 processes: 4 updates of 5 microbatches
    (inside the first epoch), resumed after the second."""
    caches = [tag_cache, table_cache]
    assert any(caption.startswith("scr300, table, ") for caption in load_manifest(table_cache).column("caption").to_pylist())
    flags = (*VARIATION_FLAGS, "--train_text_encoder", "--learning_rate_te2", "5e-5", "--save_single_file", "--dataset_repeats", "1", "2.5",
             "--max_train_updates", "4")
    straight = train(tmp_path / "straight", caches, tiny_pipeline_dir, "cosine", *flags)
    resumed_copy(straight, tmp_path / "resumed")
    resumed = train(tmp_path / "resumed", caches, tiny_pipeline_dir, "cosine", *flags, "--load_saved_state", "latest")

    assert len(scalars(straight, "train/loss")) == 4
    assert scalars(resumed, "train/loss") == scalars(straight, "train/loss")[RESUME_AT:]
    assert bitwise_equal(exported_unet(straight), exported_unet(resumed))
    trained, base = exported_text_encoders(straight / "pipeline"), exported_text_encoders(tiny_pipeline_dir)
    for name, weights in exported_text_encoders(resumed / "pipeline").items():
        assert bitwise_equal(weights, trained[name]), f"the resumed run's {name} differs from the straight run's"
        assert not bitwise_equal(weights, base[name]), f"{name} was not trained"
    assert all(key.startswith(("unet.", "text_encoder.", "text_encoder_2.")) for key in read_checkpoint_keys(straight))

    # The single file beside the folder holds the same trained encoders (both CLIPs, converted back).
    from sdxl_trainer.models.single_file import load_pipeline

    single = load_pipeline(str(straight / "pipeline.safetensors"), str(tiny_pipeline_dir), torch.float32)
    for name, weights in trained.items():
        assert bitwise_equal({key: value for key, value in hf_clip_names(getattr(single, name).state_dict()).items() if key in weights}, weights), name

    # A checkpoint with trained encoders is not resumed as a UNet-only run.
    plain = [flag for flag in flags if flag not in ("--train_text_encoder", "--learning_rate_te2", "5e-5")]
    result = run_processes(
        1, REPO_ROOT / "sdxl_FSDP_train.py",
        trainer_flags(caches, tiny_pipeline_dir, tmp_path / "resumed", "run", *plain, "--load_saved_state", "latest"), expect_success=False,
    )
    assert result.returncode != 0
    assert "the checkpoint was saved with trained text encoders: resume with --train_text_encoder" in result.stdout + result.stderr


def read_checkpoint_keys(run: Path) -> list[str]:
    index = json.loads((run / "checkpoints" / f"update_{RESUME_AT:08d}" / METADATA_FILE).read_text())
    return [key.removeprefix("model.") for key in index["state_dict_metadata"] if key.startswith("model.")]


@pytest.mark.multiprocess
def test_a_rate_of_zero_keeps_that_encoder_frozen_and_the_other_trains(tmp_path, tag_cache, tiny_pipeline_dir):
    """One process (no sharding), bf16 autocast: --learning_rate_te1 0 (kohya's "0 = not trained") leaves
    CLIP-L exactly the base model's, in the export and out of the checkpoint, while bigG trains at the
    default rate; validation loss and the sample grid run through the trained encoder. The checkpoint is
    not resumed with CLIP-L trained."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sample, a red square --w 256 --h 256\nsample, a blue circle --w 256 --h 256\n")  # small: bf16 is slow on CPUs
    flags = trainer_flags(
        tag_cache, tiny_pipeline_dir, tmp_path, "rates", "--optimizer", "adamw", "--max_train_updates", "3", "--mixed_precision", "bf16",
        "--encode_captions_each_step", "--train_text_encoder", "--learning_rate_te1", "0", "--save_diffusers",
        "--save_samples", "--sample_prompts", str(prompts), "--num_sample_images", "2", "--num_inference_steps", "2",
    )
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", flags)
    assert "Training text encoder 2 at 0.0001 too (peak learning rates; the UNet's: 0.0001); text encoder 1 stays frozen (rate 0)." in result.stdout
    assert len(scalars(tmp_path / "rates", "val/loss")) == 2  # the base model's, then at the end (update 3)
    assert (tmp_path / "rates" / "samples" / "sample_grid.png").is_file()
    trained, base = exported_text_encoders(tmp_path / "rates" / "pipeline"), exported_text_encoders(tiny_pipeline_dir)
    assert bitwise_equal(trained["text_encoder"], base["text_encoder"])
    assert largest_change(trained["text_encoder_2"], base["text_encoder_2"]) > 1e-5
    checkpoint = sorted((tmp_path / "rates" / "checkpoints").glob("update_*"))[-1]
    keys = [key.removeprefix("model.") for key in json.loads((checkpoint / METADATA_FILE).read_text())["state_dict_metadata"] if key.startswith("model.")]
    assert any(key.startswith("text_encoder_2.") for key in keys) and not any(key.startswith("text_encoder.") for key in keys)

    resumed = [*flags[: flags.index("--learning_rate_te1")], "--load_saved_state", "latest"]
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", resumed, expect_success=False)
    assert result.returncode != 0
    assert "the checkpoint kept text encoder 1 frozen: resume with --learning_rate_te1 0" in result.stdout + result.stderr


def test_a_resume_keeps_which_encoders_train():
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.state.checkpointer import resume_problems

    def config(*flags: str) -> TrainConfig:
        return parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--encode_captions_each_step", "--train_text_encoder", *flags])

    def problems_resuming(saved, run: TrainConfig) -> list[str]:
        return resume_problems(saved, run.run_facts(world_size=1), run.set_seed)

    assert config("--learning_rate_te2", "3e-6").text_encoder_rates() == {"text_encoder": 1e-5, "text_encoder_2": 3e-6}
    assert config("--learning_rate_te2", "0").text_encoder_rates() == {"text_encoder": 1e-5}
    assert config("--learning_rate_te2", "0").frozen_text_encoder() == "text_encoder_2"
    both_trained = trainer_state_for(train_text_encoder=True)
    assert problems_resuming(both_trained, config()) == []
    assert problems_resuming(both_trained, config("--learning_rate_te2", "0")) == [
        "the checkpoint trained text encoder 2: resume with --learning_rate_te2 above 0 (0 keeps it frozen)"
    ]
    assert problems_resuming(trainer_state_for(train_text_encoder=True, frozen_text_encoder="text_encoder"), config("--learning_rate_te2", "0")) == [
        "the checkpoint kept text encoder 1 frozen: resume with --learning_rate_te1 0",
        "the checkpoint trained text encoder 2: resume with --learning_rate_te2 above 0 (0 keeps it frozen)",
    ]


def largest_change(trained: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    return max((trained[key] - base[key]).abs().max().item() for key in base)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--train_text_encoder"], "--train_text_encoder needs --encode_captions_each_step"),
        (["--encode_captions_each_step", "--learning_rate_te1", "1e-5"], "--learning_rate_te1 / --learning_rate_te2 apply to trained text encoders"),
        (["--encode_captions_each_step", "--train_text_encoder", "--learning_rate_te2=-1e-5"], "--learning_rate_te2 must be >= 0 (0 keeps that text encoder frozen)"),
        (["--encode_captions_each_step", "--train_text_encoder", "--learning_rate_te1", "0", "--learning_rate_te2", "0"],
         "--learning_rate_te1 and --learning_rate_te2 are both 0, so no text encoder trains: drop --train_text_encoder"),
        (["--encode_captions_each_step", "--train_text_encoder", "--learning_rate", "0"], "kohya's --learning_rate 0 (text encoders alone) is not supported"),
    ],
)
def test_text_encoder_options_are_checked(flags, message, capsys):
    from sdxl_trainer.jobs.train_config import TrainConfig

    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", *flags])
    assert message in capsys.readouterr().err


def test_the_schedule_scales_each_group_from_its_own_peak():
    optimizer = torch.optim.AdamW(
        [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(2))], LR_SCALE: 0.25}], lr=1e-4
    )
    set_learning_rate(optimizer, 2e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [2e-4, 5e-5]


def test_a_trainer_state_from_before_text_encoder_training_reads_as_unet_only(tmp_path):
    data = json.loads(trainer_state_for(train_text_encoder=True, frozen_text_encoder="text_encoder").to_json())
    read = TrainerState.from_json(json.dumps(data), tmp_path / "state.json")
    assert (read.train_text_encoder, read.frozen_text_encoder) == (True, "text_encoder")
    del data["train_text_encoder"], data["frozen_text_encoder"]
    read = TrainerState.from_json(json.dumps(data), tmp_path / "state.json")
    assert (read.train_text_encoder, read.frozen_text_encoder) == (False, "")
    with pytest.raises(CheckpointError, match="fields missing: \\['seed'\\]"):
        TrainerState.from_json(json.dumps({key: value for key, value in data.items() if key != "seed"}), tmp_path / "state.json")


def test_checkpointed_encoders_recompute_each_layer_and_give_the_same_gradients(tiny_pipeline_dir):
    from sdxl_trainer.models.encoders import encode_prompts, load_text_encoders

    gradients, forward_calls = [], []
    for checkpointed in (False, True):
        tokenizers, encoders = load_text_encoders(str(tiny_pipeline_dir), torch.device("cpu"), torch.float32, trained=(True, True), checkpointed=checkpointed)
        calls = []
        encoders[1].text_model.encoder.layers[0].mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
        encoded = encode_prompts(tokenizers, encoders, ["a red circle, flat", "a blue square"], 1, torch.device("cpu"))
        (encoded.prompt_embeds.square().mean() + encoded.pooled_prompt_embeds.square().mean()).backward()
        forward_calls.append(len(calls))
        gradients.append({
            (index, name): weight.grad for index, encoder in enumerate(encoders) for name, weight in encoder.named_parameters() if weight.requires_grad
        })
    assert forward_calls == [1, 2]  # checkpointed: the layer's MLP runs again in backward
    assert gradients[0].keys() == gradients[1].keys()
    assert all(torch.equal(gradients[0][name], gradients[1][name]) for name in gradients[0])
    # CLIP-L's last layer and final norm never reach the UNet: frozen, outside the gradients; its other layers train.
    last = f"encoder.layers.{len(encoders[0].encoder.layers) - 1}."
    clip_l_trained = [name for index, name in gradients[0] if index == 0]
    assert "encoder.layers.0.mlp.fc1.weight" in clip_l_trained
    assert not any(name.startswith((last, "final_layer_norm.")) for name in clip_l_trained)
