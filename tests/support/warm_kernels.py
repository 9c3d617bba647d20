"""Imported by the warm launcher's server (warm_launch.PRELOADED_MODULES): compiles the optimizer kernels the
trainer compiles on its first update, so that every rank forked from the server inherits them.

The 8-bit AdamW step, its fp32 step for small shards and the stochastic rounding to bf16 are compiled with
dynamic shapes, once per weights dtype and beta2 (a guard of the compiled step): tracing them again took
each rank 3-4 s of its ~10 s on the tiny model, even with inductor's cache on disk. Here they run once,
through the trainer's own optimizer with its default settings, on fp32 and on bf16 weights (what
--weights_dtype gives). A rank compiles for itself what it meets beyond these (another beta2, --compile's
UNet blocks), as does every rank started through the real launcher (test_launch.py tests the compile cache
in a fresh process).

What the server holds when it forks, every rank inherits, and a lock another thread holds at the fork
stays held in the child forever: the server forks from one thread. So it computes on one thread (a forked
child hangs in OpenMP's pool) and compiles in-process: on a cache miss (a fresh clone, as in CI) inductor
compiles in a pool (a thread and worker processes), and a rank that compiled anything more waited forever
on the pool it inherited without its thread (a 600 s timeout in CI). No tqdm monitor thread either: the
first tqdm bar starts one (torch.fx's interpreter opens a disabled bar while compiling), which takes tqdm's
lock every 10 s. Nor tqdm's default lock, a cross-process semaphore made with the first bar: made here, it
would be shared by every rank, and one rank killed while holding it (tests kill ranks; a bar takes it at
each refresh) would hang every later rank at its first bar. The server gives tqdm a lock of its own, which
each rank copies.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch
import torch._inductor.config
from tqdm import tqdm

from sdxl_trainer.distributed.world import compile_cache_root
from sdxl_trainer.jobs.train_config import TrainConfig
from sdxl_trainer.optimizers.build import build_optimizer

if torch.get_num_threads() != 1:
    raise RuntimeError(f"warm_kernels runs with OMP_NUM_THREADS=1 (now {torch.get_num_threads()} threads): forked ranks would hang in OpenMP")

DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
# Values: one shard stepped with 8-bit moments (a multiple of the 256-value block, at least 4,096 values)
# and one small enough for fp32 moments.
_QUANTISED_SHARD, _SMALL_SHARD = 8192, 300


def _step(weights_dtype: torch.dtype) -> None:
    parameters = [torch.nn.Parameter(torch.randn(values, dtype=weights_dtype)) for values in (_QUANTISED_SHARD, _SMALL_SHARD)]
    optimizer = build_optimizer(
        "adamw8bit", parameters, DEFAULTS["learning_rate"], DEFAULTS["weight_decay"], (DEFAULTS["adam_beta1"], DEFAULTS["adam_beta2"]),
        DEFAULTS["adam_epsilon"],
    )
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()


_saved_cache_dir, _saved_monitor_interval = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), tqdm.monitor_interval
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_root() / "warm_launcher")  # kept across sessions
tqdm.monitor_interval = 0  # no monitor thread; a rank's own bars start one in the rank
tqdm.set_lock(threading.RLock())
try:
    with torch._inductor.config.patch(compile_threads=1):
        for weights_dtype in (torch.float32, torch.bfloat16):
            _step(weights_dtype)
finally:
    tqdm.monitor_interval = _saved_monitor_interval
    if _saved_cache_dir is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _saved_cache_dir

_other_threads = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
if _other_threads:
    raise RuntimeError(f"the warm launcher's server would fork with other threads running ({_other_threads}): a lock they hold would hang the ranks")
