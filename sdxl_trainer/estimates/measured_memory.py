"""What one GPU really holds for a configuration: the estimate's two updates run for real (benchmarks/gpu_memory_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdxl_trainer.estimates.fake_run import EstimateSettings, build_estimate_run, fake_world, train_two_updates, zero_gradients
from sdxl_trainer.estimates.memory_estimate import GIB
from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG


@dataclass
class MeasuredMemory:
    """What one GPU really held for a configuration (measure_memory): torch's allocator statistics."""

    peak_allocated: int  # bytes: torch.cuda.max_memory_allocated over both updates
    peak_reserved: int  # bytes: the caching allocator's peak, fragmentation included
    stepped: bool  # False: the second update was skipped (non-finite), so its step's temporaries are missing
    update_seconds: float | None  # the second (whole) update, compiled already by the first; None: out of memory

    @property
    def out_of_memory(self) -> bool:
        """The run did not fit under the cap."""
        return self.update_seconds is None


def measure_memory(settings: EstimateSettings, device: torch.device, cap_gib: float | None = None, unet_config: dict | None = None) -> MeasuredMemory:
    """The estimate's two updates for real on one GPU, which holds what one GPU of a `settings.world_size`
    run holds (a fake process group: collectives move nothing, so a sharded run's gathered weights are not
    real ones and its loss may come out non-finite; `stepped` says so). The peak counts from after the model
    is built and prepared, as the estimate's does; cap_gib limits what the process may allocate
    (torch.cuda.set_per_process_memory_fraction), as on a card of that size."""
    with fake_world(settings.world_size, device) as world:
        run = build_estimate_run(settings, world, unet_config or SDXL_UNET_CONFIG, None)
        zero_gradients(run)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        if cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(min(cap_gib * GIB / torch.cuda.get_device_properties(device).total_memory, 1.0), device)
        stepped, update_seconds = False, None
        try:
            stepped, update_seconds = train_two_updates(run, device)
        except torch.OutOfMemoryError:
            pass
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        peaks = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        measured = MeasuredMemory(*peaks, stepped, update_seconds)
        del run
        torch.cuda.empty_cache()
        return measured
