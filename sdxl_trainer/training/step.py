"""One optimizer update: microbatches with gradient sync on the last one only, clipping of the true
gradients (of the UNet, and of the text encoders where they are trained), a finite-ness check agreed by
every rank, the optimizer step at the scheduled rate, the EMA.

An update whose loss or gradient norm is NaN/inf is skipped (no optimizer step, no EMA update), counted
and reported; with fp16 the gradient scaler also lowers its scale. It still counts as an update: its
batches are spent and the schedule moves on, so the epoch plan, the schedule's length and a resume stay
exactly those of a run without the fault (a retry would have to redraw data the plan has used). The
trainer stops (after saving state) when too many updates in a row are skipped.

The skip is decided on the device (every optimizer here takes the verdict: StepsIfFinite; with fp16 the
verdict covers the loss scaler's overflow check too): the host queues the next update without waiting for
this one, and reads an update's figures (UpdateResult) only when the monitor logs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from sdxl_trainer.config import option
from sdxl_trainer.optimizers.shards import StepsIfFinite
from sdxl_trainer.training.captions import StepCaptionEncoder
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.gradient_norm import clip_gradients
from sdxl_trainer.training.loss import training_loss
from sdxl_trainer.training.lr_schedule import LearningRateSchedule, set_learning_rate
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import NOISE_KEY, SampleDraws

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import DDPMScheduler


@dataclass(kw_only=True)
class StepOptions:
    """The update: clipping, skipped updates, gradient reduction"""

    max_grad_norm: float = option(1.0, help="clip the global gradient norm to this; 0 = no clipping (the norm is still logged)")
    max_consecutive_skipped_updates: int = option(
        10, help="stop (after saving state) when this many updates in a row have a NaN/inf loss or gradient and are skipped "
        "(checked when the scalars are written, every --log_every_n_updates)",
    )
    gc_every_n_updates: int = option(
        50,
        help="Python's automatic garbage collection is off during training; every rank collects together after every N updates "
        "instead (an automatic collection would pause one rank inside an update while the others wait for it); 0 = automatic",
    )
    gradient_reduction: Literal["auto", "every_microbatch", "once_per_update"] = option(
        "auto",
        help="when accumulated gradients are reduce-scattered: once_per_update (least communication; FSDP2 holds the full "
        "fp32 gradient, 10.3 GB for SDXL, on every GPU meanwhile) or every_microbatch (sharded gradients only, more "
        "communication); auto = every_microbatch on GPUs under 40 GB with accumulation, else once_per_update; "
        "unused on one process without --cpu_offload (the UNet is not sharded there)",
    )
    optimizer_in_backward: bool = option(
        False,
        help="step each unit's weights inside backward as soon as its gradients are final (after its reduce-scatter under "
        "FSDP2) and free them at once, so the whole model's gradients are never held (docs/training.md); needs "
        "--max_grad_norm 0 and --gradient_accumulation_steps 1, no fp16, not prodigy nor adamw_schedulefree; a NaN/inf "
        "skips per unit",
    )

    def problems(self) -> list[str]:
        problems = []
        if self.max_grad_norm < 0:
            problems.append("--max_grad_norm must be >= 0 (0 turns clipping off)")
        if self.max_consecutive_skipped_updates < 1:
            problems.append("--max_consecutive_skipped_updates must be at least 1")
        if self.gc_every_n_updates < 0:
            problems.append("--gc_every_n_updates must be >= 0 (0 = Python's automatic garbage collection)")
        return problems


def _average_over_ranks(value: torch.Tensor) -> None:
    """`value` replaced by its mean over the ranks. One process skips the collective, which a GPU would still
    launch (benchmarks/count_host_work.py counted it on every update)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.AVG)


class UpdateResult:
    """An update's figures, left on the device until they are first read: the first read of any of them
    waits for the update to finish and fetches them all in one transfer (read_together: many updates' in
    one). The training loop reads them only when it logs."""

    def __init__(self, figures: torch.Tensor, learning_rate: float):
        self._figures = figures  # on the device: loss, gradient norm, stepped (1/0), skipped updates so far, skipped in a row
        self._values: list[float] | None = None
        self.learning_rate = learning_rate  # the learning rate this update used (or would have used, if skipped)

    @staticmethod
    def read_together(results: list[UpdateResult]) -> None:
        """Fetch the figures of every result not read yet, in one transfer."""
        unread = [result for result in results if result._values is None]
        if unread:
            for result, values in zip(unread, torch.stack([result._figures for result in unread]).tolist()):
                result._values = values

    @property
    def is_read(self) -> bool:
        return self._values is not None

    def _read(self) -> list[float]:
        if self._values is None:
            UpdateResult.read_together([self])
        return self._values

    @property
    def loss(self) -> float:
        """Mean loss over every sample of the update, all ranks."""
        return self._read()[0]

    @property
    def grad_norm(self) -> float:
        """Global norm of the true (unscaled) gradients, before clipping."""
        return self._read()[1]

    @property
    def stepped(self) -> bool:
        """False when the update was skipped for a NaN/inf loss or gradient."""
        return self._read()[2] == 1.0

    @property
    def skipped_updates(self) -> int:
        """Updates skipped so far in the run, this one included."""
        return int(self._read()[3])

    @property
    def skipped_in_a_row(self) -> int:
        """Updates skipped in a row, ending with this one (0 when it stepped)."""
        return int(self._read()[4])


class TrainStep:
    def __init__(
        self,
        unet: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        learning_rate: LearningRateSchedule,
        noise_scheduler: DDPMScheduler,
        noise_settings: NoiseSettings,
        empty_prompt: tuple[torch.Tensor, torch.Tensor],
        run_seed: int,
        max_grad_norm: float,
        scaler: torch.amp.GradScaler | None = None,
        ema: ShardedEMA | None = None,
        reduce_every_microbatch: bool = False,
        caption_encoder: StepCaptionEncoder | None = None,
        gather_once_per_update: bool = False,
        optimizer_in_backward: bool = False,
    ):
        """unet: FSDP2-sharded, or a plain module on one process (parallel.prepare_unet).
        reduce_every_microbatch (sharded UNets): reduce-scatter gradients after every microbatch (sharded gradients only:
        less memory, more communication) instead of once per update (FSDP2 then holds the full unsharded
        fp32 gradient on every GPU until the last microbatch).
        gather_once_per_update (sharded UNets that keep their weights gathered from forward to backward,
        --no-reshard_after_forward): keep them gathered from one microbatch to the next too, so each unit is
        gathered once per update instead of once per microbatch; the peak memory is the same, as every
        microbatch already holds them all at once.
        optimizer_in_backward: step each unit inside backward (in_backward.py), one microbatch per update, without
        clipping or loss scaling."""
        self.unet = unet
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.updates_done = 0
        self.noise_scheduler = noise_scheduler
        self.noise_settings = noise_settings
        self.draws = SampleDraws(run_seed, noise_settings)
        self.empty_prompt = empty_prompt
        self.run_seed = run_seed
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.ema = ema
        self.reduce_every_microbatch = reduce_every_microbatch
        self.gather_once_per_update = gather_once_per_update
        self.caption_encoder = caption_encoder  # caption mode: encode this step's caption variations (captions.py)
        # With --train_text_encoder the encoders are trained too: clipping sees every trained gradient.
        self.trained_parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        trained_encoders = caption_encoder.text_encoders if caption_encoder is not None and caption_encoder.trains else ()
        self.sharded_modules = [module for model in (unet, *trained_encoders) for module in model.modules() if isinstance(module, FSDPModule)]
        self._skip_counts = torch.zeros(2, dtype=torch.int64)  # skipped updates in all, and in a row; moved to the device by the first update
        self.in_backward = None
        if optimizer_in_backward:
            if max_grad_norm or scaler is not None:
                raise ValueError("the optimizer in backward steps before the global gradient norm exists and cannot take fp16's loss "
                                 "scaling: max_grad_norm must be 0 and no scaler")  # fmt: skip
            from sdxl_trainer.training.in_backward import OptimizerInBackward

            self.in_backward = OptimizerInBackward(optimizer, [unet, *trained_encoders])

    @property
    def skips_on_device(self) -> bool:
        """Whether the optimizer is told the update's verdict on the device instead of being stepped or not
        (every optimizer of optimizers/build.py is; a torch optimizer is not)."""
        return isinstance(self.optimizer, StepsIfFinite)

    @property
    def skipped_updates(self) -> int:
        """Updates skipped so far (a read from the device)."""
        return int(self._skip_counts[0])

    @property
    def consecutive_skipped_updates(self) -> int:
        """Updates skipped in a row up to the last one (a read from the device)."""
        return int(self._skip_counts[1])

    def state_dict(self) -> dict:
        """Plain (JSON-able) state beside the tensors: updates done, loss scaler, skip counters (named as in
        the checkpoint's TrainerState)."""
        return {
            "update": self.updates_done,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "skipped_updates": self.skipped_updates,
            "consecutive_skipped_updates": self.consecutive_skipped_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore after the optimizer. The rate of the next update follows from updates_done and this
        run's schedule settings, so a resume may change --learning_rate (or the schedule) from then on."""
        self.updates_done = state["update"]
        if self.scaler and state["loss_scaler"]:
            self.scaler.load_state_dict(state["loss_scaler"])
        self._skip_counts = torch.tensor([state["skipped_updates"], state["consecutive_skipped_updates"]], dtype=torch.int64)

    def __call__(self, microbatches: list[dict[str, torch.Tensor]], epoch: int) -> UpdateResult:
        if self.in_backward is not None:
            return self._update_in_backward(microbatches, epoch)
        device = microbatches[0]["latents"].device
        loss_sum = torch.zeros((), device=device)
        for index, batch in enumerate(microbatches):
            last = index == len(microbatches) - 1
            for module in self.sharded_modules:
                # FSDP2 reduce-scatters gradients only when this is True; before that they accumulate unsharded.
                module.set_requires_gradient_sync(self.reduce_every_microbatch or last, recurse=False)
                if self.gather_once_per_update:
                    module.set_reshard_after_backward(last, recurse=False)
            loss = self._microbatch_loss(batch, epoch) / len(microbatches)  # the mean over the update's samples, normalised once
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        _average_over_ranks(loss_sum)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip and check the true gradients, not the scaled ones
        grad_norm = clip_gradients(self.trained_parameters, self.max_grad_norm or math.inf).to(device, torch.float32)
        # Both values are global (all-reduced), so every rank takes the same decision.
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        learning_rate = self.learning_rate(self.updates_done)
        set_learning_rate(self.optimizer, learning_rate)
        if self.skips_on_device:
            # With fp16, the unscaled gradients' norm is not finite wherever the scaler found an overflow, so the
            # verdict covers its found_inf too; its update() below lowers the scale from what unscale_ recorded.
            self.optimizer.step(finite=finite)
        elif bool(finite):  # an optimizer that cannot take the verdict: the host decides, a read from the device
            if self.scaler:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        if self.ema is not None:
            self.ema.update(finite)
        if self.scaler:
            self.scaler.update()  # lowers the scale after an overflow
        self.optimizer.zero_grad(set_to_none=True)
        self.updates_done += 1
        return self._result(loss_sum, grad_norm, finite, learning_rate)

    def _microbatch_loss(self, batch: dict[str, torch.Tensor], epoch: int) -> torch.Tensor:
        """The microbatch's mean loss (the draws made here for a batch that did not come through the data stream,
        which draws in its workers; in caption mode the captions encoded here)."""
        empty_prompt = self.empty_prompt
        if NOISE_KEY not in batch:
            batch = self.draws(batch, epoch)
        if self.caption_encoder is not None:
            batch, trained_empty_prompt = self.caption_encoder(batch, epoch)
            empty_prompt = trained_empty_prompt or empty_prompt
        return training_loss(self.unet, batch, self.noise_scheduler, empty_prompt, self.run_seed, epoch, self.noise_settings, batch.get("loss_weight"))

    def _update_in_backward(self, microbatches: list[dict[str, torch.Tensor]], epoch: int) -> UpdateResult:
        """The update with the optimizer stepped inside backward (in_backward.py): the rate is set and the loss
        all-reduced before backward, so each unit can step when its gradients are final; no clipping."""
        if len(microbatches) != 1:
            raise ValueError(f"--optimizer_in_backward steps in backward and cannot accumulate: got {len(microbatches)} microbatches")
        learning_rate = self.learning_rate(self.updates_done)
        set_learning_rate(self.optimizer, learning_rate)
        loss = self._microbatch_loss(microbatches[0], epoch)
        loss_sum = loss.detach().clone()
        _average_over_ranks(loss_sum)
        self.in_backward.begin(torch.isfinite(loss_sum))
        loss.backward()
        grad_norm, finite = self.in_backward.finish()
        if self.ema is not None:
            self.ema.update(finite)
        self.optimizer.zero_grad(set_to_none=True)  # any gradient left on a parameter outside the optimizer
        self.updates_done += 1
        return self._result(loss_sum, grad_norm.float(), finite, learning_rate)

    def _result(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor, learning_rate: float) -> UpdateResult:
        """Counts the update as skipped where `finite` is False (on the device) and gathers its figures."""
        device = loss_sum.device
        skipped = (~finite).long()
        counts = self._skip_counts.to(device)
        self._skip_counts = torch.stack([counts[0] + skipped, (counts[1] + 1) * skipped])
        figures = torch.cat([torch.stack([loss_sum.float(), grad_norm, finite.float()]), self._skip_counts.float()])
        return UpdateResult(figures, learning_rate)
