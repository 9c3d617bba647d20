"""torch's memory trackers, made to keep only the peak of the categories the estimate counts, with a new
iteration at each microbatch.
"""

from __future__ import annotations

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from sdxl_trainer.estimates.fake_run import EstimateRun

CATEGORIES = ("parameters", "gradients", "optimizer state", "EMA", "activations", "temporaries", "inputs")
# Tracker categories -> ours. All-gather outputs hold gathered weights, reduce-scatter inputs gradients.
FSDP_CATEGORIES = {
    _FSDPRefType.SHARDED_PARAM: "parameters", _FSDPRefType.UNSHARDED_PARAM: "parameters", _FSDPRefType.BUFFER: "parameters",
    _FSDPRefType.ALL_GATHER: "parameters", _FSDPRefType.SHARDED_GRAD: "gradients", _FSDPRefType.UNSHARDED_GRAD: "gradients",
    _FSDPRefType.REDUCE_SCATTER: "gradients", _FSDPRefType.OPT: "optimizer state", _FSDPRefType.ACT: "activations",
    _FSDPRefType.TEMP: "temporaries", _FSDPRefType.INP: "inputs",
}  # fmt: skip
PLAIN_CATEGORIES = {
    _MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters", _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer state", _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries", _MemRefType.OTH: "inputs",
}  # fmt: skip
# With FSDP2's CPU offload these live in host memory; everything else is on the GPU.
OFFLOADED = (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT)


class _PeakOfCounted:
    """What the estimate's trackers add to torch's: they keep the peak of the categories they count (all of
    them, or the GPU's share under CPU offload) and no per-module statistics, which cost a pass over every
    tracked module per operation (SDXL's UNet has about 2,000 modules)."""

    counted: tuple  # tracker categories on the GPU
    gpu_peak: int = 0
    gpu_peak_snapshot: dict = {}

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        # torch's gradient hook reads the parameter's gradient after it is accumulated; the optimizer in backward
        # (its hook runs first) may have stepped and freed it by then, already counted when it was made.
        if t is None:
            return set()
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 - the trackers' signature
        for snapshot in self._curr_mem_snap.values():
            counted = sum(snapshot[category] for category in self.counted)
            if counted > self.gpu_peak:
                self.gpu_peak = counted
                self.gpu_peak_snapshot = dict(snapshot)


class FSDPPeakTracker(_PeakOfCounted, FSDPMemTracker):
    def __init__(self, run: EstimateRun):
        super().__init__(run.unet, run.optimizer)
        # Every FSDP module the run trains is instrumented (torch's tracker takes one FSDP root; the trained
        # text encoders are FSDP modules beside the UNet under TrainedModels).
        self._root_mod = run.trained
        self.microbatch_start = run.microbatch_start

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        tracked_pre_forward = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            # Each microbatch is a new iteration to the tracker, which refuses a second forward of a module
            # while its per-module statistics of the last one are kept.
            if fsdp_mod is self.microbatch_start and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            return tracked_pre_forward(*args, **kwargs)

        return pre_forward


class PlainPeakTracker(_PeakOfCounted, MemTracker):
    def __init__(self, run: EstimateRun):
        super().__init__()
        self.microbatch_start = run.microbatch_start
        self.track_external(run.trained, run.optimizer)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # torch's tracker hooks every parameter of a module for its gradient, and a frozen one (CLIP-L's last
        # layer, with trained text encoders) cannot take a hook: a module holding any frozen parameter installs
        # none, and its trainable parameters get theirs from the submodules that hold them.
        frozen = any(not parameter.requires_grad for parameter in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks and not frozen)

    def _pre_fw_hook(self, module, inputs) -> None:
        if module is self.microbatch_start and not self._mod_tracker.is_bw:  # as FSDPPeakTracker's pre_forward
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)
