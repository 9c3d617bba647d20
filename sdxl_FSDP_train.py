"""Full fine-tuning of the SDXL UNet (and optionally both text encoders) from a latent cache, sharded with
PyTorch FSDP2 over every process.

Launch with train.sh (torchrun, one process per GPU; 2 CPU processes without a GPU), or accelerate launch.
Reads caches written by sdxl_process_data_dir.py, so only the UNet is loaded (the text encoders too in
caption mode, --encode_captions_each_step), never the VAE. Flags override a --config TOML file, which
overrides the defaults; every flag is listed below and in docs/flags.md.
"""

from __future__ import annotations

import os
import sys

from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.watchdog import JobWatchdog
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.jobs.train_build import EXPECTED_ERRORS, build_run, hold_run_folder
from sdxl_trainer.jobs.train_config import TrainConfig, memory_settings, speed_settings
from sdxl_trainer.jobs.train_loop import run_loop
from sdxl_trainer.monitoring.console_log import ConsoleLog
from sdxl_trainer.runtime.garbage_collection import exempt_live_objects_from_garbage_collection


def main(argv: list[str] | None = None) -> int:
    # 1. Configuration. Every process reads the flags; only the first says what is wrong with them.
    config = parse_config(TrainConfig, argv, description=__doc__, quiet=os.environ.get("RANK", "0") != "0")
    if config.estimate_memory:
        from sdxl_trainer.estimates.memory_estimate import print_memory_estimate

        print_memory_estimate(memory_settings(config))
        return 0
    if config.estimate_speed:
        from sdxl_trainer.estimates.speed_estimate import print_speed_estimate

        print_speed_estimate(speed_settings(config))
        return 0
    world = init_distributed(config.replicate_groups)
    exempt_live_objects_from_garbage_collection()
    run_dir = config.output_dir / config.project_name
    # Rank 0's console also goes to train.log in the run folder; any error on any rank ends every process of
    # the job with its message (the watchdog); one run at a time holds the run folder.
    with (
        ConsoleLog(run_dir / "train.log", world.is_main) as console_log,
        JobWatchdog(world.rank, world.world_size, EXPECTED_ERRORS, log_only=console_log.write_to_file_only),
        hold_run_folder(run_dir, world),
    ):
        # 2. Build: every check before anything loads, then data, models, optimizer, train step, logging,
        # evaluator, checkpointer and exporter.
        run = build_run(config, world)
        # 3. The loop: updates until the data stream ends, then the final state and the exported model.
        try:
            run_loop(run)
        finally:
            run.close()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
