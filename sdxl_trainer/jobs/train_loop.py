"""The training loop: an update, its log line, then whatever is due after it.
"""

from __future__ import annotations

import os
import time

from sdxl_trainer.jobs.train_build import Run
from sdxl_trainer.state.checkpoint_layout import CheckpointError
from sdxl_trainer.training.stream import DataPosition


def run_loop(run: Run) -> None:
    """The training loop: an update, its log line, then whatever is due after it (a stop, a save, a
    validation, an epoch's end), until the data stream ends; then the run finishes (state, model)."""
    config, monitor, step, checkpointer, evaluator = run.config, run.monitor, run.train_step, run.checkpointer, run.evaluator
    if not run.resumed:
        evaluator.before_training(run.models, run.ema, monitor.metrics, run.first_update)
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
            first_loss = result.loss  # read back, which waits for the update to finish: the time below is the device's too
            monitor.say(f"First update done in {time.perf_counter() - started:.1f} s (loss {first_loss:.4f}).")
        monitor.throughput.stop(update.images)
        stop_agreed = monitor.log_update(step.updates_done, update.epoch, result, stop_requested=run.stop.requested)
        # Checked when the update's figures have been read (when the monitor logs), so the host never waits for them.
        if result.is_read and result.skipped_in_a_row >= config.max_consecutive_skipped_updates:
            raise SystemExit(stop_after_skipped_updates(run, update.position_after, result.skipped_in_a_row))
        if stop_agreed:  # a stop requested on any rank, agreed in the log's exchange: every rank stops after this update
            try:
                checkpoint_dir = checkpointer.before_exit(update.position_after, even_without_save_state=True)
            except CheckpointError as error:
                raise SystemExit(f"Stop requested at update {step.updates_done}, and the state could not be saved: {error}") from error
            monitor.say(f"Stopped on request after update {step.updates_done}. Resume with: --load_saved_state latest (or {checkpoint_dir}).")
            return
        run.garbage.after_update(step.updates_done)
        checkpointer.after_update(update.position_after)
        last_update = step.updates_done == run.total_updates
        finished_epochs = update.epoch + 1 if update.ends_epoch else None
        if finished_epochs is not None:
            monitor.log_epoch(finished_epochs)
        evaluator.after_update(step.updates_done, finished_epochs, last_update, run.models, run.ema, monitor.metrics)
        if finished_epochs is not None and not last_update and run.exporter.epoch_save_due(finished_epochs):
            run.exporter.export_epoch(finished_epochs, monitor.say)
            checkpointer.at_epoch_save(update.position_after)
        monitor.throughput.start()
    evaluator.at_run_end(step.updates_done, run.models, run.ema, monitor.metrics)
    finish(run)
    monitor.say(f"TensorBoard logs: {run.log_dir}   (view with: tensorboard --logdir {run.log_dir})")


def stop_after_skipped_updates(run: Run, position: DataPosition, skipped: int) -> str:
    """Collective: save the state of a run whose last `skipped` updates were all skipped, and say which checkpoint to
    resume from. Skipped updates change no weight, so they all started from the weights of the update before them,
    which may have blown the weights up with a finite loss: the one to resume from is the last checkpoint from before
    that update, which the checkpoints saved since never rotated out (Checkpointer._saved)."""
    stopped_at = run.train_step.updates_done
    last_stepped = stopped_at - skipped  # the update whose weights every skipped one started from
    state_dir = run.checkpointer.before_exit(position, even_without_save_state=True)
    good = run.checkpointer.checkpoint_before_streak(last_stepped + 1)
    resume = (
        f"Resume from {good}, the last checkpoint from before update {last_stepped}, with a lower --learning_rate (--load_saved_state {good})"
        if good is not None else
        f"No checkpoint from before update {last_stepped} is in {run.checkpointer.checkpoints_dir} (with saves every update, "
        "--checkpoints_total_limit 2 or more keeps one from before a blow-up): start again from the base model with a lower --learning_rate"
    )
    return (
        f"Stopped at update {stopped_at}: the last {skipped} updates all had a NaN/inf loss or gradient and were skipped, so the weights are "
        f"still those of update {last_stepped}, which they all started from. {resume}; or use --mixed_precision bf16 instead of fp16, or "
        f"check the cache with sdxl_process_data_dir.py --verify. The state at the stop is in {state_dir} (its weights are the ones that failed)."
    )


def finish(run: Run) -> None:
    """Collective, the end of a run: its state, then the model. A state that cannot be saved still lets the
    model be exported, then ends the job with exit code 1."""
    run.monitor.close()
    try:
        run.checkpointer.before_exit(run.stream.position)
        state_error = None
    except CheckpointError as error:
        state_error = error
        run.monitor.say(f"Warning: {error} The model export below goes on.")
    run.exporter.export_final()
    if state_error is not None:
        raise SystemExit(f"Training finished, but its final state could not be saved: {state_error}")
