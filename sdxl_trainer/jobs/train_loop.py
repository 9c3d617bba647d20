"""The training loop: an update, its log line, then whatever is due after it.
"""

from __future__ import annotations

import os
import time

from sdxl_trainer.jobs.train_build import Run
from sdxl_trainer.state.checkpoint import CheckpointError


def run_loop(run: Run) -> None:
    """The training loop: an update, its log line, then whatever is due after it (a stop, a save, a
    validation, an epoch's end), until the data stream ends; then the run finishes (state, model)."""
    config, monitor, step, checkpointer, evaluator = run.config, run.monitor, run.train_step, run.checkpointer, run.evaluator
    if not run.resumed:
        evaluator.run_and_report(0, run.models, run.ema, monitor.metrics, run.first_update)
    if config.optimizer == "adamw8bit" or config.compile_unet:
        monitor.say(
            f"The first update compiles kernels ({'the 8-bit AdamW step' if config.optimizer == 'adamw8bit' else 'the UNet blocks'}): "
            f"seconds to a minute on a GPU, up to several minutes on a CPU, then reused from {os.environ['TORCHINDUCTOR_CACHE_DIR']} by later runs."
        )
    monitor.throughput.start()
    for update in run.stream:
        monitor.throughput.data_ready()
        started = time.perf_counter()
        result = step(update.microbatches, update.epoch)
        if step.updates_done == run.first_update + 1:
            monitor.say(f"First update done in {time.perf_counter() - started:.1f} s.")
        monitor.throughput.stop(update.images)
        monitor.log_update(step.updates_done, update.epoch, result.loss, result.learning_rate, result.grad_norm, result.stepped, step.skipped_updates)
        if step.consecutive_skipped_updates >= config.max_consecutive_skipped_updates:
            checkpoint_dir = checkpointer.before_exit(update.position_after, even_without_save_state=True)
            raise SystemExit(
                f"Stopped at update {step.updates_done}: the last {step.consecutive_skipped_updates} updates all had a NaN/inf "
                f"loss or gradient. State saved to {checkpoint_dir}. Lower --learning_rate, use --mixed_precision bf16 instead of fp16, "
                "or check the cache with sdxl_process_data_dir.py --verify."
            )
        if run.stop.agreed(run.world.device):
            try:
                checkpoint_dir = checkpointer.before_exit(update.position_after, even_without_save_state=True)
            except CheckpointError as error:
                raise SystemExit(f"Stop requested at update {step.updates_done}, and the state could not be saved: {error}") from error
            monitor.say(f"Stopped on request after update {step.updates_done}. Resume with: --load_saved_state latest (or {checkpoint_dir}).")
            return
        checkpointer.after_update(update.position_after)
        if evaluator.due_after_update(step.updates_done):
            evaluator.run_and_report(None, run.models, run.ema, monitor.metrics, step.updates_done)
        last_update = step.updates_done == run.total_updates
        if update.ends_epoch:
            finished_epochs = update.epoch + 1
            monitor.log_epoch(finished_epochs)
            if not (config.max_train_updates and last_update):  # the final validation below covers it
                evaluator.run_and_report(finished_epochs, run.models, run.ema, monitor.metrics, step.updates_done)
            if not last_update and run.exporter.epoch_save_due(finished_epochs):
                run.exporter.export_epoch(finished_epochs, monitor.say)
                checkpointer.at_epoch_save(update.position_after)
        monitor.throughput.start()
    if config.max_train_updates and not evaluator.due_after_update(step.updates_done):
        # The run ends inside an epoch or at an epoch end without its own validation: validate what is exported.
        evaluator.run_and_report(None, run.models, run.ema, monitor.metrics, step.updates_done)
    run.exporter.finish(checkpointer, run.stream.position, monitor)
    monitor.say(f"TensorBoard logs: {run.log_dir}   (view with: tensorboard --logdir {run.log_dir})")
