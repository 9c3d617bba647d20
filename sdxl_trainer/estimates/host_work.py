"""The host's work in a stretch of training, counted on any machine: what sets an update's pace when the GPU
waits for Python (docs/gpu_results.md).

- ops: operators dispatched to a kernel outside compiled regions (views, which launch nothing, left out): a
  stand-in for the kernel launches the host makes, by the part of the update that made them, and by name;
- reads: every read of a tensor's value on the host (.item(), .tolist(), a truth value, ...), by place: on a GPU
  each waits for the device to catch up; and every copy of host values to a device made by torch.tensor or
  torch.as_tensor with a `device` (a list, a number): on a GPU that copy is blocking, and torch waits for the
  device's whole queue after it (copy to the device with non_blocking=True instead);
- collectives: by kind and process group, calls and bytes (FSDP2's all-gathers and reduce-scatters over the
  training group; a collective over a gloo group of CPU tensors blocks the host until every rank is there).

A public dispatch mode and a function mode, no patch. The dispatch mode ignores compile internals (torch's
TorchDispatchMode.ignore_compile_internals), so compiled code runs compiled under it and only the operators it
calls through the dispatcher are seen, not those fused into its kernels.
"""

from __future__ import annotations

import gc
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# The tensor methods that read a value on the host (on a GPU, each waits for the device to catch up).
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"})
# The factories that copy host values to their `device` argument; on a GPU a blocking copy: the host waits for
# the device's queue to drain after it, as after a read.
HOST_VALUE_COPIES = frozenset({"tensor", "as_tensor"})
COLLECTIVES = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast", "barrier": "barrier",
}  # fmt: skip
# The parts of an update, by the code on the Python stack (the innermost match wins); anything else is "step".
PARTS = (
    ("sdxl_trainer/optimizers/", None, "optimizer"),
    ("torch/optim/", None, "optimizer"),
    ("sdxl_trainer/training/gradient_norm.py", "clip_gradients", "clipping"),
    ("sdxl_trainer/training/ema.py", None, "EMA"),
    ("torch/autograd/graph.py", "_engine_run_backward", "backward"),
    ("sdxl_trainer/training/loss.py", None, "forward"),
    ("sdxl_trainer/training/captions.py", None, "forward"),
    ("sdxl_trainer/training/stream.py", None, "data"),
    ("torch/utils/data/", None, "data"),
    ("sdxl_trainer/monitoring/", None, "logging"),
    ("sdxl_trainer/distributed/stop_request.py", None, "stop agreement"),
    ("sdxl_trainer/state/", None, "checkpointer"),
    ("sdxl_trainer/evaluation/", None, "evaluation"),
)


_PART_OF_CODE: dict = {}  # code object -> its part, or None: the stack is walked per operator, each code matched once


def _part_of(code) -> str | None:
    if code not in _PART_OF_CODE:
        _PART_OF_CODE[code] = next(
            (part for place, name, part in PARTS if place in code.co_filename and (name is None or name == code.co_name)), None
        )
    return _PART_OF_CODE[code]


def _part_of_caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        part = _part_of(frame.f_code)
        if part is not None:
            return part
        frame = frame.f_back
    return "step"


def _group_name(args: tuple) -> str:
    """The process group of a c10d operator's arguments (passed boxed, as the first script object)."""
    boxed = next((arg for arg in args if isinstance(arg, torch.ScriptObject)), None)
    return torch._C._distributed_c10d.ProcessGroup.unbox(boxed).group_name if boxed is not None else "?"


def _tensor_bytes(value) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor))


@dataclass
class HostWorkCounts:
    ops: Counter = field(default_factory=Counter)  # part -> operators dispatched (views left out)
    operators: Counter = field(default_factory=Counter)  # operator name (aten's, without overload) -> dispatched
    reads: Counter = field(default_factory=Counter)  # (file, function) -> host reads
    collective_calls: Counter = field(default_factory=Counter)  # (kind, group name) -> calls
    collective_bytes: Counter = field(default_factory=Counter)  # (kind, group name) -> bytes of the input
    # Python garbage collections: "between updates" (the trainer's CollectBetweenUpdates) or "automatic" (gc's
    # thresholds, wherever an allocation crossed them)
    garbage_collections: Counter = field(default_factory=Counter)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())

    def calls(self, kind: str, group_name: str | None = None) -> int:
        return sum(count for (each, group), count in self.collective_calls.items() if each == kind and group_name in (None, group))

    def bytes(self, kind: str, group_name: str | None = None) -> int:
        return sum(count for (each, group), count in self.collective_bytes.items() if each == kind and group_name in (None, group))


class _Dispatched(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled under this mode (torch.compile turns it off while compiling): it sees
        what the compiled code dispatches, not the operators fused into its kernels."""
        return True

    def __init__(self, counts: HostWorkCounts, by_part: bool):
        super().__init__()
        self.counts, self.by_part = counts, by_part

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = COLLECTIVES.get(func.overloadpacket.__name__) if func.namespace == "c10d" else None
        if kind is not None:
            key = (kind, _group_name(args))
            self.counts.collective_calls[key] += 1
            sent = {"all_gather": 1, "reduce_scatter": 1}.get(kind, 0)
            self.counts.collective_bytes[key] += _tensor_bytes(args[sent]) if args else 0
        elif not func.is_view:
            self.counts.ops[_part_of_caller() if self.by_part else "update"] += 1
            self.counts.operators[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self, counts: HostWorkCounts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or name in HOST_VALUE_COPIES:  # only then the caller's frame (Dynamo traces this method)
            caller = sys._getframe(1)
            if name in HOST_READS or _copies_host_values(args, kwargs or {}, caller.f_code.co_filename):
                self.counts.reads[(caller.f_code.co_filename.rsplit("/", 1)[-1], caller.f_code.co_name)] += 1
        return func(*args, **(kwargs or {}))


_TORCH_PACKAGE = os.path.dirname(torch.__file__) + os.sep


def _copies_host_values(args: tuple, kwargs: dict, caller_file: str) -> bool:
    """Whether torch.tensor / torch.as_tensor copies host values to a device: data that is not a tensor, and a
    `device` given. Here every device is the CPU, so the call is what tells: torch's own calls (Dynamo passing a
    Python number to compiled code as a CPU tensor) are left out."""
    has_host_data = bool(args) and not isinstance(args[0], torch.Tensor)
    return has_host_data and kwargs.get("device") is not None and not caller_file.startswith(_TORCH_PACKAGE)


def _started_between_updates() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "after_update" and frame.f_code.co_filename.endswith("runtime/garbage_collection.py"):
            return True
        frame = frame.f_back
    return False


class HostWork:
    """Counts the host's work while active (`with HostWork() as counts:`). by_part: attribute each operator to
    the part of the update that dispatched it (PARTS), which walks the Python stack per operator."""

    def __init__(self, by_part: bool = True):
        self.counts = HostWorkCounts()
        self._modes = (_Reads(self.counts), _Dispatched(self.counts, by_part))

    def _collection_started(self, phase: str, info: dict) -> None:  # noqa: ARG002 - gc.callbacks' signature
        if phase == "start":
            self.counts.garbage_collections["between updates" if _started_between_updates() else "automatic"] += 1

    def __enter__(self) -> HostWorkCounts:
        for mode in self._modes:
            mode.__enter__()
        gc.callbacks.append(self._collection_started)
        return self.counts

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._collection_started)
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)


class CountedEveryUpdate:
    """A train step whose every update's host work is counted: from its call's start to the next call's start,
    so an update's data fetch, logging, stop agreement and checkpointer's turn are in it. `updates` holds each
    update's counts (the open one's grows until the next call or close())."""

    def __init__(self, step, by_part: bool = True):
        self.step = step
        self.by_part = by_part
        self.updates: list[HostWorkCounts] = []
        self._open: HostWork | None = None

    def __getattr__(self, name: str):  # the train step's counters and settings, for the loop and the checkpointer
        return getattr(self.step, name)

    def __call__(self, microbatches, epoch):
        self.close()
        self._open = HostWork(self.by_part)
        self.updates.append(self._open.__enter__())
        return self.step(microbatches, epoch)

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
