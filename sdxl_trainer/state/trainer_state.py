"""trainer_state.json: a checkpoint's counters and the facts a resume checks, read strictly."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from sdxl_trainer.state.checkpoint_layout import FORMAT_VERSION, RESUMABLE_FORMAT_VERSIONS, TRAINER_STATE_FILE, CheckpointError


@dataclass(frozen=True)
class DatasetIdentity:
    """The training data as a checkpoint records it: its items, and their order. A data position names items by
    their place in the data (the items an epoch has trained, those carried into it), so on other items, or the
    same ones in another order, it means other items."""

    items: int  # in every cache together, held-out ones included
    fingerprint: str  # SHA-256 of the items' names (cache position, image hash, path) in name order: the same items
    order: str  # SHA-256 of the same names in the data's order: the same items in the same places

    def changes(self, now: DatasetIdentity) -> str:
        """What differs between this (the checkpoint's) data and `now`, in words; "" if nothing."""
        if self.fingerprint != now.fingerprint:
            if self.items != now.items:
                return f"{self.items:,} items then, {now.items:,} now"
            return f"{self.items:,} items then and now, but not the same ones (or the caches are listed in another order)"
        if self.order != now.order:
            return f"the same {self.items:,} items, in another order (a cache's manifest was written anew)"
        return ""

    def as_fields(self) -> dict[str, int | str]:
        """As TrainerState's fields."""
        return {"dataset_items": self.items, "dataset_fingerprint": self.fingerprint, "dataset_order": self.order}


@dataclass(frozen=True)
class TrainerState:
    """trainer_state.json: the run's counters and the facts a resume checks. Read strictly: an extra or
    mistyped field, or a missing one, is a damaged checkpoint; only a field added after FORMAT_VERSION 2
    (one with a default besides format_version) may be missing: the checkpoint predates it. Formats 2 to 4
    differ only in checksums.json, which format 3 must have, listing this file too from format 4 on."""

    update: int  # optimizer updates done (skipped ones included): the LR schedule's position
    epoch: int  # the epoch to continue (counted from 0)
    updates_in_epoch: int  # its updates already done
    seed: int
    optimizer: str
    use_ema: bool
    ema_updates: int
    world_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    skipped_updates: int
    consecutive_skipped_updates: int
    loss_scaler: dict[str, float | int] | None  # the fp16 gradient scaler's state
    train_text_encoder: bool = False  # the checkpoint holds trained text encoders (and their optimizer state)
    frozen_text_encoder: str = ""  # the one of them kept frozen by a learning rate of 0 ("text_encoder" / "text_encoder_2"), "" if none
    weights_dtype: str = "fp32"  # of the trained weights (--weights_dtype)
    frozen_unet_blocks: str = ""  # the UNet blocks kept frozen by --block_lr 0, comma-separated ("" if none)
    # The data the run trained on (DatasetIdentity); 0 and "" in a checkpoint saved before they were recorded.
    dataset_items: int = 0
    dataset_fingerprint: str = ""
    dataset_order: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def dataset(self) -> DatasetIdentity | None:
        """The data the checkpoint's run trained on; None for a checkpoint saved before it was recorded."""
        return DatasetIdentity(self.dataset_items, self.dataset_fingerprint, self.dataset_order) if self.dataset_fingerprint else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: Path) -> TrainerState:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise CheckpointError(f"{source} is damaged (not JSON: {error})") from error
        if not isinstance(data, dict):
            raise CheckpointError(f"{source} is damaged (not a JSON object)")
        if isinstance(data.get("format_version"), int) and data["format_version"] > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} was written by a newer version of this trainer (checkpoint format {data['format_version']}, this one "
                f"reads up to {FORMAT_VERSION}): resume it with that version"
            )
        if data.get("format_version") not in RESUMABLE_FORMAT_VERSIONS:
            raise CheckpointError(
                f"{source} was written by an earlier version of this trainer, whose checkpoints hold pickled entries that "
                "could run code, so it cannot be resumed. Fine-tune on from its exported pipeline instead "
                "(--pretrained_model_name_or_path RUN/pipeline), or finish that run with the earlier version."
            )
        fields = {field.name: field for field in dataclasses.fields(cls)}
        missing = {name for name in set(fields) - set(data) if fields[name].default is dataclasses.MISSING}
        if missing or set(data) - set(fields):
            raise CheckpointError(f"{source} is damaged (fields missing: {sorted(missing)}, unknown: {sorted(set(data) - set(fields))})")
        for name, value in data.items():
            expected = fields[name].type
            if expected == "bool":
                valid = isinstance(value, bool)
            elif expected == "int":
                valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif expected == "str":
                valid = isinstance(value, str)
            else:  # the loss scaler
                valid = value is None or (isinstance(value, dict) and all(isinstance(item, (int, float)) for item in value.values()))
            if not valid:
                raise CheckpointError(f"{source} is damaged ({name} = {value!r} is not a valid {expected})")
        return cls(**data)


def read_trainer_state(checkpoint_dir: Path) -> TrainerState:
    state_file = checkpoint_dir / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint (no {TRAINER_STATE_FILE}): pick another one, or --load_saved_state latest")
    try:
        text = state_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{state_file} cannot be read ({error})") from error
    return TrainerState.from_json(text, state_file)
