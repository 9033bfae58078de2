"""Rubric: reward functions with weights, called with only the arguments they name.

A reward function is any callable, sync or async, whose parameters are among
``prompt, completion, answer, info, task, example_id, state, parser`` (plus objects added
with ``add_class_object``); one that takes ``**kwargs`` receives them all. The rollout's
reward is the weighted sum of the functions' values; every function's raw value is a
metric under its name, so functions with weight 0 (``add_metric``) are metrics only.
A function that raises scores 0 for that rollout, is reported in the rollout's ``errors``
(the orchestrator counts them per step) and has its traceback logged once per rubric;
it never stops a run.
"""

from __future__ import annotations

import inspect
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prime_rl.envs.parser import Parser
from prime_rl.envs.types import State

RewardFunc = Callable[..., Any]
ARGUMENTS = ("prompt", "completion", "answer", "info", "task", "example_id", "state", "parser")


@dataclass(frozen=True)
class Score:
    reward: float
    metrics: dict[str, float]
    errors: tuple[str, ...]


class Rubric:
    def __init__(
        self,
        funcs: list[RewardFunc] | None = None,
        weights: list[float] | None = None,
        parser: Parser | None = None,
    ):
        funcs = list(funcs or [])
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise ValueError(f"Rubric: {len(funcs)} reward functions but {len(weights)} weights")
        self.parser = parser if parser is not None else Parser()
        self.funcs: list[RewardFunc] = []
        self.weights: list[float] = []
        self.class_objects: dict[str, Any] = {}
        self._logged: set[str] = set()
        for func, weight in zip(funcs, weights):
            self.add_reward_func(func, weight)

    # ----------------------------------------------------------------------- building

    def add_reward_func(self, func: RewardFunc, weight: float = 1.0) -> None:
        if not callable(func):
            raise TypeError(f"Rubric: a reward function must be callable, got {func!r}")
        if not math.isfinite(weight):
            raise ValueError(f"Rubric: the weight of {name_of(func)!r} must be finite, got {weight}")
        if name_of(func) in self.names:
            raise ValueError(f"Rubric: two functions are named {name_of(func)!r}; metric names must be unique")
        self.funcs.append(func)
        self.weights.append(float(weight))

    def add_metric(self, func: RewardFunc) -> None:
        """A function logged as a metric that does not count towards the reward (weight 0)."""
        self.add_reward_func(func, weight=0.0)

    def add_class_object(self, name: str, obj: Any) -> None:
        """Make ``obj`` available to reward functions that name ``name``."""
        self.class_objects[name] = obj

    @property
    def names(self) -> list[str]:
        return [name_of(f) for f in self.funcs]

    # ----------------------------------------------------------------------- scoring

    async def score(self, state: State) -> Score:
        """Call every function on one finished rollout; the weighted sum is the reward."""
        available = {key: state.get(key) for key in ARGUMENTS if key != "state"}
        available.update(state=state, parser=self.parser, **self.class_objects)
        metrics, errors, reward = {}, [], 0.0
        for func, weight in zip(self.funcs, self.weights):
            name = name_of(func)
            try:
                value = float(await call_with_named_args(func, available))
                if not math.isfinite(value):
                    raise ValueError(f"returned a non-finite value {value}")
            except Exception:  # noqa: BLE001 - a broken reward function must not stop the run
                self._log_once(name)
                errors.append(name)
                value = 0.0
            metrics[name] = value
            reward += weight * value
        return Score(reward=reward, metrics=metrics, errors=tuple(errors))

    def _log_once(self, name: str) -> None:
        if name in self._logged:
            return
        self._logged.add(name)
        print(
            f"[rubric] reward function {name!r} raised; it scores 0 for that rollout (counted in "
            f"errors/<env>/{name}; this traceback is shown once):\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )


def name_of(func: RewardFunc) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


async def call_with_named_args(func: RewardFunc, available: dict[str, Any]) -> Any:
    """Call ``func`` with the entries of ``available`` its signature names (all of them if it
    takes ``**kwargs``); await the result when it is awaitable."""
    params = inspect.signature(func).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        kwargs = dict(available)
    else:
        kwargs = {p.name: available[p.name] for p in params if p.name in available}
        missing = [
            p.name for p in params
            if p.name not in available and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if missing:
            raise TypeError(f"{name_of(func)} needs {missing}, which a rubric cannot give (it gives {sorted(available)})")
    result = func(**kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result
