"""The caching script's configuration: every flag of sdxl_process_data_dir.py and its checks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from sdxl_trainer.cache.buckets import ResolutionOptions, categories
from sdxl_trainer.cache.errors import StorageError
from sdxl_trainer.cache.format import foreign_contents_problem
from sdxl_trainer.cache.stores import is_remote
from sdxl_trainer.config import option
from sdxl_trainer.models.encoders import chunks_for
from sdxl_trainer.models.options import ModelOptions
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE
from sdxl_trainer.preparation.tables import TABLE_SUFFIXES, TableFilters, parse_column_names, read_tag_replacements, read_text_replacements
from sdxl_trainer.preparation.tar_sources import TAR_SUFFIX, find_tars
from sdxl_trainer.preparation.upscale import weights_problems

DEFAULT_MIN_RESOLUTION, DEFAULT_MAX_RESOLUTION = 512, 1024  # px, the caching script's range where the flags leave it unset


@dataclass(kw_only=True)
class CacheConfig(ModelOptions, ResolutionOptions):
    """Every option of sdxl_process_data_dir.py; the model and the resolution range are the sections the trainer
    shares (models/options.py, cache/buckets.py), with the caching defaults filled in where they are unset."""

    # --help lists these first, a line each (the full reference follows).
    COMMON_OPTIONS: ClassVar[dict[str, str]] = {
        "data_dir": "the images, each with a caption file of the same name (photo.jpg + photo.txt)",
        "cache_dir": "where the cache is written: a folder or s3://bucket/prefix",
        "metadata_table": "or a .jsonl / .parquet table of paths and captions instead of caption files",
        "pretrained_model_name_or_path": "the SDXL model whose text encoders and VAE encode the data",
        "vae_name_or_path": "a replacement VAE, e.g. madebyollin/sdxl-vae-fp16-fix",
        "min_resolution": "smallest bucket category in px; smaller images are skipped (unset = 512)",
        "max_resolution": "largest bucket category in px; larger images are scaled down (unset = 1024)",
        "dry_run": "only scan: the bucket histogram and what would be skipped; loads no model",
        "verify": "only check an existing --cache_dir against its checksums",
    }

    cache_dir: str = option(
        help="folder to write the cache into (not inside --data_dir), or s3://bucket/prefix in S3-compatible object storage (credentials the "
        "standard AWS way; AWS_ENDPOINT_URL_S3 for MinIO, R2, B2)"
    )
    data_dir: str | None = option(
        None,
        help="folder of images with captions in .txt files of the same name (searched recursively); with --tar_shards also s3://bucket/prefix; "
        "required except with --verify",
    )
    metadata_table: Path | None = option(
        None,
        help="a .jsonl or .parquet table listing the images instead of caption files: columns path (relative to --data_dir), "
        "caption or tags, and score for --min_score; read in batches, so millions of rows need no scan of the folder",
    )
    tar_shards: bool = option(
        False,
        help="--data_dir holds .tar shards in the WebDataset layout (key.jpg + key.txt or key.json with a caption field, consecutive "
        "members; searched recursively) instead of loose files; read without unpacking; workers split them by tar",
    )
    table_columns: list[str] | None = option(
        None,
        help="with --metadata_table: the table's names of the columns it calls otherwise, as COLUMN=NAME pairs (COLUMN: path, caption, "
        "tags, score, rating, width, height), e.g. path=file_name caption=text for a table made for another trainer",
    )
    min_score: float | None = option(None, help="with --metadata_table: skip rows whose score is below this (and rows without a score)")
    allowed_ratings: list[str] | None = option(
        None, help="with --metadata_table: keep only rows whose rating column is one of these (any case), e.g. general sensitive; rows without one are skipped"
    )
    exclude_tags: list[str] | None = option(None, help="with --metadata_table: skip rows whose caption holds any of these comma-separated tags")
    tag_replacements: Path | None = option(
        None, help='with --metadata_table: JSON object of tag -> replacement applied to every caption\'s tags first, e.g. {"1girl": "one girl", "lowres": ""} ("" removes)'
    )
    tag_text_replacements: Path | None = option(
        None,
        help='with --metadata_table: JSON object of text -> replacement inside every tag, applied in the file\'s order after --tag_replacements, '
        'e.g. {"artist:": "by=", ":": "=", "_": " "} (a tag left empty is removed)',
    )
    score_tags: list[float] | None = option(
        None,
        help="with --metadata_table: score thresholds, e.g. 3200 1600 800 400 200 100 50; a row's caption lines start with the tag of the "
        "highest one its score reaches (--score_tag_prefix + threshold: scr800); rows without a score or below all get none",
    )
    score_tag_prefix: str = option("scr", help="with --score_tags: the text before the threshold in a score tag")
    vae_name_or_path: str | None = option(
        None, help="replacement VAE (hub id or folder), e.g. madebyollin/sdxl-vae-fp16-fix; None = the pipeline's own VAE"
    )
    upscale_to_resolution: int = option(
        0, help="images whose bucket category is below this (px, a category above --min_resolution) are upscaled and bucketed in it; 0 = no upscaling"
    )
    upscaler_weights: Path | None = option(
        None, help="local ESRGAN-family weight file (.pth/.safetensors), e.g. RealESRGAN_x4plus.pth or 4x_foolhardy_Remacri.pth; needed by --upscale_to_resolution"
    )
    upscale_use_GFPGAN: bool = option(False, help="restore faces in upscaled images with GFPGAN (needs --gfpgan_weights and --facexlib_weights_dir)")
    gfpgan_weights: Path | None = option(None, help="local GFPGANv1.3.pth / GFPGANv1.4.pth, for --upscale_use_GFPGAN")
    facexlib_weights_dir: Path | None = option(
        None, help="folder holding facexlib's detection_Resnet50_Final.pth and parsing_parsenet.pth, for --upscale_use_GFPGAN"
    )
    upscale_tile_size: int = option(256, help="the upscaler runs on tiles of this many input px per side (bounds memory); 0 = whole image at once")
    upscale_tile_padding: int = option(32, help="px of surrounding image each tile sees, so tiles join without seams")
    save_upscale_samples: Path | None = option(None, help="folder (outside --data_dir) for before/after PNG pairs of upscaled images; None = none")
    max_upscale_samples: int = option(32, help="before/after pairs written per worker into --save_upscale_samples; 0 = every upscaled image")
    max_token_length: int = option(
        75,
        help="caption tokens encoded: 75 (SDXL's usual, one CLIP window), 150 or 225 (chunks of 75 encoded separately and "
        "concatenated, as A1111 and ComfyUI prompt); longer captions are cut and named in the cache log",
    )
    caption_prefix: str = option("", help='text put before every caption of this cache, e.g. a trigger word ("ohwx,"): in the cached embeddings, and kept first by the trainer\'s caption mode (never shuffled or dropped)')
    caption_suffix: str = option("", help="text put after every caption of this cache, likewise")
    flip_aug: bool = option(
        False,
        help="also encode each image's horizontal mirror (its crop flipped), so the trainer's --flip_aug can train either "
        "view; doubles the VAE work and the latents on disk",
    )
    mask_files: bool = option(
        False,
        help="cache a loss mask for each image that has a mask file beside it (photo.mask.png for photo.jpg: white = trained, "
        "black = not trained, gray in between), for the trainer's --masked_loss; images without one train everywhere",
    )
    alpha_mask: bool = option(
        False,
        help="cache the alpha channel of each image with transparency as its loss mask (transparent = not trained; kohya's "
        "alpha_mask); a mask file (--mask_files) takes precedence",
    )
    batch_size: int = option(8, help="images per VAE / text-encoder call")
    items_per_shard: int = option(256, help="items per shard file; a shard is the unit that a killed run redoes")
    num_shards: int = option(1, help="number of workers splitting the dataset (all GPUs of all machines)")
    shard_index: int = option(0, help="which worker this is, 0 .. num_shards-1")
    device: str = option("auto", help="torch device for the encoders: auto = cuda:LOCAL_RANK if a GPU is present, else cpu")
    encode_dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", help="text-encoder (and upscaler) precision: auto = bf16 on GPU, fp32 on CPU"
    )
    vae_dtype: Literal["fp32", "bf16", "fp16"] = option(
        "fp32",
        help="VAE precision. fp32 (as kohya's --no_half_vae and diffusers' scripts): the latents the model learns from "
        "are exact; bf16 is faster but changes them (on the tiny test VAE by several percent of their largest value); fp16 needs an fp16-fix VAE "
        "(SDXL's own overflows in fp16 and is kept in fp32, as its config's force_upcast asks)",
    )
    num_io_threads: int = option(4, help="threads that read, decode and crop images while the encoders run")
    dry_run: bool = option(False, help="only scan: print the bucket histogram and how many images would be skipped or upscaled; loads no model, writes nothing")
    verify: bool = option(False, help="only check --cache_dir: every shard, cache_info.json and empty_prompt.safetensors against their checksums and every manifest row against its shard; exit 1 if damaged")

    def __post_init__(self) -> None:
        if self.pretrained_model_name_or_path is None:
            self.pretrained_model_name_or_path = SDXL_CONFIG_SOURCE
        if self.min_resolution is None:
            self.min_resolution = DEFAULT_MIN_RESOLUTION
        if self.max_resolution is None:
            self.max_resolution = DEFAULT_MAX_RESOLUTION

    def _table_problems(self) -> list[str]:
        problems = []
        if self.metadata_table is None:
            for flag, value in (("--min_score", self.min_score), ("--allowed_ratings", self.allowed_ratings), ("--exclude_tags", self.exclude_tags),
                                ("--tag_replacements", self.tag_replacements), ("--tag_text_replacements", self.tag_text_replacements),
                                ("--score_tags", self.score_tags), ("--table_columns", self.table_columns)):
                if value is not None:
                    problems.append(f"{flag} works on the rows of a --metadata_table: give one (caption files have no tags, scores or ratings)")
        elif self.metadata_table.suffix not in TABLE_SUFFIXES or not self.metadata_table.is_file():
            problems.append(f"--metadata_table {self.metadata_table} must be an existing {' or '.join(TABLE_SUFFIXES)} file")
        if any(character in self.score_tag_prefix for character in ",\n"):
            problems.append(f"--score_tag_prefix {self.score_tag_prefix!r} must hold no comma or line break: it is part of one tag")
        if any(math.isnan(threshold) for threshold in self.score_tags or ()):
            problems.append("--score_tags must be numbers, not nan")
        try:
            parse_column_names(self.table_columns or [])
        except ValueError as error:
            problems.append(str(error))
        for path, read in ((self.tag_replacements, read_tag_replacements), (self.tag_text_replacements, read_text_replacements)):
            if path is not None:
                try:
                    read(path)
                except ValueError as error:
                    problems.append(str(error))
        return problems

    def table_filters(self) -> TableFilters:
        return TableFilters(
            min_score=self.min_score,
            allowed_ratings=frozenset(rating.strip().lower() for rating in self.allowed_ratings or ()),
            excluded_tags=frozenset(tag.strip() for tag in self.exclude_tags or ()),
            tag_replacements=read_tag_replacements(self.tag_replacements) if self.tag_replacements else {},
            text_replacements=read_text_replacements(self.tag_text_replacements) if self.tag_text_replacements else (),
            score_tags=tuple(self.score_tags or ()),
            score_tag_prefix=self.score_tag_prefix,
        )

    def validate(self) -> list[str]:
        problems = []
        try:
            category_range = categories(self.min_resolution, self.max_resolution)
        except ValueError as error:
            problems.append(str(error))
            category_range = []
        if self.verify:
            return problems
        data_found = False
        if self.data_dir is None:
            problems.append("--data_dir is required (except with --verify)")
        elif is_remote(self.data_dir):
            data_found = self.tar_shards
            if not self.tar_shards:
                problems.append(f"--data_dir {self.data_dir}: object storage is read as tar shards only (--tar_shards); copy loose images to a folder")
            elif is_remote(self.cache_dir) and f"{self.cache_dir.rstrip('/')}/".startswith(f"{self.data_dir.rstrip('/')}/"):
                problems.append(f"--cache_dir {self.cache_dir} is inside --data_dir {self.data_dir}: choose a prefix outside the dataset")
                data_found = False  # no listing of the tars: the flags are wrong already
        elif not Path(self.data_dir).is_dir():
            problems.append(f"--data_dir {self.data_dir} is not a folder")
        else:
            data_found = True
            local_cache = None if is_remote(self.cache_dir) else Path(self.cache_dir)
            for flag, folder in (("--cache_dir", local_cache), ("--save_upscale_samples", self.save_upscale_samples)):
                if folder is not None and folder.resolve().is_relative_to(Path(self.data_dir).resolve()):
                    problems.append(f"{flag} {folder} is inside --data_dir: choose a folder outside the dataset")
        problems += self._table_problems()
        if self.tar_shards and self.metadata_table is not None:
            problems.append("--tar_shards and --metadata_table are two ways to list the images: give one")
        elif self.tar_shards and data_found:
            try:
                if not find_tars(self.data_dir):
                    problems.append(f"--tar_shards: --data_dir {self.data_dir} holds no {TAR_SUFFIX} file (searched recursively)")
            except StorageError as error:
                problems.append(f"--data_dir: {error}")
        if self.upscale_to_resolution and category_range and self.upscale_to_resolution not in category_range[1:]:
            problems.append(
                f"--upscale_to_resolution {self.upscale_to_resolution} must be a category above --min_resolution {self.min_resolution} "
                f"and at most --max_resolution {self.max_resolution} (a multiple of 64), or 0 for no upscaling"
            )
        if not self.dry_run:
            try:
                problems += [problem] if (problem := foreign_contents_problem(self.cache_dir)) else []
            except StorageError as error:
                problems.append(f"--cache_dir: {error}")
            problems += weights_problems(
                self.upscale_to_resolution, self.upscaler_weights, self.upscale_use_GFPGAN, self.gfpgan_weights, self.facexlib_weights_dir
            )
        if not 0 <= self.shard_index < self.num_shards:
            problems.append(f"--shard_index {self.shard_index} must be in 0..{self.num_shards - 1} (--num_shards {self.num_shards})")
        try:
            chunks_for(self.max_token_length)
        except ValueError as error:
            problems.append(str(error))
        for name in ("batch_size", "items_per_shard", "num_io_threads"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        for name in ("upscale_tile_size", "upscale_tile_padding", "max_upscale_samples"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be 0 or more")
        return problems


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
