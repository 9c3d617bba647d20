"""The training data's options (caches, batches, run length) and the settings they make for load_training_data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from sdxl_trainer.cache.format import CacheLocation
from sdxl_trainer.cache.stores import cache_identity
from sdxl_trainer.config import option
from sdxl_trainer.training.dataset import DatasetOptions
from sdxl_trainer.training.epochs import MAX_EPOCHS
from sdxl_trainer.training.holdout import SplitSettings


@dataclass(kw_only=True)
class DataOptions:
    """Data: caches, batches, run length"""

    datasets: list[DatasetOptions] = option(
        [], help="the caches, one [[datasets]] table each in a TOML --config (keys: " + ", ".join(field.name for field in fields(DatasetOptions))
        + "); instead of --cached_dataset_dirs and the --dataset_* flags, not beside them",
    )
    cached_dataset_dirs: list[str] | None = option(
        None,
        help="caches written by sdxl_process_data_dir.py (one or more): folders, or s3://bucket/prefix in S3-compatible object storage "
        "(read with ranged requests; credentials the standard AWS way, AWS_ENDPOINT_URL_S3 for MinIO, R2, B2)"
    )
    dataset_repeats: list[float] | None = option(
        None,
        help="times each --cached_dataset_dirs entry's items are trained per epoch, one number per entry in the same order: 3 = three "
        "copies, each with its own noise and caption draws; 0.5 = a seeded half of the items, another half every epoch; None = 1 for all",
    )
    dataset_loss_weights: list[float] | None = option(
        None,
        help="a weight for each --cached_dataset_dirs entry's training loss, one number per entry in the same order (kohya's prior_loss_weight, "
        "OneTrainer's concept loss_weight): each sample's loss is multiplied by its cache's weight before the batch mean, so 0.5 halves "
        "that cache's pull on the weights; the validation loss stays unweighted; None = 1 for all",
    )
    dataset_shuffle_caption: list[bool] | None = option(
        None,
        help="--shuffle_caption for each --cached_dataset_dirs entry, in the same order (true/false), e.g. shuffle a tag dataset's "
        "captions and keep a prose dataset's as written; None = --shuffle_caption for all",
    )
    dataset_keep_tokens: list[int] | None = option(None, help="--keep_tokens for each --cached_dataset_dirs entry, in the same order; None = --keep_tokens for all")
    dataset_caption_tag_dropout_rate: list[float] | None = option(
        None, help="--caption_tag_dropout_rate for each --cached_dataset_dirs entry, in the same order; None = --caption_tag_dropout_rate for all"
    )
    validation_source_dirs: list[Path] | None = option(
        None, help="the image folders the caches were made from (one per cache, same order): real images for FID/LPIPS; None = decoded cached latents"
    )
    train_batch_size: int = option(1, help="images per GPU per microbatch")
    gradient_accumulation_steps: int = option(1, help="microbatches per optimizer update; effective batch = train_batch_size x processes x this")
    num_train_epochs: int = option(10, help="passes over the training items")
    max_train_updates: int = option(
        0,
        help="train this many optimizer updates in all, as many epochs or part of one as that takes, instead of --num_train_epochs "
        "(kohya's --max_train_steps); the LR schedule spans them; 0 = off",
    )
    dataloader_num_workers: int = option(2, help="background processes reading cache shards per rank; 0 = read in the training process")
    flip_aug: bool = option(
        False,
        help="train each sample's horizontal mirror half the time (drawn per sample and epoch from the seed), from latents the cache "
        "holds (sdxl_process_data_dir.py --flip_aug), with SDXL's crop offset of the mirrored crop; for subjects without a handedness",
    )

    def dataset_records(self) -> list[DatasetOptions]:
        """One record per cache: the [[datasets]] tables as given, or each --cached_dataset_dirs entry with the
        --dataset_* and --validation_source_dirs values at its position (unset = 1 for repeats and loss weight,
        the run-wide flag for the caption options). problems() has checked that the lists fit."""
        if self.datasets:
            return list(self.datasets)
        cache_dirs = self.cached_dataset_dirs or []

        def per_cache(values: list | None, default: object = None) -> list:
            return values if values is not None else [default] * len(cache_dirs)

        return [
            DatasetOptions(cache_dir=cache_dir, repeats=repeats, loss_weight=weight, shuffle_caption=shuffle, keep_tokens=keep,
                           caption_tag_dropout_rate=dropout, validation_source_dir=source)
            for cache_dir, repeats, weight, shuffle, keep, dropout, source in zip(
                cache_dirs, per_cache(self.dataset_repeats, 1.0), per_cache(self.dataset_loss_weights, 1.0), per_cache(self.dataset_shuffle_caption),
                per_cache(self.dataset_keep_tokens), per_cache(self.dataset_caption_tag_dropout_rate), per_cache(self.validation_source_dirs),
            )
        ]  # fmt: skip

    def problems(self) -> list[str]:
        problems = []
        shorthand = [name for name in SHORTHAND_FLAGS if getattr(self, name) is not None]
        if self.datasets and shorthand:
            problems.append(f"give the caches either as [[datasets]] tables in --config or as --cached_dataset_dirs (with {', '.join('--' + name for name in SHORTHAND_FLAGS[1:])}), not both: found {', '.join('--' + name for name in shorthand)}")
        elif not self.datasets and not self.cached_dataset_dirs:
            problems.append("no caches to train on: give --cached_dataset_dirs (or [[datasets]] tables in a --config file)")
        count = len(self.cached_dataset_dirs or [])
        for name in ("dataset_repeats", "dataset_loss_weights"):  # one positive number per cache
            values = getattr(self, name)
            if values is not None and len(values) != count:
                problems.append(f"--{name} needs one number per --cached_dataset_dirs entry ({count}), got {len(values)}")
            if any(not 0 < value < math.inf for value in values or ()):
                problems.append(f"--{name} must be > 0 and finite (leave a cache out instead of 0), got {values}")
        if self.validation_source_dirs is not None and len(self.validation_source_dirs) != count:
            problems.append("--validation_source_dirs needs one image folder per --cached_dataset_dirs entry, in the same order")
        for name in ("dataset_shuffle_caption", "dataset_keep_tokens", "dataset_caption_tag_dropout_rate"):  # one value per cache
            values = getattr(self, name)
            if values is not None and len(values) != count:
                problems.append(f"--{name} needs one value per --cached_dataset_dirs entry ({count}), got {len(values)}")
        for number, record in enumerate(self.datasets, start=1):
            if not 0 < record.repeats < math.inf or not 0 < record.loss_weight < math.inf:
                problems.append(f"[[datasets]] number {number} ({record.cache_dir}): repeats and loss_weight must be > 0 and finite (leave a cache out instead of 0)")
        sources = [record.validation_source_dir is not None for record in self.datasets]
        if any(sources) and not all(sources):
            problems.append("[[datasets]]: give validation_source_dir for every cache or for none (FID and LPIPS compare with all real images or all decoded latents)")
        problems += self._repeated_caches()
        for name in ("train_batch_size", "gradient_accumulation_steps", "num_train_epochs"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        if self.num_train_epochs > MAX_EPOCHS:
            problems.append(f"--num_train_epochs {self.num_train_epochs:,} is more than the {MAX_EPOCHS:,} epochs a run plans: lower it")
        if self.max_train_updates < 0:
            problems.append("--max_train_updates must be >= 0 (0 = --num_train_epochs decides)")
        if self.dataloader_num_workers < 0:
            problems.append(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        return problems

    def _repeated_caches(self) -> list[str]:
        """One cache named twice (the same path, with a trailing /, through a symlink, or an s3:// URL written
        another way) would be two datasets of the same items: the validation split would hold an item out under
        one and train it under the other."""
        problems: list[str] = []
        first: dict[str, str] = {}  # cache identity -> the entry that named it first
        entry = "[[datasets]] number" if self.datasets else "--cached_dataset_dirs entry"
        for number, record in enumerate(self.dataset_records(), start=1):
            identity = cache_identity(record.cache_dir)
            if identity not in first:
                first[identity] = f"{entry} {number} ({record.cache_dir})"
                continue
            problems.append(
                f"{entry} {number} ({record.cache_dir}) names the same cache as {first[identity]}: {identity}. Give each cache once "
                "(its validation items would be held out under one and trained under the other); for its items more often, "
                f"{'repeats = N in its table' if self.datasets else '--dataset_repeats'}"
            )
        return problems


# The per-cache flags that DataOptions.datasets replaces, --cached_dataset_dirs first.
SHORTHAND_FLAGS = ("cached_dataset_dirs", "dataset_repeats", "dataset_loss_weights", "dataset_shuffle_caption", "dataset_keep_tokens",
                   "dataset_caption_tag_dropout_rate", "validation_source_dirs")


@dataclass(frozen=True)
class DataSettings:
    """The training data's flags (the trainer's --cached_dataset_dirs, --dataset_* and batch options)."""

    cache_dirs: list[CacheLocation]
    loss_weights: list[float] | None  # one per cache
    repeats: list[float] | None  # one per cache
    flip_aug: bool
    loss_masks: bool
    per_rank_batch: int
    gradient_accumulation_steps: int
    num_epochs: int
    max_updates: int  # 0: the run is num_epochs long
    num_workers: int
    split: SplitSettings  # the items held out for validation
    captions_in_memory: bool  # caption mode reads every step's captions: held, not read from the manifest on use
