"""Python's garbage collector over a long run: what start-up made is never walked again. Its own module, so
that the caching script imports it without the trainer's parallel machinery (torch's DTensor, FSDP and
compiler modules, whose import would be a large part of a dry run or a refused start)."""

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
