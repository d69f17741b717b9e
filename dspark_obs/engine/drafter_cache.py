"""A request's drafter context: the projected keys/values of its committed positions.

Each committed token's target features are projected into every drafter layer's K/V once,
when committed, and kept here (the last ``context_window`` of them); drafting reads them
as extra keys/values. Only committed positions ever enter, so no rollback is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class DrafterCache:
    """Per-request drafter context: per-layer projected K/V of committed positions.

    ``num_positions`` counts every committed position whose target features were appended;
    it is also the absolute position of the next anchor. Only the last ``context_window``
    positions are kept.
    """

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    num_positions: int = 0

    @property
    def length(self) -> int:
        """Context positions kept (after windowing)."""
        return int(self.keys[0].shape[1]) if self.keys else 0

    def truncate(self, n: int) -> None:
        """Forget positions >= n (only needed if uncommitted features were ever appended)."""
        drop = self.num_positions - n
        if drop < 0:
            raise ValueError(f"cannot truncate to {n} > {self.num_positions}")
        if drop > self.length:
            raise ValueError("truncation reaches past the kept context window")
        if drop:
            keep = self.length - drop
            self.keys = [k[:, :keep] for k in self.keys]
            self.values = [v[:, :keep] for v in self.values]
        self.num_positions = n
