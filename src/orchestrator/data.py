"""Which examples each step samples: a seeded, resumable order over all environments.

The datasets of all environments are laid end to end and walked in a fresh seeded
permutation per epoch, so several environments mix in proportion to their sizes. The
whole state is one integer (``cursor``), which makes it trivial to checkpoint.
"""

from __future__ import annotations

import numpy as np


class ExampleOrder:
    def __init__(self, dataset_sizes: list[int], seed: int, cursor: int = 0):
        if not dataset_sizes or min(dataset_sizes) < 1:
            raise ValueError(f"every environment needs a non-empty dataset, got sizes {dataset_sizes}")
        self.seed = seed
        self.cursor = cursor
        self._offsets = np.cumsum([0, *dataset_sizes])  # env e owns flat indices [offsets[e], offsets[e+1])
        self._total = int(self._offsets[-1])
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def next(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` picks as (environment index, example index in its dataset)."""
        picks = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, self._total)
            if epoch != self._epoch:
                self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self._total)
            flat = int(self._perm[pos])
            env = int(np.searchsorted(self._offsets, flat, side="right")) - 1
            picks.append((env, flat - int(self._offsets[env])))
            self.cursor += 1
        return picks

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])
