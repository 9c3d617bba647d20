"""Caption mode (--encode_captions_each_step): several captions per image, tag shuffling with --keep_tokens,
tag dropout, all seeded per sample; the text encoders in the step give the cached embeddings' values; the
varied captions change training (its 2-process bitwise resume is in test_text_encoder_training.py)."""

from __future__ import annotations

import math
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir, run_processes, scalars, trainer_flags
from trainer_runs import VARIATION_FLAGS

from sdxl_trainer.cache.format import LOG_DIR
from sdxl_trainer.cache.reader import load_manifest
from sdxl_trainer.models.encoders import load_text_encoders
from sdxl_trainer.training.captions import CaptionVariation, StepCaptionEncoder, caption_generator, vary_caption
from sdxl_trainer.training.dataset import CachedDataset, collate

TAGS = "1girl, solo, long hair, smile, outdoors, blue sky, cloud, tree"


def draws(text: str, variation: CaptionVariation, count: int = 400) -> list[str]:
    return [vary_caption(text, caption_generator(5, epoch, 3), variation) for epoch in range(count)]


def test_without_tag_changes_the_caption_is_kept_exactly():
    assert set(draws("a  photo,of a cat ,", CaptionVariation())) == {"a  photo,of a cat ,"}


def test_the_same_sample_gets_the_same_caption_and_another_epoch_another():
    variation = CaptionVariation(shuffle_tags=True, keep_tags=1, tag_dropout=0.2)
    first = [vary_caption(TAGS, caption_generator(5, epoch, 3), variation) for epoch in range(20)]
    again = [vary_caption(TAGS, caption_generator(5, epoch, 3), variation) for epoch in range(20)]
    assert first == again
    assert len(set(first)) > 15  # epochs differ


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_shuffling_keeps_the_first_tags_and_permutes_the_rest(keep):
    tags = TAGS.split(", ")
    results = draws(TAGS, CaptionVariation(shuffle_tags=True, keep_tags=keep))
    for result in results:
        got = result.split(", ")
        assert got[:keep] == tags[:keep]
        assert sorted(got[keep:]) == sorted(tags[keep:])
    orders = math.factorial(len(tags) - keep)  # 40320, 5040 and 120
    assert len(set(results)) >= min(300, 0.9 * orders)


def test_tag_dropout_drops_the_rate_of_the_tags_after_the_kept_ones():
    tags = TAGS.split(", ")
    results = [result.split(", ") for result in draws(TAGS, CaptionVariation(keep_tags=2, tag_dropout=0.25), count=2000)]
    assert all(result[:2] == tags[:2] for result in results)
    kept_share = sum(len(result) - 2 for result in results) / (2000 * 6)
    assert kept_share == pytest.approx(0.75, abs=0.03)
    assert all(result[2:] == [tag for tag in tags[2:] if tag in result[2:]] for result in results)  # order kept without shuffling
    assert set(draws(TAGS, CaptionVariation(keep_tags=1, tag_dropout=1.0), count=5)) == {"1girl"}


def test_one_of_several_captions_is_chosen_uniformly():
    counts = Counter(draws("a cat\nfluffy cat, sofa\nphoto of a cat", CaptionVariation(), count=3000))
    assert set(counts) == {"a cat", "fluffy cat, sofa", "photo of a cat"}
    assert all(count == pytest.approx(1000, abs=120) for count in counts.values())


def test_encoding_in_the_step_gives_the_cached_embeddings(sample_cache_dir, tiny_pipeline_dir):
    """Without variation, caption mode conditions on what the cache holds (stored in fp16)."""
    dataset = CachedDataset([sample_cache_dir])
    bucket_ids = dataset.bucket_ids()
    largest = np.bincount(np.unique(bucket_ids, return_inverse=True)[1]).argmax()
    items = np.flatnonzero(np.unique(bucket_ids, return_inverse=True)[1] == largest)[:3]  # one batch is one bucket
    batch = collate([dataset[int(item)] for item in items])
    encoder = StepCaptionEncoder(
        load_text_encoders(str(tiny_pipeline_dir), torch.device("cpu"), torch.float32), dataset.caption_texts, CaptionVariation(), 5, 1, torch.device("cpu")
    )
    encoded, empty = encoder(batch, epoch=0)
    assert empty is None  # frozen encoders: caption dropout keeps the cached empty caption
    assert encoded["prompt_embeds"].shape == batch["prompt_embeds"].shape
    for key in ("prompt_embeds", "pooled_prompt_embeds"):
        cached = batch[key].float()
        assert torch.allclose(encoded[key], cached, atol=2e-3 * cached.abs().max().item()), key
    assert torch.equal(encoded["latents"], batch["latents"])


def test_a_caches_caption_prefix_is_in_its_embeddings_and_around_every_varied_caption_of_it_only(tmp_path, tag_cache, tiny_pipeline_dir, capsys):
    """--caption_prefix/--caption_suffix at caching (a trigger word): the cached embeddings encode the framed
    caption, caption mode frames each varied caption of that cache (never of another) after shuffling and
    dropout, so the trigger word is always first, and the cache refuses to go on with another prefix."""

    prefixed = tmp_path / "prefixed"
    flags = ["--data_dir", str(SAMPLE_DATASET), "--cache_dir", str(prefixed), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
             *SAMPLE_RESOLUTION_FLAGS]
    assert process_data_dir([*flags, "--caption_prefix", "ohwx,", "--caption_suffix", "by someone"]) == 0
    dataset = CachedDataset([tag_cache, prefixed])
    from_prefixed = dataset.cache_index == 1

    variation = CaptionVariation(shuffle_tags=True, tag_dropout=0.5)
    varied = StepCaptionEncoder((None, None), dataset.caption_texts, variation, 5, 1, torch.device("cpu"), framing=dataset.framed)
    for epoch in range(20):
        for item, caption in enumerate(varied.draws.captions_for(list(range(len(dataset))), epoch)):
            framed = caption.startswith("ohwx, ") and caption.endswith(" by someone")
            assert framed == bool(from_prefixed[item]) and caption.count("ohwx") == framed, caption

    bucket_ids = dataset.bucket_ids()
    first_bucket = bucket_ids[from_prefixed][0]
    items = np.flatnonzero(from_prefixed & (bucket_ids == first_bucket))[:3]
    batch = collate([dataset[int(item)] for item in items])
    text_side = load_text_encoders(str(tiny_pipeline_dir), torch.device("cpu"), torch.float32)
    framed_now = StepCaptionEncoder(text_side, dataset.caption_texts, CaptionVariation(), 5, 1, torch.device("cpu"), framing=dataset.framed)
    bare_now = StepCaptionEncoder(text_side, dataset.caption_texts, CaptionVariation(), 5, 1, torch.device("cpu"))
    cached = batch["pooled_prompt_embeds"].float()
    tolerance = 2e-3 * cached.abs().max().item()
    assert torch.allclose(framed_now.first_captions(batch)["pooled_prompt_embeds"], cached, atol=tolerance)
    assert not torch.allclose(bare_now.first_captions(batch)["pooled_prompt_embeds"], cached, atol=tolerance)

    capsys.readouterr()
    assert process_data_dir([*flags, "--caption_prefix", "sks,"]) == 2
    assert "caption_prefix: cache 'ohwx,', now 'sks,'" in capsys.readouterr().out


# ---- a tag dataset with several captions per image (conftest's tag_cache), trained on 2 processes -----


def test_the_cache_keeps_every_caption_and_says_which_one_it_encoded(tag_cache):
    captions = load_manifest(tag_cache).column("caption").to_pylist()
    several = [caption for caption in captions if "\n" in caption]
    assert several and all(len(caption.split("\n")) == 2 for caption in several)
    log = "".join(path.read_text() for path in (tag_cache / LOG_DIR).glob("errors-*.log"))
    assert log.count("2 captions (one per line): the cached embeddings encode the first") == len(several)


@pytest.mark.multiprocess
def test_varied_captions_change_what_is_learned(tmp_path, tag_cache, tiny_pipeline_dir):
    """The same 3 updates (1 process) on the varied captions and on the cached embeddings end apart. Caption
    mode with this variation resumes bitwise on 2 processes in test_text_encoder_training.py."""

    def losses(name: str, *extra: str) -> list[float]:
        flags = trainer_flags(tag_cache, tiny_pipeline_dir, tmp_path, name, "--optimizer", "adamw", "--max_train_updates", "3", "--no-validation_loss", *extra)
        run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", flags)
        return scalars(tmp_path / name, "train/loss")

    varied, cached = losses("varied", *VARIATION_FLAGS), losses("cached")
    assert len(varied) == len(cached) == 3
    assert varied != cached


@pytest.mark.multiprocess
def test_caption_variation_without_caption_mode_is_refused(tmp_path, tag_cache, tiny_pipeline_dir):
    flags = trainer_flags(tag_cache, tiny_pipeline_dir, tmp_path, "refused", "--shuffle_caption", "--keep_tokens", "2")
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", flags, expect_success=False)
    assert result.returncode != 0
    assert "--shuffle_caption, --keep_tokens vary captions at every step, which needs --encode_captions_each_step" in result.stderr + result.stdout


def test_each_cache_can_vary_its_captions_its_own_way(tmp_path, tag_cache, capsys):
    """--dataset_shuffle_caption / --dataset_keep_tokens / --dataset_caption_tag_dropout_rate: one value per cache
    (from flags or TOML), the run-wide flag for caches without one; each item's captions vary as its cache says."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig

    copy = tmp_path / "copy_of_the_cache"  # one cache named twice is refused; a copy is a cache of its own
    shutil.copytree(tag_cache, copy)
    twice = ["--cached_dataset_dirs", str(tag_cache), str(copy), "--encode_captions_each_step", "--keep_tokens", "1"]
    config = parse_config(TrainConfig, [*twice, "--dataset_shuffle_caption", "true", "false", "--dataset_caption_tag_dropout_rate", "0.5", "0"])
    variations = config.caption_variations()
    assert variations == [CaptionVariation(True, 1, 0.5), CaptionVariation(False, 1, 0.0)]
    toml = tmp_path / "run.toml"
    toml.write_text("dataset_shuffle_caption = [true, false]\ndataset_caption_tag_dropout_rate = [0.5, 0]\n")
    assert parse_config(TrainConfig, [*twice, "--config", str(toml)]).caption_variations() == variations

    dataset = CachedDataset([tag_cache, copy])
    encoder = StepCaptionEncoder((None, None), dataset.caption_texts, lambda item: variations[dataset.cache_index[item]], 5, 1, torch.device("cpu"))
    changed = Counter()
    for epoch in range(20):
        for item, caption in enumerate(encoder.draws.captions_for(list(range(len(dataset))), epoch)):
            written = dataset.caption_texts[item].split("\n")
            assert caption.split(", ")[0] == "sample"  # --keep_tokens 1 in both
            changed[int(dataset.cache_index[item])] += caption not in written
    assert changed[1] == 0 and changed[0] > 10 * len(dataset) // 2

    for flags, message in (
        (["--dataset_keep_tokens", "1"], "--dataset_keep_tokens needs one value per --cached_dataset_dirs entry (2), got 1"),
        (["--dataset_caption_tag_dropout_rate", "0.5", "2"], "--caption_tag_dropout_rate and --dataset_caption_tag_dropout_rate are shares between 0 and 1"),
        (["--no-encode_captions_each_step", "--dataset_shuffle_caption", "true", "false"], "--dataset_shuffle_caption vary captions at every step"),
        (["--dataset_shuffle_caption", "maybe", "no"], "'maybe' is not true or false"),
    ):
        with pytest.raises(SystemExit):
            parse_config(TrainConfig, [*twice, *flags])
        assert message in capsys.readouterr().err, flags
