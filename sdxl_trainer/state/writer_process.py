"""The background save's writer: a process of its own beside each training process.

Written by a thread, a save held Python's interpreter lock for much of its write, which the update's host work
(launching the GPU's kernels) waits for: on a CPU whose update computes on one core while the writer has the
other, the updates a write overlapped took 1.39x as long with the writer in a thread and 0.96x with it in a
process (benchmarks/bench_background_save.py, docs/checkpoints.md). So, as DCP's process-based asynchronous
save does, the state is staged into shared memory and handed to a writer process, which writes it with the
same write_staged_state (checksums, JSON index, the .tmp folder renamed only once every rank wrote its part).

- Memory: the staged state lies in one anonymous memory file (memfd, save.SharedBuffer) that the writer maps
  through /proc/<trainer's pid>/fd/<fd>: nothing on disk, and not bounded by /dev/shm (64 MB in a default
  Docker container). What a save sends is a JSON line naming each tensor's place in it (a DTensor's mesh and
  placements, a tensor subclass's inner tensors and attributes: torchao's 8-bit state), no pickle.
- Lifetime: started at the first background save, on every rank together; the writers form a gloo group of
  their own (their collectives never meet training's). A writer dies with its training process (the kernel's
  parent-death signal), so a killed job leaves, as before, only a .tmp folder that is never taken for a
  checkpoint; it ends when its training process closes it or exits.
- Replies: one JSON line per save on a pipe of their own (the writer's stdout and stderr are the job's).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from sdxl_trainer.distributed.world import all_gather_text, collective_device, free_port
from sdxl_trainer.state.checkpoint_layout import CheckpointError
from sdxl_trainer.state.dcp_json_index import DTYPES
from sdxl_trainer.state.save import SharedBuffer, StagedState, write_staged_state
from sdxl_trainer.state.trainer_state import TrainerState

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


# What a save sends: the staged tensors as places in the shared buffer ----------------------------------------

def _encoded_value(value: Any) -> Any:
    """A tensor subclass's attributes (torchao's 8-bit state: its sign flag and dtype) as JSON."""
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encoded_value(item) for item in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise CheckpointError(f"a tensor attribute of type {type(value).__name__} cannot be handed to the writer process: this is a bug, please report it")


def _decoded_value(node: dict) -> Any:
    if "dtype" in node:
        return DTYPES[node["dtype"]]
    if "list" in node:
        return [_decoded_value(item) for item in node["list"]]
    if "tuple" in node:
        return tuple(_decoded_value(item) for item in node["tuple"])
    return node["value"]


def _placement(placement) -> dict:
    if isinstance(placement, Shard):
        return {"shard": placement.dim}
    if isinstance(placement, Replicate):
        return {"replicate": True}
    raise CheckpointError(f"a DTensor placed as {placement} cannot be handed to the writer process: this is a bug, please report it")


def layout_of(state: Any, buffer: SharedBuffer) -> Any:
    """The staged `state` (every tensor a view into `buffer`, TensorStager) as JSON: each tensor by its offset."""
    if isinstance(state, dict):
        return {"dict": [[key, layout_of(value, buffer)] for key, value in state.items()]}
    if isinstance(state, DTensor):
        mesh = state.device_mesh
        return {"dtensor": {"local": layout_of(state.to_local(), buffer), "mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names,
                            "placements": [_placement(placement) for placement in state.placements], "shape": list(state.shape),
                            "stride": list(state.stride())}}  # fmt: skip
    if is_traceable_wrapper_subclass(state):
        names, context = state.__tensor_flatten__()
        return {"subclass": {"module": type(state).__module__, "name": type(state).__qualname__,
                             "inner": {name: layout_of(getattr(state, name), buffer) for name in names}, "context": _encoded_value(context),
                             "shape": list(state.shape), "stride": list(state.stride())}}  # fmt: skip
    if isinstance(state, torch.Tensor):
        return {"tensor": {"offset": buffer.offset_of(state), "dtype": str(state.dtype).removeprefix("torch."), "shape": list(state.shape)}}
    raise CheckpointError(f"a {type(state).__name__} in the training state cannot be handed to the writer process: this is a bug, please report it")


def _array(array: np.ndarray) -> dict:
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}


def _from_array(node: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(node["data"]), dtype=np.dtype(node["dtype"])).reshape(node["shape"]).copy()


def _writer_reference(writer_factory: Callable) -> dict:
    """Where the writer process finds `writer_factory` (a class or function at a module's top level)."""
    module = writer_factory.__module__
    if module == "__main__":  # defined in the script that was run: the writer imports that file
        return {"file": sys.modules["__main__"].__file__, "name": writer_factory.__qualname__}
    return {"module": module, "name": writer_factory.__qualname__}


def _imported(reference: dict) -> Any:
    if "file" in reference:
        spec = importlib.util.spec_from_file_location("__writer_factory_script__", reference["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(reference["module"])
    value = module
    for part in reference["name"].split("."):
        value = getattr(value, part)
    return value


def save_request(checkpoint_dir: Path, staged: StagedState, buffer: SharedBuffer, writer_factory: Callable[[Path], FileSystemWriter]) -> dict:
    """The JSON-able request to write `staged` (staged into `buffer`) into `checkpoint_dir`."""
    return {
        "checkpoint_dir": str(checkpoint_dir),
        "buffer": {"path": buffer.path, "size": buffer.size, "id": buffer.id},
        "tensors": layout_of(staged.tensors, buffer),
        "rng_arrays": {name: _array(array) for name, array in staged.rng_arrays.items()},
        "rng_details": staged.rng_details,
        "position_arrays": {name: _array(array) for name, array in staged.position_arrays.items()},
        "trainer_state": staged.trainer_state.to_json(),
        "writer": _writer_reference(writer_factory),
    }


# The writer's side ------------------------------------------------------------------------------------------

class _Rebuilder:
    """Rebuilds a request's tensors over the trainer's shared buffer (mapped once per buffer), and finds what it
    names (tensor subclasses, the DCP writer) once each: a writer_factory of a script runs that script's top level."""

    def __init__(self) -> None:
        self.buffer_id: int | None = None
        self.buffer: SharedBuffer | None = None
        self.meshes: dict[str, DeviceMesh] = {}
        self._found: dict[str, Any] = {}

    def imported(self, reference: dict) -> Any:
        key = json.dumps(reference, sort_keys=True)
        if key not in self._found:
            self._found[key] = _imported(reference)
        return self._found[key]

    def staged_state(self, request: dict) -> StagedState:
        described = request["buffer"]
        if described["id"] != self.buffer_id:
            self.buffer = SharedBuffer(described["size"], described["path"])
            self.buffer_id = described["id"]
        trainer_state = TrainerState.from_json(request["trainer_state"], Path(request["checkpoint_dir"]))
        return StagedState(
            self._tensors(request["tensors"]),
            {name: _from_array(node) for name, node in request["rng_arrays"].items()},
            request["rng_details"],
            {name: _from_array(node) for name, node in request["position_arrays"].items()},
            trainer_state,
        )

    def _mesh(self, ranks: list, names: list | None) -> DeviceMesh:
        key = json.dumps([ranks, names])
        if key not in self.meshes:  # the same order on every writer: a 2-D mesh makes its groups collectively
            self.meshes[key] = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=tuple(names) if names else None)
        return self.meshes[key]

    def _tensors(self, node: dict) -> Any:
        if "dict" in node:
            return {key: self._tensors(value) for key, value in node["dict"]}
        if "dtensor" in node:
            spec = node["dtensor"]
            placements = [Shard(each["shard"]) if "shard" in each else Replicate() for each in spec["placements"]]
            return DTensor.from_local(self._tensors(spec["local"]), self._mesh(spec["mesh"], spec["names"]), placements, run_check=False,
                                      shape=torch.Size(spec["shape"]), stride=tuple(spec["stride"]))  # fmt: skip
        if "subclass" in node:
            spec = node["subclass"]
            cls = self.imported({"module": spec["module"], "name": spec["name"]})
            inner = {name: self._tensors(value) for name, value in spec["inner"].items()}
            return cls.__tensor_unflatten__(inner, _decoded_value(spec["context"]), torch.Size(spec["shape"]), tuple(spec["stride"]))
        spec = node["tensor"]
        return self.buffer.tensor_at(spec["offset"], torch.Size(spec["shape"]), DTYPES[spec["dtype"]])


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the training process that started it dies (Linux's parent-death signal), and
    only then: a terminal's Ctrl-C or a scheduler's SIGTERM reaches every process of the job, and the training
    process, which stops gracefully, waits for the save in flight and may write one more."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != parent_pid:
        sys.exit(1)  # no signal to rely on, or the parent is gone already


def writer_main(settings: dict) -> None:
    """The writer process: joins the writers' group, then writes each requested save (a JSON line on stdin)
    and answers on the replies pipe; ends at end of input (its training process closed it or died)."""
    _die_with_parent(settings["parent"])
    torch.set_num_threads(1)  # copies and checksums: the host's cores belong to training
    dist.init_process_group("gloo", init_method=settings["init_method"], rank=settings["rank"], world_size=settings["world_size"])
    replies = os.fdopen(settings["replies_fd"], "w", buffering=1)
    rebuilder = _Rebuilder()
    for line in sys.stdin:
        started = time.perf_counter()
        request = json.loads(line)
        try:
            write_staged_state(Path(request["checkpoint_dir"]), rebuilder.staged_state(request), None, rebuilder.imported(request["writer"]))
            reply = {"seconds": time.perf_counter() - started}
        except CheckpointError as error:
            reply = {"checkpoint_error": str(error), "seconds": time.perf_counter() - started}
        except BaseException:  # noqa: BLE001 - told to the training process, which stops the run with it
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        if "error" in reply:
            break  # its group may be broken: the run stops
    dist.destroy_process_group()


# The training process's side -------------------------------------------------------------------------------

class WriterProcess:
    """This rank's writer process (start() on every rank together); one save in flight at a time."""

    def __init__(self, process: subprocess.Popen, replies: int):
        self.process = process
        self._replies = os.fdopen(replies, "r")

    @classmethod
    def start(cls, group: dist.ProcessGroup) -> WriterProcess:
        """Collective over `group` (every training process): starts this rank's writer; the writers' group
        meets at MASTER_ADDR (rank 0's machine) on a port free there."""
        port = all_gather_text(str(free_port()) if dist.get_rank() == 0 else "", collective_device(group), group)[0]
        read_end, write_end = os.pipe()
        settings = {"init_method": f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}", "rank": dist.get_rank(),
                    "world_size": dist.get_world_size(), "replies_fd": write_end, "parent": os.getpid()}  # fmt: skip
        # The writer imports what the training process can (a writer_factory of a test's script among them).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        process = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(settings)], stdin=subprocess.PIPE, pass_fds=(write_end,),
                                   env=env, text=True)  # fmt: skip
        os.close(write_end)
        return cls(process, read_end)

    def send(self, request: dict) -> None:
        """Hands the save over without waiting for the writer to read it: the first save's writer is still
        starting (importing torch, meeting the other writers), and a request longer than the pipe holds
        would hold the loop until then."""
        text = json.dumps(request) + "\n"

        def write() -> None:
            with contextlib.suppress(BrokenPipeError):  # a writer that died: reply() says so
                self.process.stdin.write(text)
                self.process.stdin.flush()

        threading.Thread(target=write, name="state save request", daemon=True).start()

    def answered(self) -> bool:
        """Whether the save sent last is done (its reply, or the writer's end, is there to read)."""
        return bool(select.select([self._replies], [], [], 0)[0])

    def reply(self) -> dict:
        """The reply to the save sent last (waits for it); a writer that died is an error."""
        line = self._replies.readline()
        if not line:
            code = self.process.wait()
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return {"error": f"The background save's writer process {how} before it finished the save (out of memory? see the log above)."}
        return json.loads(line)

    def close(self) -> None:
        """Ends the writer (after the save in flight, which the caller waited for)."""
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        self.process.wait()
        self._replies.close()


if __name__ == "__main__":
    writer_main(json.loads(sys.argv[1]))
