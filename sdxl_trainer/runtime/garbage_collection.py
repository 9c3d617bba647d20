"""Python's garbage collector over a long run: what start-up made is never walked again, and no collection
runs inside an update. Its own module, so that the caching script imports it without the trainer's parallel
machinery (torch's DTensor, FSDP and compiler modules, whose import would be a large part of a dry run or a
refused start)."""

from __future__ import annotations

import gc


def exempt_live_objects_from_garbage_collection() -> None:
    """Leave every object alive now out of Python's later garbage collections (gc.freeze). A full
    collection walks every live object: the ~560,000 the libraries create at import, several times a run,
    on each rank at its own moment while the others wait at the next collective (what that cost a 2-rank
    tiny run: docs/design.md §1). Call it after each wave of imports (the script's
    own; the model libraries' once the checks passed), when almost nothing is garbage yet (60 objects):
    garbage frozen now would never be freed."""
    gc.freeze()


class CollectBetweenUpdates:
    """Python's automatic garbage collection off for the training loop, and a collection of the young
    generations on every rank after the same updates (every `every_n_updates`), as torchtitan does: an
    automatic one starts whenever allocations pass a threshold, inside an update, on each rank at its own
    moment, and the others wait for it at their next collective. 0 leaves the automatic collection on."""

    GENERATION = 1  # the young generations: what an update leaves behind (the old one holds what lives all run)

    def __init__(self, every_n_updates: int):
        self.every_n_updates = every_n_updates
        self._was_enabled = gc.isenabled()
        if every_n_updates:
            gc.disable()

    def after_update(self, update: int) -> None:
        if self.every_n_updates and update % self.every_n_updates == 0:
            gc.collect(self.GENERATION)

    def close(self) -> None:
        """Give automatic collection back as it was found."""
        if self._was_enabled:
            gc.enable()
