"""The training loop: an update, its log line, then whatever is due after it.
"""

from __future__ import annotations

import os
import time

from sdxl_trainer.jobs.train_build import Run
from sdxl_trainer.state.checkpoint_layout import CheckpointError


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
            checkpoint_dir = checkpointer.before_exit(update.position_after, even_without_save_state=True)
            raise SystemExit(
                f"Stopped at update {step.updates_done}: the last {result.skipped_in_a_row} updates all had a NaN/inf "
                f"loss or gradient. State saved to {checkpoint_dir}. Lower --learning_rate, use --mixed_precision bf16 instead of fp16, "
                "or check the cache with sdxl_process_data_dir.py --verify."
            )
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
