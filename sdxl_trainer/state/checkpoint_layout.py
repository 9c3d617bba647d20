"""What a checkpoint holds and what its files are called. The training state is saved and restored as a
whole through torch.distributed.checkpoint (DCP): save.py writes it, load.py reads it, verify.py checks it.

A checkpoint folder `checkpoints/update_<N>` holds:
- the DCP shards of every rank: UNet, optimizer state (torchao's 8-bit state included) and EMA. DCP
  writes each rank's shards without gathering and reshards on load (a run saved on 2 processes resumes
  on 1 or 4);
- `rng/rank<R>.safetensors`: every rank's torch / CUDA / numpy / Python RNG states;
- `data_position.safetensors`: where the run is inside its epoch (items carried into the epoch and
  items already trained on), so a resume continues the epoch instead of replaying it;
- `trainer_state.json`: counters, loss scaler, and the facts a resume checks;
- `checksums.json`, written last: the SHA-256 of every other file, trainer_state.json included (each rank
  hashing the files it wrote); a resume checks them (each rank its share of the files), so a shard, a
  counter or the format marker whose bytes changed on disk is found before anything trains on it. Whether
  checksums are checked follows from checksums.json being there, never from a field: a format marker
  flipped to "before checksums" beside a checksums.json is refused, and one of format 3 or later without
  it is refused as damaged.

Nothing in a checkpoint can run code when it is opened. DCP stores every non-tensor value with pickle
and reads it back with torch.load(weights_only=False); so only tensors go through DCP (the optimizer's
per-parameter state, never its param_groups: those come from the resuming run's flags), DCP's index is
written as JSON (`.metadata.json`) instead of a pickle, and the reader refuses an index that names a
non-tensor entry, an unknown dtype or a file outside the checkpoint. Tensors are read with
torch.load(weights_only=True); everything else is JSON or safetensors.

Crash safety: all ranks write into `update_<N>.tmp`; only after every rank reports success does rank 0
write trainer_state.json, then checksums.json (every rank's checksums and trainer_state.json's), and rename
the folder. A folder without `.tmp` that holds trainer_state.json is complete; a save that dies halfway
(killed, disk full) never touches the earlier checkpoints.
"""

from __future__ import annotations

import re

TRAINER_STATE_FILE = "trainer_state.json"
DATA_POSITION_FILE = "data_position.safetensors"
METADATA_FILE = ".metadata.json"
CHECKSUMS_FILE = "checksums.json"
CHECKPOINT_NAME = re.compile(r"^update_(\d+)$")
ABANDONED_PREFIX = "abandoned_after_"  # + the checkpoint resumed from and the time: a branch set aside by going back
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # the only files DCP's file writer creates
# 1: pickled entries (refused); 2: tensor-only, no checksums (resumed unverified); 3: checksums.json of every file but
# trainer_state.json; 4: checksums.json covers trainer_state.json too. An older trainer refuses format 4 as "newer".
FORMAT_VERSION = 4
RESUMABLE_FORMAT_VERSIONS = (2, 3, 4)
FIRST_CHECKSUMMED_FORMAT = 3
FIRST_CHECKSUMMED_TRAINER_STATE_FORMAT = 4
CHECKSUMMED_FILE = re.compile(r"^(__\d+_\d+\.distcp|rng/rank\d+\.safetensors|\.metadata\.json|data_position\.safetensors|trainer_state\.json)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and what to do."""
