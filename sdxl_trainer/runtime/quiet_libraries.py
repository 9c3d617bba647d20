"""Library messages a user of this project cannot act on, dropped exactly, each at the logger that emits it.

The filters are installed when the sdxl_trainer package is imported (its __init__), which every script does
before any library that logs these on import (torchao, diffusers). Each entry names the start of one
message and why it is noise here; everything else those loggers say still gets through. The libraries' own
progress bars (weights loaded, pipeline components, shards written) are switched off by
hide_library_progress_bars().
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass


def registers_a_torchao_enum(record: logging.LogRecord) -> bool:
    registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return getattr(registered, "__module__", "").startswith("torchao.")


@dataclass(frozen=True)
class Unactionable:
    logger: str
    start: str  # of the message's format string (record.msg)
    why: str
    applies: Callable[[logging.LogRecord], bool] = lambda record: True


UNACTIONABLE = (
    Unactionable(
        "torch.utils._pytree",
        "%s is an Enum subclass and is now natively supported by torch.compile",
        "torchao 0.18 registers two of its enums as pytree constants on import, which torch 2.14 deprecates",
        applies=registers_a_torchao_enum,
    ),
    Unactionable(
        "diffusers.quantizers.torchao.torchao_quantizer",
        "Unable to import `torchao` Tensor objects",
        "diffusers 0.42 looks on import for torchao classes that torchao 0.18 moved, to allow them in torchao-quantized "
        "checkpoints, which this project never loads",
    ),
    Unactionable(
        "torch.utils.cpp_extension",
        "No CUDA runtime is found",
        "inductor compiles C++ kernels for the CPU on a machine without a GPU, where the CUDA toolkit is not used",
    ),
    Unactionable(
        "torch.distributed.elastic.multiprocessing.api",
        "Sending process %s closing signal %s",
        "torchrun stopping the other ranks after one failed: the failing rank printed why (watchdog.py)",
    ),
    Unactionable(
        "torch.distributed.elastic.multiprocessing.api",
        "failed (exitcode: %s) local_rank: %s",
        "torchrun naming the failed rank after the rank printed its own message (launcher.py names one that died without)",
    ),
)


class DropMessage(logging.Filter):
    def __init__(self, message: Unactionable):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(self.message.start) and self.message.applies(record))


def drop_unactionable_messages() -> None:
    for message in UNACTIONABLE:
        logging.getLogger(message.logger).addFilter(DropMessage(message))


def hide_library_progress_bars() -> None:
    """diffusers' and transformers' bars for every model they load or save would interleave with ours (training,
    caching); what is loaded or saved is said in our own lines."""
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
