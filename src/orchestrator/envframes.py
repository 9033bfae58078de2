"""The frames an environment worker sends, checked before the orchestrator acts on them.

The worker runs a user's environment in another Python (``orchestrator.envworker``); what
it sends is decoded under a size budget (``worker/vfworker_wire``) and then checked here,
op by op, against the shape the orchestrator relies on. A frame that is not what its op
says fails the environment with one line naming the op and the first wrong field (never
the value: a frame can hold a dataset or a user's arguments), instead of a KeyError in a
task nobody awaits while its group waits for the watchdog.

Rewards enter the orchestrator here too: ``finite_scores`` gives a non-finite reward or
metric 0 and counts it as an error of its function, as the built-in rubric
(``prime_rl.envs.rubric``) does for its own functions, so no NaN or inf reaches the
advantages, the metrics rows or the status view.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

UNEXPLAINED = "reward"
"""The error name (`errors/<env>/reward`) of a non-finite total reward that no non-finite
metric explains."""


class Frame(BaseModel):
    # strict: a worker that sends "3" for a call id or 1.5 for a group is out of step with
    # this orchestrator, not something to coerce; forbid: both ends ship together, so an
    # unknown field is a bug to see
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# --------------------------------------------------------------------------- loading


class ExampleRow(Frame):
    index: int
    prompt: list[dict[str, Any]]
    answer: str
    info: dict[str, Any]
    task: str


class Loaded(Frame):
    op: Literal["loaded"]
    verifiers: str
    api: Literal["classic", "v1"]
    kind: str
    env_class: str | None = None
    system_prompt: str | None = None
    tools: list[dict[str, Any]] = []
    max_turns: int = 1
    dataset: list[ExampleRow] | None = None
    eval_dataset: list[ExampleRow] | None = None


class LoadFailed(Frame):
    op: Literal["error"]
    message: str


# --------------------------------------------------------------------------- serving


class Heartbeat(Frame):
    op: Literal["heartbeat"]


class ModelCall(Frame):
    """A chat turn of a classic environment, for the orchestrator's client to sample."""

    op: Literal["model"]
    call: int
    group: int
    rollout: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class GenerateCall(Frame):
    """A prompt a v1 taskset rendered to token ids itself."""

    op: Literal["generate"]
    call: int
    group: int
    rollout: str
    prompt_ids: list[int]


class RolloutResult(Frame):
    rollout: str
    reward: float | None = None
    metrics: dict[str, float] = {}
    errors: list[str] = []
    completion: list[dict[str, Any]] = []
    stop_condition: str = ""
    is_truncated: bool = False
    error: str | None = None
    branch: dict[str, Any] | None = None
    """v1's last branch, for inspection only."""


class GroupDone(Frame):
    op: Literal["group_done"]
    group: int
    rollouts: list[RolloutResult]


class GroupFailed(Frame):
    op: Literal["group_failed"]
    group: int
    message: str


SERVING: dict[str, type[Frame]] = {
    "heartbeat": Heartbeat, "model": ModelCall, "generate": GenerateCall, "group_done": GroupDone,
    "group_failed": GroupFailed,
}
LOADING: dict[str, type[Frame]] = {"loaded": Loaded, "error": LoadFailed}


class FrameError(ValueError):
    """A frame that is not what its op says; the message is one line without the frame's values."""


def parse(message: dict[str, Any], kinds: dict[str, type[Frame]]) -> Frame:
    """``message`` as the frame its `op` names, out of ``kinds``; FrameError otherwise."""
    op = message.get("op")
    kind = kinds.get(op)
    if kind is None:
        raise FrameError(f"a frame with op {str(op)[:40]!r}, expected one of {', '.join(kinds)}")
    try:
        return kind.model_validate(message)
    except ValidationError as e:
        raise FrameError(f"a bad `{op}` frame: {problem(e)}") from None


def problem(error: ValidationError) -> str:
    """The first thing wrong, by field path (`rollouts[2].reward`), and how many more."""
    errors = error.errors(include_url=False, include_input=False)
    first = errors[0]
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path or 'the frame'}: {first['msg']}{more}"


# --------------------------------------------------------------------------- rewards


def finite_scores(reward: float | None, metrics: dict[str, float], errors: list[str]
                  ) -> tuple[float, dict[str, float], tuple[str, ...], list[str]]:
    """(reward, metrics, errors, the names newly counted) with every non-finite value 0.

    A non-finite metric is its function's error, counted under its name (`errors/<env>/<fn>`)
    like a function that raised. A non-finite reward scores 0 (the worker's rubric weights
    are not known here, so the rest cannot be re-summed); it is counted under the non-finite
    metrics that explain it, or else under ``UNEXPLAINED``."""
    bad = [name for name, value in metrics.items() if not math.isfinite(value)]
    value = 0.0 if reward is None else reward
    if not math.isfinite(value):
        value = 0.0
        if not bad:
            bad = [UNEXPLAINED]
    clean = {name: (v if math.isfinite(v) else 0.0) for name, v in metrics.items()}
    counted = tuple(errors) + tuple(name for name in bad if name not in errors)
    return value, clean, counted, [name for name in bad if name not in errors]
