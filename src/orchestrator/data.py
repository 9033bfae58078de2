"""Which examples each step samples: a seeded, resumable, weighted order over environments.

Every pick first chooses an environment, then that environment's next example:
- environments are chosen by smooth weighted round robin: pick number t goes to the
  environment whose count lags its share ``weight_e / sum(weights) * (t + 1)`` the most, so
  at every point each environment's count is within one of its exact share (3:1 weights
  give 6 and 2 of every 8 picks);
- each environment walks its own dataset in a fresh seeded permutation per epoch.
The whole state is one count per environment, which makes it trivial to checkpoint.
"""

from __future__ import annotations

import numpy as np


class ExampleOrder:
    def __init__(self, dataset_sizes: list[int], seed: int, weights: list[float] | None = None):
        if not dataset_sizes or min(dataset_sizes) < 1:
            raise ValueError(f"every environment needs a non-empty dataset, got sizes {dataset_sizes}")
        weights = [1.0] * len(dataset_sizes) if weights is None else list(weights)
        if len(weights) != len(dataset_sizes) or min(weights) <= 0:
            raise ValueError(f"need one positive weight per environment, got {weights} for {len(dataset_sizes)}")
        self.sizes = list(dataset_sizes)
        self.seed = seed
        self.shares = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.counts = [0] * len(dataset_sizes)  # examples drawn from each environment so far
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def next(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` picks as (environment index, example index in its dataset)."""
        picks = []
        for _ in range(n):
            total = sum(self.counts)
            env = int(np.argmax(self.shares * (total + 1) - np.asarray(self.counts)))  # ties: lowest index
            epoch, pos = divmod(self.counts[env], self.sizes[env])
            picks.append((env, int(self._perm(env, epoch)[pos])))
            self.counts[env] += 1
        return picks

    def _perm(self, env: int, epoch: int) -> np.ndarray:
        key = (env, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != env}  # keep one epoch per env
            self._perms[key] = np.random.default_rng([self.seed, env, epoch]).permutation(self.sizes[env])
        return self._perms[key]

    def state_dict(self) -> dict[str, list[int]]:
        return {"counts": list(self.counts)}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        counts = [int(c) for c in state["counts"]]
        if len(counts) != len(self.sizes):
            raise ValueError(f"data order state has {len(counts)} environments, this run has {len(self.sizes)}")
        self.counts = counts
