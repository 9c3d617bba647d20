"""Run under the launcher by test_host_waits.py: one rank of a trainer run, every update's host work counted;
writes COUNTS_DIR/rank<R>.json.

    host_waits_worker.py COUNTS_DIR TRAINER_FLAGS...
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from counted_runs import count_trainer_updates

from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed


def main() -> None:
    counts_dir, flags = Path(sys.argv[1]), sys.argv[2:]
    world = init_distributed()
    updates = count_trainer_updates(flags, world)
    counts_dir.mkdir(parents=True, exist_ok=True)
    (counts_dir / f"rank{world.rank}.json").write_text(json.dumps([dataclasses.asdict(update) for update in updates]))
    shutdown_distributed()


if __name__ == "__main__":
    main()
