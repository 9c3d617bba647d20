"""When the training state is saved, one policy for a save that fails, and what a resume must match.

Saves are due after every --save_state_every_n_updates updates, at epoch saves, when a stop is requested,
when updates keep failing, and at the end. A save that fails (a full disk) never touches the earlier
checkpoints; what happens next depends on whether training goes on:
- while it goes on (scheduled and epoch saves): a warning, and training goes on;
- when the run is about to end (stop request, NaN stop, the end): CheckpointError, which ends the job
  with its message (at the end only after the model is exported).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from sdxl_trainer.config import URL, option
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.state.checkpoint_layout import ABANDONED_PREFIX, CHECKPOINT_NAME, CheckpointError
from sdxl_trainer.state.checkpoints_folder import (
    checkpoint_name,
    find_latest_checkpoint,
    intact_checkpoints,
    last_checkpoint_before_streak,
    remove_old_checkpoints,
    set_aside_later_checkpoints,
)
from sdxl_trainer.state.dcp_json_index import JsonIndexWriter
from sdxl_trainer.state.save import HasState, StagedState, Stateful, TensorStager, stage_training_state, write_staged_state
from sdxl_trainer.state.trainer_state import DatasetIdentity, TrainerState
from sdxl_trainer.state.verify import Verification, verify_checkpoint
from sdxl_trainer.state.writer_process import WriterProcess, save_request


@dataclass(kw_only=True)
class CheckpointOptions:
    """Checkpoints and resuming"""

    save_state: bool = option(
        True,
        help="save resumable training state (sharded UNet, optimizer, EMA, update count, data position, RNG; not the LR schedule: "
        "the rate follows from the update count and the resuming run's flags) to OUTPUT_DIR/PROJECT_NAME/checkpoints at epoch "
        "saves, every --save_state_every_n_updates, on SIGTERM/SIGINT and at the end",
    )
    save_state_every_n_updates: int = option(0, help="also save state every N optimizer updates (0 = off); with week-long epochs, set this")
    checkpoints_total_limit: int = option(
        2, help="keep only the newest K intact state checkpoints of this run (0 = keep all); damaged checkpoints and exported models are never deleted"
    )
    load_saved_state: str | None = option(
        None,
        help="resume from a state checkpoint folder, or 'latest' = the newest intact one in OUTPUT_DIR/PROJECT_NAME/checkpoints "
        "(starts from the base model in a folder without any checkpoint or earlier results, so one command serves the first start "
        "and every restart; refused when every checkpoint there is damaged)",
    )
    overwrite_run: bool = option(
        False,
        help="start over in a run folder that holds an earlier run's checkpoints or exported models (without this flag such a start "
        "is refused): its checkpoints are deleted, its exports, TensorBoard events, sample grid and W&B run id moved into "
        "OUTPUT_DIR/PROJECT_NAME/overwritten_<date-time>/; with --load_saved_state, a checkpoint of another run folder to start from",
    )
    accept_changed_dataset: bool = option(
        False,
        help="resume on data other than the checkpoint's (other items, or the same in another order), which is refused without "
        "it: the checkpoint's epoch then starts over on the new data (its data position names items by their place in the "
        "old data), while the update count and the learning-rate schedule go on",
    )
    delete_abandoned_branches: bool = option(
        False,
        help="with --overwrite_run, also delete checkpoints/abandoned_after_update_N_* (the later checkpoints that resuming from an "
        "earlier one set aside); without it they are kept",
    )

    def problems(self) -> list[str]:
        problems = []
        for name in ("save_state_every_n_updates", "checkpoints_total_limit"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be >= 0 (0 turns it off)")
        if self.load_saved_state is not None and URL.match(self.load_saved_state):
            problems.append(
                f"--load_saved_state {self.load_saved_state}: checkpoints in object storage are not read; copy the run folder to a local one "
                "(aws s3 sync, rclone) and resume from there (docs/object_storage.md)"
            )
        elif self.load_saved_state not in (None, "latest") and not Path(self.load_saved_state).is_dir():
            problems.append(f"--load_saved_state {self.load_saved_state} is not a folder: give a checkpoint folder (OUTPUT_DIR/PROJECT_NAME/checkpoints/update_N) or 'latest'")
        if self.load_saved_state == "latest" and self.overwrite_run:
            problems.append("--overwrite_run starts the run over, --load_saved_state latest continues it: give one of them")
        if self.delete_abandoned_branches and not self.overwrite_run:
            problems.append("--delete_abandoned_branches only applies with --overwrite_run")
        if self.accept_changed_dataset and self.load_saved_state is None:
            problems.append("--accept_changed_dataset only applies with --load_saved_state")
        return problems


class CountsUpdates(Stateful, Protocol):
    """The train step as the checkpointer sees it. updates_done is read after every update to see whether a save
    is due, so not through state_dict(), which reads device values (the fp16 loss scaler's scale)."""

    updates_done: int


@dataclass(frozen=True)
class RunFacts:
    """What a checkpoint records about its run besides the train step's counters; the tensors' layout among
    them must match on resume (resume_problems)."""

    optimizer: str
    weights_dtype: str
    use_ema: bool
    train_text_encoder: bool
    frozen_text_encoder: str  # "" or the name of the text encoder kept frozen (--learning_rate_te1/2 0)
    global_batch_size: int
    gradient_accumulation_steps: int
    frozen_unet_blocks: str = ""  # the UNet blocks kept frozen by --block_lr 0, comma-separated ("" if none)


def find_resume_checkpoint(load_saved_state: str | None, checkpoints_dir: Path, is_main: bool) -> tuple[Path | None, list[str]]:
    """Collective: the checkpoint folder to resume from, and what is wrong with it. 'latest' takes the newest
    intact checkpoint (None if the folder holds no checkpoint) and says which damaged ones it skipped; when
    every checkpoint is damaged it refuses, naming each: starting from the base model there would hide that the
    run started over. A named folder must be intact. Intact includes matching the checksums recorded at save,
    which every process verifies its share of."""
    if load_saved_state is None:
        return None, []
    verifications: dict[Path, Verification] = {}

    def problem_of(path: Path) -> str | None:
        verifications[path] = verify_checkpoint(path)
        return verifications[path].problem

    if load_saved_state == "latest":
        path, skipped = find_latest_checkpoint(checkpoints_dir, problem_of)
        problems = [] if path is not None or not skipped else [every_checkpoint_damaged(checkpoints_dir, skipped)]
        if is_main and path is not None:
            for damaged, reason in skipped.items():
                print(f"Skipping damaged checkpoint {damaged}: {reason}")
    else:
        path = Path(load_saved_state)
        problem = problem_of(path)
        problems = [f"--load_saved_state {path}: {problem}"] if problem else []
    if is_main and path is not None and not problems:
        print(verifications[path].describe(path))
    return path, problems


def every_checkpoint_damaged(checkpoints_dir: Path, damaged: dict[Path, str]) -> str:
    reasons = "".join(f"\n    {path.name}: {reason}" for path, reason in damaged.items())
    return (
        f"--load_saved_state latest: every checkpoint in {checkpoints_dir} is damaged, so there is nothing to continue (a start from "
        f"the base model would hide that the run starts over):{reasons}\n"
        "  Resume an intact checkpoint by name (--load_saved_state PATH, e.g. one in an abandoned_after_* folder or a copy), move the "
        f"damaged ones out of {checkpoints_dir} to start from the base model, or start over with --overwrite_run in place of "
        "--load_saved_state (deletes them)."
    )


def no_checkpoint_reason(checkpoints_dir: Path) -> str:
    """Why 'latest' finds no checkpoint to continue, for the message that it starts from the base model."""
    if not checkpoints_dir.is_dir():
        return "the folder does not exist"
    names = sorted(path.name for path in checkpoints_dir.iterdir())
    unfinished = [name for name in names if name.endswith(".tmp") and CHECKPOINT_NAME.match(name.removesuffix(".tmp"))]
    abandoned = [name for name in names if name.startswith(ABANDONED_PREFIX)]
    found = []
    if unfinished:
        found.append(f"{', '.join(unfinished)}, {'a save' if len(unfinished) == 1 else 'saves'} that never finished")
    if abandoned:
        found.append(
            f"{', '.join(abandoned)}, set aside by going back (name a checkpoint in {'it' if len(abandoned) == 1 else 'them'} with "
            "--load_saved_state to continue that branch)"
        )
    if found:
        return "it holds only " + ", and ".join(found)
    return "the folder is empty" if not names else f"it holds no checkpoint folder (only {', '.join(names)})"


def resume_problems(saved: TrainerState, facts: RunFacts, set_seed: int | None) -> list[str]:
    """What would make the checkpoint's tensors or data order not fit this run; checked before any work."""
    problems = []
    if saved.optimizer != facts.optimizer:
        problems.append(f"the checkpoint holds {saved.optimizer} optimizer state: resume with --optimizer {saved.optimizer}")
    if saved.weights_dtype != facts.weights_dtype:
        problems.append(f"the checkpoint holds {saved.weights_dtype} weights: resume with --weights_dtype {saved.weights_dtype}")
    if saved.use_ema != facts.use_ema:
        flag = "--use_ema" if saved.use_ema else "--no-use_ema"
        problems.append(f"the checkpoint was saved {'with' if saved.use_ema else 'without'} an EMA: resume with {flag}")
    if saved.train_text_encoder != facts.train_text_encoder:
        flag = "--train_text_encoder" if saved.train_text_encoder else "--no-train_text_encoder"
        problems.append(f"the checkpoint was saved {'with' if saved.train_text_encoder else 'without'} trained text encoders: resume with {flag}")
    elif saved.frozen_text_encoder != facts.frozen_text_encoder:
        for number, name in enumerate(TEXT_ENCODER_NAMES, start=1):
            if saved.frozen_text_encoder == name:
                problems.append(f"the checkpoint kept text encoder {number} frozen: resume with --learning_rate_te{number} 0")
            elif facts.frozen_text_encoder == name:
                problems.append(f"the checkpoint trained text encoder {number}: resume with --learning_rate_te{number} above 0 (0 keeps it frozen)")
    if saved.frozen_unet_blocks != facts.frozen_unet_blocks:  # the optimizer state holds the trained blocks only
        if saved.frozen_unet_blocks:
            problems.append(f"the checkpoint kept UNet blocks {saved.frozen_unet_blocks} frozen: resume with --block_lr 0 at exactly those blocks")
        else:
            problems.append(f"the checkpoint trained every UNet block: resume with no 0 in --block_lr (this run freezes blocks {facts.frozen_unet_blocks})")
    if set_seed is not None and set_seed != saved.seed:
        problems.append(f"the checkpoint's run used seed {saved.seed} (data order and noise follow it): drop --set_seed or pass {saved.seed}")
    return problems


def changed_dataset_problem(checkpoint_dir: Path, saved: TrainerState, now: DatasetIdentity, accepted: bool) -> str:
    """Why the checkpoint cannot resume on this data (other items, or the same ones in another order), "" if it can:
    its data position names items by their place in the data. With `accepted` (--accept_changed_dataset), or for a
    checkpoint saved before the data was recorded, nothing is refused (resume() says what it does instead)."""
    changes = saved.dataset.changes(now) if saved.dataset is not None else ""
    if not changes or accepted:
        return ""
    return (
        f"{checkpoint_dir} was saved training on other data ({changes}). Its data position (the items epoch {saved.epoch + 1} has "
        "trained, and those carried into it) names items by their place in the data, so on this data the rest of the epoch would "
        "train some items twice and others not at all. Resume on the caches it trained on (the run's config.json lists them), or "
        f"pass --accept_changed_dataset to go on with these: epoch {saved.epoch + 1} then starts over on them, the update count "
        "and the learning-rate schedule go on."
    )


def prepare_checkpoints_dir(checkpoints_dir: Path, resumed_update: int | None) -> None:
    """Rank 0, before a resumed run: set this folder's checkpoints of later updates aside, so
    --checkpoints_total_limit and 'latest' follow the resumed run."""
    if resumed_update is not None:
        aside, moved = set_aside_later_checkpoints(checkpoints_dir, resumed_update)
        if aside is not None:
            print(
                f"Resuming from update {resumed_update}, before this run's newer checkpoints ({', '.join(path.name for path in moved)}): moved them "
                f"to {aside}, so --checkpoints_total_limit and --load_saved_state latest follow the resumed run. Nothing was deleted."
            )


class Checkpointer:
    """Saves the run's state as a whole: the trained modules with their optimizer's state and the EMA (through
    DCP), the train step's counters and the data position, each through its own state_dict().

    Saves while training goes on (every N updates, at epoch saves) run in the background: the state is copied
    into shared CPU memory at the update (the loop's only pause), and a writer process (writer_process.py)
    writes it while the next updates train. One save is in flight at a time: the next one, and every save at
    the run's end (a stop request, a NaN stop, the end), waits for it first; those are written by the training
    processes themselves, over a gloo group of their own, so their collectives never interleave with
    training's. What makes a save count is unchanged: it is `latest` only once written, checksummed and
    renamed, and a process killed meanwhile leaves a .tmp folder beside the previous checkpoints, which stay
    as they were."""

    def __init__(self, checkpoints_dir: Path, options: CheckpointOptions, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Stateful | None,
                 step: CountsUpdates, run_facts: RunFacts, seed: int, report: Callable[[str], None], last_saved_update: int | None,
                 dataset: DatasetIdentity | None = None, writer_factory: Callable[[Path], FileSystemWriter] = JsonIndexWriter):
        """Collective (makes the writer's process group). `model`: what the checkpoint holds with the optimizer
        state (TrainedModels.checkpointed); `step`: the train step, whose state_dict() gives the counters
        (update, skipped updates, loss scaler) at a save, and updates_done the update count after each update; `run_facts`, `seed`
        and `dataset` (the data trained on; None: not recorded): the rest of trainer_state.json; `report` prints a message once (rank 0);
        `writer_factory`: DCP's writer for a folder."""
        self.checkpoints_dir = checkpoints_dir
        self.options = options
        self.model = model
        self.optimizer = optimizer
        self.ema = ema
        self.step = step
        self.run_facts = run_facts
        self.seed = seed
        self.report = report
        self.writer_factory = writer_factory
        self.dataset = dataset
        self.last_saved_update = last_saved_update
        self.last_saved_dir: Path | None = None
        self._stager = TensorStager()
        self._writer_group = dist.new_group(backend="gloo")
        self._writer: WriterProcess | None = None  # started at the first background save
        self._in_flight: _BackgroundSave | None = None

    @property
    def _updates_done(self) -> int:
        return self.step.updates_done

    def _staged(self, position: HasState) -> StagedState:
        data = position.state_dict()
        state = TrainerState(
            **self.step.state_dict(),
            **dataclasses.asdict(self.run_facts),
            **(self.dataset.as_fields() if self.dataset is not None else {}),
            seed=self.seed,
            epoch=data["epoch"],
            updates_in_epoch=data["updates_in_epoch"],
            ema_updates=self.ema.state_dict()["updates"] if self.ema is not None else 0,
            world_size=dist.get_world_size(),
        )
        return stage_training_state(self.model, self.optimizer, self.ema, state, position, self._stager)

    def save(self, position: HasState) -> Path:
        """Collective: save now and wait for it, then keep the newest checkpoints. Raises CheckpointError on every rank."""
        self.wait()
        started = time.perf_counter()
        staged = self._staged(position)
        checkpoint_dir = write_staged_state(self.checkpoints_dir / checkpoint_name(staged.trainer_state.update), staged, self._writer_group,
                                            self.writer_factory)
        self._saved(checkpoint_dir, staged.trainer_state, f"in {time.perf_counter() - started:.1f} s")
        return checkpoint_dir

    def save_in_background(self, position: HasState) -> None:
        """Collective: copy the state now, write it while training goes on (wait() ends it and reports)."""
        self.wait()
        started = time.perf_counter()
        staged = self._staged(position)
        checkpoint_dir = self.checkpoints_dir / checkpoint_name(staged.trainer_state.update)
        if self._writer is None:
            self._writer = WriterProcess.start(self._writer_group)
        self._writer.send(save_request(checkpoint_dir, staged, self._stager.buffer, self.writer_factory))
        self._in_flight = _BackgroundSave(checkpoint_dir, staged.trainer_state, time.perf_counter() - started, self._writer)

    def writing_in_background(self) -> bool:
        """Whether a background save's writer is still writing (not collective)."""
        return self._in_flight is not None and not self._writer.answered()

    def wait(self) -> None:
        """Collective: the background save in flight ended (a failure is a warning: training goes on) and reported."""
        save, self._in_flight = self._in_flight, None
        if save is None:
            return
        error = save.join()
        if isinstance(error, CheckpointError):
            self.report(f"Warning: {error} Training goes on.")
        elif error is not None:
            raise error
        else:
            self._saved(save.checkpoint_dir, save.state, f"(the loop paused {save.staging_s:.1f} s to copy it; written in the background in {save.writing_s:.1f} s)")

    def close(self) -> None:
        """Collective: waits for the save in flight (wait()), then ends the writer process; a later background
        save starts another."""
        self.wait()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _saved(self, checkpoint_dir: Path, state: TrainerState, how: str) -> None:
        """A save is written: it is the newest, and the limit removes older ones. A save made while updates are being
        skipped (the state's counter, read from the device at the save, never at an update) keeps the last good
        checkpoint from before the streak besides the limit's (checkpoints_folder.remove_old_checkpoints)."""
        self.last_saved_update, self.last_saved_dir = state.update, checkpoint_dir
        if dist.get_rank() == 0:
            streak = state.consecutive_skipped_updates
            removed = remove_old_checkpoints(self.checkpoints_dir, self.options.checkpoints_total_limit, saved=checkpoint_dir,
                                             streak_start=state.update - streak + 1 if streak else None)
            self.report(f"Saved state to {checkpoint_dir} {how}" + (f"; removed {len(removed)} older" if removed else "") + ".")

    def checkpoint_before_streak(self, streak_start: int) -> Path | None:
        """The newest intact checkpoint of this run from before the weights a streak of skipped updates starting at
        update `streak_start` started from (checkpoints_folder.last_checkpoint_before_streak): the one to resume from."""
        return last_checkpoint_before_streak(intact_checkpoints(self.checkpoints_dir, self._updates_done), streak_start)

    @property
    def _unsaved(self) -> bool:
        return self.options.save_state and self.last_saved_update != self._updates_done and (
            self._in_flight is None or self._in_flight.update != self._updates_done)

    def after_update(self, position: HasState) -> None:
        every = self.options.save_state_every_n_updates
        if self.options.save_state and every and self._updates_done % every == 0:
            self.save_in_background(position)

    def at_epoch_save(self, position: HasState) -> None:
        if self._unsaved:
            self.save_in_background(position)

    def before_exit(self, position: HasState, even_without_save_state: bool = False) -> Path | None:
        """Wait for the save in flight, then save the state of a run that ends now unless it is saved already;
        returns the newest checkpoint. Raises CheckpointError. A stop request or a NaN stop saves even with
        --no-save_state: the run is cut short."""
        self.close()
        if self.last_saved_update != self._updates_done and (self.options.save_state or even_without_save_state):
            self.save(position)
        return self.last_saved_dir


class _BackgroundSave:
    """One save handed to the writer process; join() gives the error it ended with (None: saved)."""

    def __init__(self, checkpoint_dir: Path, state: TrainerState, staging_s: float, writer: WriterProcess):
        self.checkpoint_dir = checkpoint_dir
        self.state = state
        self.update = state.update
        self.staging_s = staging_s
        self.writing_s = 0.0
        self._writer = writer

    def join(self) -> BaseException | None:
        reply = self._writer.reply()
        self.writing_s = reply.get("seconds", 0.0)
        if "checkpoint_error" in reply:
            return CheckpointError(reply["checkpoint_error"])
        if "error" in reply:
            return RuntimeError(f"The background save of {self.checkpoint_dir.name} failed in its writer process:\n{reply['error']}")
        return None
