"""Captions longer than CLIP's 75 tokens: encoded in chunks of 75 (--max_token_length 150 / 225) by the
cache and by the trainer's sample prompts, never cut silently (the cache log names every cut caption), and
caches of different lengths refused together."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir, run_processes, trainer_flags
from diffusers import StableDiffusionXLPipeline
from safetensors import safe_open

from sdxl_trainer.cache.format import LOG_DIR, SHARD_DIR, read_cache_info
from sdxl_trainer.cache.reader import read_empty_prompt
from sdxl_trainer.models.encoders import encode_prompts

# 40 comma-separated tags: well over 75 tokens, under 150 (counted in the test).
LONG_CAPTION = ", ".join(f"{colour} {shape}" for colour in ("red", "blue", "green", "pink", "white") for shape in
                         ("circle", "square", "triangle", "stripe", "star", "ring", "cross", "heart"))


@pytest.fixture(scope="module")
def text_side(tiny_pipeline_dir):
    pipeline = StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_dir)
    return (pipeline.tokenizer, pipeline.tokenizer_2), (pipeline.text_encoder, pipeline.text_encoder_2)


def token_count(tokenizer, caption: str) -> int:
    return len(tokenizer(caption, add_special_tokens=False, verbose=False).input_ids)


@torch.no_grad()
def sdxl_usual_encoding(tokenizers, encoders, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoding SDXL pipelines do: 77 tokens, truncated; penultimate layers side by side; encoder 2's pooled."""
    hidden, pooled = [], None
    for tokenizer, encoder in zip(tokenizers, encoders):
        ids = tokenizer(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        output = encoder(ids, output_hidden_states=True)
        hidden.append(output.hidden_states[-2])
        pooled = output[0]
    return torch.cat(hidden, dim=-1), pooled


@torch.no_grad()
def encoded_chunk(tokenizers, encoders, token_ids: list[int]) -> torch.Tensor:
    """One chunk as CLIP sees it alone: <start>, the tokens, <end>, padding; both encoders side by side."""
    hidden = []
    for tokenizer, encoder in zip(tokenizers, encoders):
        ids = [tokenizer.bos_token_id, *token_ids, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * (75 - len(token_ids))
        hidden.append(encoder(torch.tensor([ids]), output_hidden_states=True).hidden_states[-2])
    return torch.cat(hidden, dim=-1)[0]


def test_one_chunk_is_sdxls_usual_encoding(text_side):
    tokenizers, encoders = text_side
    captions = ["a red circle", "", LONG_CAPTION]
    assert token_count(tokenizers[0], LONG_CAPTION) > 75
    encoded = encode_prompts(tokenizers, encoders, captions, chunks=1, device=torch.device("cpu"))
    embeds, pooled = sdxl_usual_encoding(tokenizers, encoders, captions)
    assert encoded.prompt_embeds.shape == (3, 77, embeds.shape[-1])
    assert torch.equal(encoded.prompt_embeds, embeds) and torch.equal(encoded.pooled_prompt_embeds, pooled)
    assert encoded.token_counts == [token_count(tokenizers[0], caption) for caption in captions]


def test_long_captions_are_encoded_in_chunks_of_75_tokens(text_side):
    tokenizers, encoders = text_side
    ids = tokenizers[0](LONG_CAPTION, add_special_tokens=False, verbose=False).input_ids
    assert 75 < len(ids) <= 150
    assert tokenizers[1](LONG_CAPTION, add_special_tokens=False, verbose=False).input_ids == ids  # SDXL's tokenizers share CLIP's BPE
    encoded = encode_prompts(tokenizers, encoders, [LONG_CAPTION, "a red circle"], chunks=2, device=torch.device("cpu"))
    assert encoded.prompt_embeds.shape[:2] == (2, 154)
    assert encoded.token_counts[0] == len(ids)
    one_chunk = encode_prompts(tokenizers, encoders, [LONG_CAPTION], chunks=1, device=torch.device("cpu"))
    # the first chunk is the usual encoding (the first 75 tokens), the second the rest encoded on its own
    # (batches of other sizes round the last bits differently)
    assert torch.allclose(encoded.prompt_embeds[0, :77], one_chunk.prompt_embeds[0], atol=1e-6)
    assert torch.allclose(encoded.prompt_embeds[0, 77:], encoded_chunk(tokenizers, encoders, ids[75:]), atol=1e-6)
    assert not torch.allclose(encoded.prompt_embeds[0, 77:], encoded.prompt_embeds[0, :77], atol=1e-3)
    # pooled from the first chunk; a short caption's second chunk is an empty one
    assert torch.allclose(encoded.pooled_prompt_embeds[0], one_chunk.pooled_prompt_embeds[0], atol=1e-6)
    assert torch.allclose(encoded.prompt_embeds[1, 77:], encoded_chunk(tokenizers, encoders, []), atol=1e-6)


def long_caption_dataset(folder: Path) -> Path:
    folder.mkdir()
    for index in range(4):
        shutil.copy(SAMPLE_DATASET / f"sample_{index:02d}.jpg", folder)
        shutil.copy(SAMPLE_DATASET / f"sample_{index:02d}.txt", folder)
    (folder / "sample_01.txt").write_text(LONG_CAPTION)
    return folder


def cache_with(data_dir: Path, cache_dir: Path, pipeline_dir: Path, max_token_length: int) -> int:
    return process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline_dir),
         *SAMPLE_RESOLUTION_FLAGS, "--max_token_length", str(max_token_length)]
    )


@pytest.fixture(scope="module")
def long_caption_caches(tmp_path_factory, tiny_pipeline_dir) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("long_captions")
    data_dir = long_caption_dataset(root / "data")
    caches = {length: root / f"cache_{length}" for length in (75, 150)}
    for length, cache_dir in caches.items():
        assert cache_with(data_dir, cache_dir, tiny_pipeline_dir, length) == 0
    return caches


def cache_log(cache_dir: Path) -> str:
    return "".join(path.read_text() for path in (cache_dir / LOG_DIR).glob("errors-*.log"))


def test_the_cache_names_every_caption_it_cuts(long_caption_caches, tiny_pipeline_dir):
    log = cache_log(long_caption_caches[75])
    count = token_count(StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_dir).tokenizer, LONG_CAPTION)
    assert log == f"sample_01.jpg: caption of {count} tokens cut to its first 75: raise --max_token_length (150 or 225) or shorten the caption\n"
    assert cache_log(long_caption_caches[150]) == ""  # 150 tokens hold it: nothing cut, no log


def test_the_cache_holds_the_chunked_embeddings(long_caption_caches, text_side):
    cache_dir = long_caption_caches[150]
    assert read_cache_info(cache_dir).text_max_length == 154
    assert read_empty_prompt(cache_dir)[0].shape[0] == 154
    tokenizers, encoders = text_side
    expected = encode_prompts(tokenizers, encoders, [LONG_CAPTION], chunks=2, device=torch.device("cpu"))
    found = False
    for shard in (cache_dir / SHARD_DIR).glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            for key in (key for key in handle.keys() if key.endswith("/prompt_embeds")):
                embeds = handle.get_tensor(key)
                assert embeds.shape[0] == 154
                if torch.allclose(embeds.float(), expected.prompt_embeds[0], atol=1e-2):
                    found = True
    assert found, "the long caption's two-chunk embedding is not in the cache"


def test_another_length_on_an_existing_cache_is_refused(long_caption_caches, tiny_pipeline_dir, tmp_path, capsys):
    data_dir = long_caption_dataset(tmp_path / "data")
    assert cache_with(data_dir, long_caption_caches[150], tiny_pipeline_dir, 75) == 2
    assert "text_max_length: cache 154, now 77" in capsys.readouterr().out


def test_bad_lengths_are_refused_naming_the_flag(tmp_path, tiny_pipeline_dir, capsys):
    data_dir = long_caption_dataset(tmp_path / "data")
    with pytest.raises(SystemExit):
        cache_with(data_dir, tmp_path / "cache", tiny_pipeline_dir, 100)
    assert "--max_token_length must be a multiple of 75 (75, 150 or 225), got 100" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_the_trainer_trains_on_long_captions_and_refuses_mixed_lengths(long_caption_caches, tiny_pipeline_dir, tmp_path):
    """A 150-token cache trains, and its sample prompts (one of them the long caption) are encoded with the
    same chunk rule; a 75- and a 150-token cache together are refused before anything loads."""
    flags = trainer_flags(long_caption_caches[150], tiny_pipeline_dir, tmp_path, "long", "--num_train_epochs", "1", "--optimizer", "adamw",
                          "--save_samples", "--num_sample_images", "2", "--num_inference_steps", "2", "--no-save_state")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{LONG_CAPTION}\na red circle\n")
    run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", [*flags, "--sample_prompts", str(prompts)])
    assert (tmp_path / "long" / "samples" / "sample_grid.png").is_file()

    mixed = trainer_flags(long_caption_caches[75], tiny_pipeline_dir, tmp_path, "mixed", "--num_train_epochs", "1")
    mixed[mixed.index("--cached_dataset_dirs") + 1 : mixed.index("--cached_dataset_dirs") + 2] = [str(long_caption_caches[75]), str(long_caption_caches[150])]
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", mixed, expect_success=False)
    assert result.returncode != 0
    assert "the caches were encoded with different --max_token_length (75, 150): re-cache them with one" in result.stderr + result.stdout
