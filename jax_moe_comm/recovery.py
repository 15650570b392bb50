"""recover()'s agreement: every rank's count of the cycles it completed with no error, and the
count all of them resume from.

One cycle is one dispatch + combine on a handle. A rank's count stops at the cycle before its
first error (the kernels record the failing launch's cycle; every later cycle is poisoned).
The protocol keeps ranks within one cycle of each other: a rank cannot finish cycle c + 1's
combine before every peer sent its cycle c + 1 rows, which each peer sends only after its own
cycle c. So the counts differ by at most one; the agreed point is their minimum, and a rank
that completed one cycle more discards that cycle's result. Counts further apart mean the ranks
are not on one timeline (one recovered alone, or restarted): that is refused, naming them.
"""

from __future__ import annotations

from . import bootstrap
from .errors import RecoveryError


def agreed_point(counts: list[int]) -> int:
    """The cycles every rank completed: min(counts), when they are within one of each other;
    else RecoveryError naming every rank's count."""
    if not counts:
        raise ValueError("agreed_point: no counts (every rank reports one)")
    low, high = min(counts), max(counts)
    if high - low > 1:
        listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise RecoveryError(
            f"recover(): the ranks' completed cycles are {high - low} apart ({listed}); ranks "
            "can be at most one cycle apart, so these are not on one timeline (a rank that "
            "recovered on its own, or a restarted process). Restart the job.")
    return low


def agree(kind: str, mine: int) -> int:
    """Collective (every process, in the same order of recover() calls): exchanges this
    process's count through the key-value store and returns the agreed point."""
    tag = bootstrap.next_collective_tag(kind)
    counts = [int(v) for v in bootstrap.all_gather(tag, str(int(mine)))]
    return agreed_point(counts)
