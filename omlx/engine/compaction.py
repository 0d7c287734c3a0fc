"""When the runner's merged decode batch drops the rows of sequences that finished.

A merged decode batch (mlx-lm's ``BatchKVCache`` and its kin, one per layer, left-padded) drops
a row only by ``filter``: a gather that copies the KV of every row it keeps, in every layer,
and reads the left padding back to the host (a sync that waits for the step in flight). Done
at every finish, 32 streams finishing at different steps cost up to 32 copies of the whole
batch's KV per wave, each behind a pipeline stall. So `BatchRunner` leaves a finished row in
the batch as a *dead row* (fed its own sampled token, its outputs never read or emitted) and
compacts with one ``filter`` only when this policy says the dead rows' share of the batch is
worth a copy: a dead row costs its share of every decode step's work until then.

Rows joining do not compact: ``extend`` copies the batch anyway, but in continuous batching a
row joins about as often as one finishes, so compacting there would be a filter per finish
again. When one live row is left, the runner extracts it to its own plain caches (mlx-lm's
fast causal path) whatever this policy says.

Must not: touch arrays or caches (it only decides).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Compaction:
    """The dead-row policy of a merged decode batch.

    Attributes:
        max_dead_fraction: compact once dead rows are at least this share of the batch's rows
            (0: at every finish, as mlx-lm's ``BatchGenerator`` does). At 0.25 a batch of 32
            whose rows finish one by one is filtered 8 times instead of 30, and at most a
            quarter of a step's rows are wasted work.
    """

    max_dead_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_dead_fraction < 1.0:
            raise ValueError(f"max_dead_fraction must be in [0, 1), got {self.max_dead_fraction}")

    def due(self, num_rows: int, num_dead: int) -> bool:
        """Whether a batch of ``num_rows`` rows, ``num_dead`` of them dead, is compacted now."""
        return num_dead > 0 and num_dead >= self.max_dead_fraction * num_rows
