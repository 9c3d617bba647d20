"""Sample grid: one row per call, old rows untouched (lossless PNG), prompt header and row labels, images of
any shape letterboxed into square cells, prompts from the shipped file topped up with captions, per-line
prompt options (kohya's syntax) and their effect on the generated images, the sampling schedule."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image, PngImagePlugin

from sdxl_trainer.evaluation.sample_grid import BACKGROUND, CELL_SIZE, LABEL_WIDTH, METADATA_KEY, append_grid_row, header_height, is_due
from sdxl_trainer.evaluation.sample_prompts import DEFAULT_SAMPLE_PROMPTS, SamplePrompt, choose_sample_prompts, column_seeds, read_prompts

PROMPTS = ["a red circle on a very long caption that has to be wrapped over several lines and then cut short " * 3, "a blue square", "stripes"]


def row_images(seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 96, 64), (3, 64, 64), (3, 48, 112)]  # portrait, square, landscape
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) for shape in shapes]


def read(path) -> np.ndarray:
    with Image.open(path) as saved:
        return np.array(saved.convert("RGB"))


def test_grid_grows_by_one_row_per_call_and_keeps_old_rows(tmp_path):
    path = tmp_path / "samples" / "grid.png"
    append_grid_row(path, row_images(0), "base", PROMPTS)
    first = read(path)
    assert first.shape == (header_height() + CELL_SIZE, LABEL_WIDTH + 3 * CELL_SIZE, 3)
    header = first[: header_height(), LABEL_WIDTH:]
    assert (header < 128).any(), "the prompts are written in the header"
    assert (first[header_height() :, :LABEL_WIDTH] < 128).any(), "the row has its label"
    previous = first
    for epoch in (2, 4):
        append_grid_row(path, row_images(epoch), f"epoch {epoch}", PROMPTS)
        grid = read(path)
        assert grid.shape[0] == previous.shape[0] + CELL_SIZE and grid.shape[1] == previous.shape[1]
        assert np.array_equal(grid[: previous.shape[0]], previous), "old rows changed"
        assert not np.array_equal(grid[-CELL_SIZE:, LABEL_WIDTH:], previous[-CELL_SIZE:, LABEL_WIDTH:])
        previous = grid
    with Image.open(path) as saved:
        assert '"labels": ["base", "epoch 2", "epoch 4"]' in saved.text["sdxl_trainer_sample_grid"]


def test_tensorboard_gets_the_header_over_each_new_row(tmp_path):
    """Each step logs the prompt header over that step's row, not the whole grid again (which grew the event
    file with the square of the rows)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sdxl_trainer.monitoring.metrics_writer import MetricsWriter

    path = tmp_path / "grid.png"
    writer = MetricsWriter(tmp_path / "tb", enabled=True)
    for step in range(3):
        writer.image("samples/grid", append_grid_row(path, row_images(step), f"epoch {step}", PROMPTS), step)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    logged = events.Images("samples/grid")
    grid = read(path)
    assert [(image.step, image.width, image.height) for image in logged] == [(step, grid.shape[1], header_height() + CELL_SIZE) for step in range(3)]
    last = np.array(Image.open(io.BytesIO(logged[-1].encoded_image_string)).convert("RGB"))
    assert np.array_equal(last, np.concatenate([grid[: header_height()], grid[-CELL_SIZE:]]))


def test_grid_refuses_other_prompts(tmp_path):
    path = tmp_path / "grid.png"
    append_grid_row(path, row_images(0), "base", PROMPTS)
    with pytest.raises(ValueError, match="other sample prompts"):
        append_grid_row(path, row_images(1), "epoch 1", ["x", "y", "z"])


def test_prompts_come_from_the_shipped_file_topped_up_with_captions():
    assert DEFAULT_SAMPLE_PROMPTS.name == "sample_prompts.txt" and DEFAULT_SAMPLE_PROMPTS.parent.joinpath("sdxl_FSDP_train.py").exists()
    from_file, notes = read_prompts(DEFAULT_SAMPLE_PROMPTS)
    assert len(from_file) == 4 and notes == [] and not any(prompt.text.startswith("#") for prompt in from_file)
    captions = [f"caption {i}" for i in range(10)] + [from_file[0].text]
    prompts = choose_sample_prompts(from_file, captions, 7, seed=3)
    assert prompts[:4] == from_file and len({prompt.text for prompt in prompts}) == 7
    assert prompts == choose_sample_prompts(from_file, captions, 7, seed=3)
    assert choose_sample_prompts(from_file, captions, 2, seed=3) == from_file[:2]
    seeds = column_seeds(prompts[:3], 5)
    assert seeds == column_seeds(prompts[:3], 5) and len(set(seeds)) == 3


def test_schedule():
    due = [epoch for epoch in range(0, 11) if is_due(epoch, every_n_epochs=3, start_epoch=4, num_epochs=10)]
    assert due == [0, 6, 9, 10]
    assert [epoch for epoch in range(0, 5) if is_due(epoch, every_n_epochs=0)] == [0]
    assert [epoch for epoch in range(0, 5) if is_due(epoch, every_n_epochs=1)] == [0, 1, 2, 3, 4]


# ---- per-line prompt options ------------------------------------------------------------------------------

PROMPT_FILE = """# sample prompts
a red fox in snow --w 832 --h 1216 --d 1234 --l 6.5 --s 28 --n blurry, low quality
a lighthouse at night --W 1000 --D 7

a lighthouse at night --d 8
a bowl of fruit -- still life, oil on canvas --s 12
a bowl of fruit -- still life, oil on canvas --s 12
"""


def test_prompt_lines_take_kohya_options_and_keep_their_order(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPT_FILE, encoding="utf-8")
    prompts, notes = read_prompts(path)
    assert prompts == [
        SamplePrompt("a red fox in snow", width=832, height=1216, seed=1234, guidance_scale=6.5, steps=28, negative="blurry, low quality"),
        SamplePrompt("a lighthouse at night", width=1024, seed=7),  # names are case-insensitive, as in kohya
        SamplePrompt("a lighthouse at night", seed=8),  # the same prompt with another seed is another column
        SamplePrompt("a bowl of fruit -- still life, oil on canvas", steps=12),  # "--" before a space is prompt text
        SamplePrompt("a bowl of fruit -- still life, oil on canvas", steps=12),
    ]
    assert notes == [f"{path}:3: --w 1000 rounded to 1024 px (sample sizes are multiples of 64)"]
    columns = choose_sample_prompts(prompts, ["a lighthouse at night", "a dog"], 5, seed=0)
    assert columns == [*prompts[:4], SamplePrompt("a dog")]  # a repeated line is one column; captions fill up
    seeds = column_seeds(columns, 11)
    assert seeds[:3] == [1234, 7, 8] and seeds == column_seeds(columns, 11) and seeds[3] != seeds[4]
    assert columns[0].options_text() == "832x1216, seed 1234, cfg 6.5, 28 steps, neg: blurry, low quality"
    assert columns[1].options_text() == "width 1024, seed 7" and columns[4].options_text() == ""


def test_bad_prompt_lines_are_one_error_naming_each_line(tmp_path, capsys):
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig

    path = tmp_path / "prompts.txt"
    path.write_text("a cat --w 512\na dog --ss euler_a\n--w 512 --h 512\na fox --s 0\na tree --l high --l 3\na cow --n\nan owl --d 1 --d 2\n", encoding="utf-8")
    with pytest.raises(ValueError) as error:
        read_prompts(path)
    assert str(error.value).splitlines()[1:] == [
        f"  {path}:2: unknown option --ss (known: --w width, --h height, --d seed, --l guidance scale, --s steps, --n negative prompt)",
        f"  {path}:3: no prompt before the options",
        f"  {path}:4: --s '0' must be from 1 to 1000",
        f"  {path}:5: --l 'high' is not a number",
        f"  {path}:6: --n needs a value",
        f"  {path}:7: --d is given twice",
    ]
    # The trainer refuses the file while validating its flags, before any model or cache is read.
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "missing_cache", "--sample_prompts", str(path)])
    assert f"{path}:2: unknown option --ss" in capsys.readouterr().err
    parse_config(TrainConfig, ["--cached_dataset_dirs", "missing_cache", "--sample_prompts", str(path), "--no-save_samples"])


def test_cells_of_any_shape_are_letterboxed_and_options_are_part_of_the_grid(tmp_path):
    path = tmp_path / "grid.png"
    images = row_images(0)  # portrait 64x96, square, landscape 112x48
    options = ["64x96, seed 3", "", "112x48, cfg 2"]
    append_grid_row(path, images, "base", PROMPTS, options=options)
    grid = read(path)
    top = header_height()
    portrait, landscape = (grid[top : top + CELL_SIZE, LABEL_WIDTH + column * CELL_SIZE :][:, :CELL_SIZE] for column in (0, 2))
    # The portrait image fills the cell's height, centred between background columns; the landscape its width.
    bar = (CELL_SIZE - round(64 * CELL_SIZE / 96)) // 2
    assert (portrait[:, : bar - 1] == BACKGROUND).all() and (portrait[:, -(bar - 1) :] == BACKGROUND).all()
    assert not (portrait[:, bar + 1 : -(bar + 1)] == BACKGROUND).all(axis=-1).all(axis=0).any()
    bar = (CELL_SIZE - round(48 * CELL_SIZE / 112)) // 2
    assert (landscape[: bar - 1] == BACKGROUND).all() and (landscape[-(bar - 1) :] == BACKGROUND).all()
    assert not (landscape[bar + 1 : -(bar + 1)] == BACKGROUND).all(axis=-1).all(axis=1).any()
    with Image.open(path) as saved:
        assert '"options": ["64x96, seed 3", "", "112x48, cfg 2"]' in saved.text[METADATA_KEY]
    with pytest.raises(ValueError, match="other sample prompts, prompt options"):
        append_grid_row(path, row_images(1), "epoch 1", PROMPTS, options=["64x96, seed 4", "", "112x48, cfg 2"])
    append_grid_row(path, row_images(1), "epoch 1", PROMPTS, options=options)


def test_a_grid_started_before_prompt_options_takes_rows_without_options(tmp_path):
    """Grids written before per-line options have no "options" in their record: their columns had none."""
    path = tmp_path / "grid.png"
    append_grid_row(path, row_images(0), "base", PROMPTS)
    with Image.open(path) as saved:
        record = saved.text[METADATA_KEY]
        old = saved.copy()
    info = PngImagePlugin.PngInfo()
    info.add_text(METADATA_KEY, record.replace(', "options": ["", "", ""]', ""))
    old.save(path, pnginfo=info)
    append_grid_row(path, row_images(1), "epoch 1", PROMPTS)
    with pytest.raises(ValueError, match="prompt options"):
        append_grid_row(path, row_images(2), "epoch 2", PROMPTS, options=["64x96", "", ""])


@pytest.fixture(scope="module")
def tiny_sampler(tiny_pipeline_dir):
    """The tiny pipeline, and encode(texts) -> [(prompt_embeds, pooled)] by the trainer's rule."""
    from diffusers import StableDiffusionXLPipeline

    from sdxl_trainer.models.encoders import encode_prompts

    pipeline = StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_dir)
    pipeline.set_progress_bar_config(disable=True)

    def encode(texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            encoded = encode_prompts((pipeline.tokenizer, pipeline.tokenizer_2), (pipeline.text_encoder, pipeline.text_encoder_2), texts, 1, torch.device("cpu"))
        return list(zip(encoded.prompt_embeds, encoded.pooled_prompt_embeds))

    return pipeline, encode


def test_each_request_is_generated_with_its_own_size_seed_steps_guidance_and_negative(tiny_sampler):
    """Requests of mixed sizes, step counts and guidance scales in one call of generate(): every image comes
    back under its key at its own size; each option changes the image it is set on and nothing else (the
    same request alone, or batched with others, gives the same image)."""
    from sdxl_trainer.evaluation.sampling import GenerationSettings, ImageRequest, generate

    pipeline, encode = tiny_sampler
    (fox, empty, blurry) = encode(["a red fox in snow", "", "blurry, low quality"])
    settings = GenerationSettings(num_inference_steps=2, guidance_scale=5.0, batch_size=4)
    base = ImageRequest(0, *fox, width=64, height=128, seed=1)
    variants = {
        "base": base,
        "landscape": replace(base, width=128, height=64),
        "seed": replace(base, seed=2),
        "steps": replace(base, num_inference_steps=3),
        "guidance": replace(base, guidance_scale=1.0),
        "negative": replace(base, negative=blurry),
        "same": replace(base),
    }
    requests = [replace(request, key=key) for key, request in enumerate(variants.values())]
    images = dict(zip(variants, (image for _, image in sorted(generate(pipeline, requests, settings, empty, torch.device("cpu")).items()))))
    assert images["base"].shape == (3, 128, 64) and images["landscape"].shape == (3, 64, 128)
    assert all(image.dtype == torch.uint8 and image.shape == images["base"].shape for name, image in images.items() if name != "landscape")
    alone = generate(pipeline, [base], settings, empty, torch.device("cpu"))[0]
    assert (alone.int() - images["base"].int()).abs().max() <= 1  # batching changes float rounding only
    assert (images["same"].int() - images["base"].int()).abs().max() <= 1
    for option in ("seed", "steps", "guidance", "negative"):
        assert (images[option].int() - images["base"].int()).abs().float().mean() > 2, option
    explicit = generate(pipeline, [replace(base, num_inference_steps=2, guidance_scale=5.0, negative=empty)], settings, blurry, torch.device("cpu"))[0]
    assert torch.equal(explicit, alone)  # unset options are the settings' and generate()'s negative
