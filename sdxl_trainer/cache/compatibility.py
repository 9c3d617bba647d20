"""Whether caches fit a training run: made with its model and resolution range, intact, and what the run
takes from them where its flags leave a setting unset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sdxl_trainer.cache.buckets import BUCKET_TABLE_VERSION
from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import CacheLocation, CacheSettings, cache_vae, read_cache_info, settings_differences
from sdxl_trainer.cache.reader import read_empty_prompt
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH, TOKENS_PER_CHUNK, model_fingerprint
from sdxl_trainer.models.single_file import is_single_file, model_location_problem


@dataclass(frozen=True)
class CacheRequirements:
    """What a training run asks of its caches; a None flag is taken from the caches (check_caches)."""

    pretrained_model_name_or_path: str | None
    single_file_config: str
    min_resolution: int | None
    max_resolution: int | None
    flip_aug: bool  # the run trains mirrored latents
    masked_loss: bool  # the run trains with loss masks


@dataclass(frozen=True)
class CacheCheck:
    """What check_caches found: the settings the caches supply (as the run's config fields), the problems,
    and what every later reader of the caches needs."""

    taken: dict[str, object]
    problems: list[str]
    vae_name_or_path: str | None = None  # the VAE the caches were encoded with, where it is not the model's own
    caption_chunks: int = 0  # the caches' caption length in chunks of 75 tokens
    empty_prompt: tuple[torch.Tensor, torch.Tensor] | None = None  # the first cache's empty-caption embeddings, checked (caption dropout's)


def check_caches(cache_dirs: list[CacheLocation], wanted: CacheRequirements) -> CacheCheck:
    """Every cache must exist, hold an intact empty prompt (read_empty_prompt) and match the run's model family
    and bucket table, and all must share one VAE (the one validation decodes with and the export holds) and
    one caption length. Every problem is listed, those of the empty prompts too. What the requirements
    leave unset (model, resolution range) is taken from the caches. The model is compared by the
    fingerprint of its VAE and text-encoder configs (read from config files only), not by its path, so a
    moved or re-downloaded model still matches."""
    infos, problems = {}, []
    for cache_dir in cache_dirs:
        try:
            infos[cache_dir] = read_cache_info(cache_dir)
        except CacheError as error:
            problems.append(str(error))
    if problems:
        return CacheCheck({}, problems)
    empty_prompts = {}
    for cache_dir, info in infos.items():  # against its checksum: a damaged one would train as the dropped caption
        try:
            empty_prompts[cache_dir] = read_empty_prompt(cache_dir, info.text_max_length)
        except CacheError as error:
            problems.append(str(error))
    taken, setting_problems = _take_cache_settings(wanted, infos)
    model = taken.get("pretrained_model_name_or_path", wanted.pretrained_model_name_or_path)
    setting_problems = setting_problems or _model_problems(model, wanted.single_file_config)
    if setting_problems:
        return CacheCheck(taken, problems + setting_problems)
    vaes, text_lengths = set(), set()
    for cache_dir, info in infos.items():
        vaes.add(cache_vae(info))
        text_lengths.add(info.text_max_length // TEXT_MAX_LENGTH * TOKENS_PER_CHUNK)
        expected = dict(bucket_table_version=BUCKET_TABLE_VERSION, model_fingerprint=model_fingerprint(model, cache_vae(info), wanted.single_file_config))
        differences = settings_differences(info, replace(info, **expected), tuple(expected))
        if differences:
            problems.append(f"{cache_dir} was made with other settings ({'; '.join(differences)}): re-cache it with this model")
    unflipped = [str(cache_dir) for cache_dir, info in infos.items() if not info.flip_aug]
    if wanted.flip_aug and unflipped:
        problems.append(
            f"--flip_aug trains the mirrored latents, which {', '.join(unflipped)} lack: re-cache with sdxl_process_data_dir.py --flip_aug "
            "(the cache goes on where it stands only with the settings it was made with, so into a new --cache_dir), or drop --flip_aug"
        )
    if wanted.masked_loss and not any(info.mask_files or info.alpha_mask for info in infos.values()):
        problems.append(
            "--masked_loss trains with the caches' loss masks, and none of the caches holds any: re-cache with sdxl_process_data_dir.py "
            "--mask_files (name.mask.png beside each image) or --alpha_mask (into a new --cache_dir), or drop --masked_loss"
        )
    if len(vaes) > 1:
        names = sorted(vae or "the model's own" for vae in vaes)
        problems.append(f"the caches were encoded with different VAEs ({', '.join(names)}): re-cache them with one")
    if len(text_lengths) > 1:
        problems.append(
            f"the caches were encoded with different --max_token_length ({', '.join(map(str, sorted(text_lengths)))}): "
            "re-cache them with one, as a batch may mix their items"
        )
    first = infos[cache_dirs[0]]
    return CacheCheck(taken, problems, cache_vae(first), first.text_max_length // TEXT_MAX_LENGTH, empty_prompts.get(cache_dirs[0]))


def _model_problems(model: str, single_file_config: str) -> list[str]:
    """A model that cannot be found, named by its flag (checked before anything reads it)."""
    problems = [model_location_problem(model, "--pretrained_model_name_or_path")]
    if is_single_file(model):
        problems.append(model_location_problem(single_file_config, "--single_file_config"))
    return [problem for problem in problems if problem]


def _take_cache_settings(wanted: CacheRequirements, infos: dict[CacheLocation, CacheSettings]) -> tuple[dict[str, object], list[str]]:
    """What the requirements leave unset, from the caches: the model they were made from and their resolution
    range (over several caches: the smallest and the largest category; a batch never mixes bucket sizes, so
    caches of different ranges train together). A flag that is given must agree; returns the fields and the
    conflicts."""
    taken: dict[str, object] = {}
    problems = []
    ranges = {
        "min_resolution": min(infos.items(), key=lambda entry: entry[1].min_resolution),
        "max_resolution": max(infos.items(), key=lambda entry: entry[1].max_resolution),
    }
    for name, (cache_dir, info) in ranges.items():
        cached, given = getattr(info, name), getattr(wanted, name)
        if given is None:
            taken[name] = cached
        elif given != cached:
            problems.append(
                f"--{name} {given} does not match the caches: {cache_dir} was made with --{name} {cached}; drop the flag "
                f"(the trainer takes the range from the caches) or re-cache with --{name} {given}"
            )
    if wanted.pretrained_model_name_or_path is None:
        models = sorted({info.pretrained_model_name_or_path for info in infos.values()})
        if len(models) > 1:
            problems.append(f"the caches were made from models named {', '.join(models)}: name the one to train with --pretrained_model_name_or_path")
        elif problem := model_location_problem(models[0], "the caches' model (as their cache_info.json names it; pass --pretrained_model_name_or_path where it moved)"):
            problems.append(problem)
        else:
            taken["pretrained_model_name_or_path"] = models[0]
    return taken, problems
