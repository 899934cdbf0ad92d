"""What a rank does when its part of a context-parallel call fails.

The failing rank re-raises with a note (rank, strategy, phase); its peers are then blocked in
the exchange it will not join and raise when the group's timeout expires (gloo raises from the
wait; NCCL's watchdog aborts the communicator). Nothing here communicates: agreeing on an error
would cost a host synchronization per call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["failure_note"]


@contextlib.contextmanager
def failure_note(comm: str, phase: str, rank: int, n: int) -> Iterator[None]:
    """Re-raise any exception with a note saying which rank failed and what the others do."""
    try:
        yield
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"fused_attn context parallelism: rank {rank} of {n} failed in the {phase} of "
                         f"cp_comm={comm!r}; the other ranks of the group raise when its timeout expires")
        raise
