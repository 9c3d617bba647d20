"""Caption mode: the text encoders run in the training step on each sample's caption, varied per step.

A cache keeps every item's caption text (its manifest), one caption per line of the .txt file. With
--encode_captions_each_step the trainer encodes, for each sample of each step, one variation of it:
  1. one of its captions (lines), chosen uniformly;
  2. its comma-separated tags: the first --keep_tokens stay in place (a trigger word, a character name),
     each other tag is dropped with --caption_tag_dropout_rate, and the others are shuffled
     (--shuffle_caption);
  3. its cache's caption prefix and suffix (sdxl_process_data_dir.py --caption_prefix/--caption_suffix)
     around it, so a trigger word is never moved or dropped (as SimpleTuner prepends its instance prompt
     after shuffling; kohya adds its caption_prefix before, where --keep_tokens must cover it);
then both text encoders (frozen) encode it by the cache's chunk rule (encoding.encode_prompts). Every
draw comes from a generator seeded by (seed, epoch, sample) and a stream of its own, so the same run gives
the same captions on any number of processes, a resumed run continues exactly, and the noise, timestep and
caption-dropout draws (diffusion.py) are the same whether or not captions vary.

Frozen encoders are replicated on every GPU, not sharded: no gradients, no optimizer state, 1.6 GB in bf16
for SDXL's two, and sharding them would add an all-gather of their weights to every step. Trained encoders
(--train_text_encoder) hold fp32 weights, gradients and optimizer state (about 8 GB for both with
adamw8bit), so they are sharded like the UNet (parallel.prepare_text_encoder).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sdxl_trainer.cache.format import captions_in
from sdxl_trainer.config import option
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.models.encoders import chunked_token_ids, encode_prompts, encode_token_ids

if TYPE_CHECKING:
    from sdxl_trainer.models.encoders import TextSide

TAG_SEPARATOR = ","
CAPTION_STREAM = 7  # the 4th entry of the seed sequence: apart from the noise draws' (seed, epoch, sample)

@dataclass(kw_only=True)
class CaptionOptions:
    """Caption mode and text-encoder training"""

    encode_captions_each_step: bool = option(
        False,
        help="caption mode: run both text encoders (frozen, replicated on every GPU: 1.6 GB in bf16) in every step on the captions the "
        "cache keeps, instead of reading its cached embeddings; needed to choose among several captions per image (one per line) "
        "and for --shuffle_caption / --keep_tokens / --caption_tag_dropout_rate",
    )
    shuffle_caption: bool = option(False, help="caption mode: shuffle the comma-separated tags of each caption at every step (seeded per sample)")
    keep_tokens: int = option(0, help="caption mode: leading comma-separated tags (as kohya counts them) never shuffled or dropped, e.g. a trigger word")
    caption_tag_dropout_rate: float = option(0.0, help="caption mode: chance (0-1) of dropping each tag after the --keep_tokens ones, at every step")
    train_text_encoder: bool = option(
        False,
        help="caption mode: train both text encoders with the UNet (fp32 weights sharded like the UNet's: about 8 GB more over all "
        "GPUs with adamw8bit); checkpoints, validation, samples and exports then hold the trained encoders",
    )
    learning_rate_te1: float | None = option(
        None, help="peak learning rate of text encoder 1 (CLIP ViT-L) with --train_text_encoder; None = --learning_rate; 0 keeps it frozen"
    )
    learning_rate_te2: float | None = option(
        None, help="peak learning rate of text encoder 2 (OpenCLIP ViT-bigG) with --train_text_encoder; None = --learning_rate; 0 keeps it frozen"
    )

    def trained_text_encoders(self) -> dict[str, float | None]:
        """The text encoders that train, by pipeline name, with their peak learning rate (None = the UNet's): the
        ones whose --learning_rate_te1/te2 is not 0 (kohya's rule); {} without --train_text_encoder."""
        if not self.train_text_encoder:
            return {}
        rates = (self.learning_rate_te1, self.learning_rate_te2)
        return {name: rate for name, rate in zip(TEXT_ENCODER_NAMES, rates) if rate != 0}

    def frozen_text_encoder(self) -> str:
        """The text encoder kept frozen by a rate of 0 while the other trains ("" if none)."""
        trained = self.trained_text_encoders()
        return next((name for name in TEXT_ENCODER_NAMES if name not in trained), "") if trained else ""

    def problems(self) -> list[str]:
        problems = []
        if not self.encode_captions_each_step and self.train_text_encoder:
            problems.append("--train_text_encoder needs --encode_captions_each_step: cached embeddings cannot carry gradients to the encoders")
        if not self.train_text_encoder and (self.learning_rate_te1 is not None or self.learning_rate_te2 is not None):
            problems.append("--learning_rate_te1 / --learning_rate_te2 apply to trained text encoders: add --train_text_encoder")
        for name in ("learning_rate_te1", "learning_rate_te2"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                problems.append(f"--{name} must be >= 0 (0 keeps that text encoder frozen), got {getattr(self, name)}")
        if self.train_text_encoder and self.learning_rate_te1 == 0 and self.learning_rate_te2 == 0:
            problems.append("--learning_rate_te1 and --learning_rate_te2 are both 0, so no text encoder trains: drop --train_text_encoder")
        return problems


@dataclass(frozen=True)
class CaptionVariation:
    shuffle_tags: bool = False
    keep_tags: int = 0  # leading tags never moved or dropped
    tag_dropout: float = 0.0  # chance of dropping each other tag

    @property
    def changes_tags(self) -> bool:
        return self.shuffle_tags or self.tag_dropout > 0

    def describe(self) -> str:
        if not self.changes_tags:
            return "one of each image's captions, as written"
        changes = (["shuffled"] if self.shuffle_tags else []) + ([f"each dropped with chance {self.tag_dropout}"] if self.tag_dropout else [])
        return f"one of each image's captions, its tags after the first {self.keep_tags} {' and '.join(changes)}"


def caption_generator(run_seed: int, epoch: int, sample_index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([run_seed, epoch, sample_index, CAPTION_STREAM])))


def vary_caption(text: str, rng: np.random.Generator, variation: CaptionVariation) -> str:
    """One caption of `text`, its tags varied as `variation` says (see the module docstring). Without tag
    changes the chosen caption is returned exactly as written."""
    choices = captions_in(text)
    caption = choices[int(rng.integers(len(choices)))]
    if not variation.changes_tags:
        return caption
    tags = [tag.strip() for tag in caption.split(TAG_SEPARATOR) if tag.strip()]
    kept, rest = tags[: variation.keep_tags], tags[variation.keep_tags :]
    if variation.tag_dropout > 0:
        rest = [tag for tag, draw in zip(rest, rng.random(len(rest))) if draw >= variation.tag_dropout]
    if variation.shuffle_tags:
        rest = [rest[index] for index in rng.permutation(len(rest))]
    return f"{TAG_SEPARATOR} ".join(kept + rest)


# The batch keys of each tokenizer's chunked token ids of the step's captions (CaptionDraws adds them).
TOKEN_IDS_KEYS = ("caption_token_ids", "caption_token_ids_2")


class CaptionDraws:
    """This step's caption variation of every sample, as both tokenizers' chunked token ids added to the batch:
    run where the batch is read (the DataLoader workers, training/stream.py), so the step neither tokenizes nor
    reads the sample indices, and the ids reach the device in the batch's pinned, non-blocking copy."""

    def __init__(self, tokenizers: tuple, captions: list[str], variation_of: Callable[[int], CaptionVariation], run_seed: int, chunks: int,
                 framing: Callable[[int, str], str]):
        self.tokenizers = tokenizers
        self.captions = captions  # manifest text of every dataset item
        self.variation_of = variation_of
        self.run_seed = run_seed
        self.chunks = chunks
        self.framing = framing

    def captions_for(self, sample_indices: list[int], epoch: int) -> list[str]:
        """This epoch's caption of each sample (of item sample % dataset size, data.CachedDataset)."""
        items = [sample % len(self.captions) for sample in sample_indices]
        return [
            self.framing(item, vary_caption(self.captions[item], caption_generator(self.run_seed, epoch, sample), self.variation_of(item)))
            for item, sample in zip(items, sample_indices)
        ]

    def __call__(self, batch: dict[str, torch.Tensor], epoch: int) -> dict[str, torch.Tensor]:
        captions = self.captions_for(batch["sample_index"].tolist(), epoch)
        return {**batch, **{key: chunked_token_ids(tokenizer, captions, self.chunks)[0] for key, tokenizer in zip(TOKEN_IDS_KEYS, self.tokenizers)}}


class StepCaptionEncoder:
    """Replaces a microbatch's cached caption embeddings by the encoding of this step's caption variations.

    With trains=True (--train_text_encoder) the encoders are trained: gradients flow through the encoding,
    and the empty caption (caption dropout's) is encoded in the same forward, so dropped samples train
    the encoders' "" as the exported pipeline will encode it."""

    def __init__(self, text_side: TextSide, captions: list[str], variation: CaptionVariation | Callable[[int], CaptionVariation], run_seed: int,
                 chunks: int, device: torch.device, trains: bool = False, framing: Callable[[int, str], str] | None = None):
        self.tokenizers, self.text_encoders = text_side
        # (item index, caption) -> the caption with its cache's prefix and suffix (CachedDataset.framed), added after
        # the variation so that a trigger word is never shuffled or dropped; item index -> its tag variation (one
        # for all items, or its cache's: --dataset_shuffle_caption and the like)
        self.draws = CaptionDraws(
            self.tokenizers, captions, variation if callable(variation) else lambda _item: variation, run_seed, chunks,
            framing or (lambda _item, caption: caption),
        )  # fmt: skip
        self.captions = captions
        self.chunks = chunks
        self.device = device
        self.trains = trains
        # The empty caption's token ids, made once (caption dropout's, encoded by trained encoders in every step).
        self._empty_ids = [chunked_token_ids(tokenizer, [""], chunks)[0].to(device) for tokenizer in self.tokenizers] if trains else []

    def __call__(self, batch: dict[str, torch.Tensor], epoch: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """The batch with this step's caption embeddings, and the empty caption as the trained encoders encode
        it now (None when they are frozen: the cached one stands). A batch without the token ids (one that did
        not come through the data stream) has them drawn here."""
        if TOKEN_IDS_KEYS[0] not in batch:
            batch = {**batch, **{key: ids.to(self.device) for key, ids in self.draws(batch, epoch).items() if key in TOKEN_IDS_KEYS}}
        token_ids = [batch[key] for key in TOKEN_IDS_KEYS]
        if self.trains:
            token_ids = [torch.cat([ids, empty]) for ids, empty in zip(token_ids, self._empty_ids)]
        with torch.set_grad_enabled(self.trains and torch.is_grad_enabled()):
            embeds, pooled = encode_token_ids(self.text_encoders, token_ids, self.chunks)
        empty = (embeds[-1], pooled[-1]) if self.trains else None
        if self.trains:
            embeds, pooled = embeds[:-1], pooled[:-1]
        return {**batch, "prompt_embeds": embeds, "pooled_prompt_embeds": pooled}, empty

    @torch.no_grad()
    def first_captions(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with its items' first captions as the encoders encode them now, unvaried (validation
        loss with trained encoders: the caption the cached embeddings hold, through the current weights)."""
        items = [sample % len(self.captions) for sample in batch["sample_index"].tolist()]
        captions = [self.draws.framing(item, captions_in(self.captions[item])[0]) for item in items]
        encoded = encode_prompts(self.tokenizers, self.text_encoders, captions, self.chunks, self.device)
        return {**batch, "prompt_embeds": encoded.prompt_embeds, "pooled_prompt_embeds": encoded.pooled_prompt_embeds}
