"""The group pool every step's batch is cut from: groups of rollouts in flight across step
boundaries (continuous batching), or within one step (the step barrier, below).

The pool keeps up to ``max_inflight`` groups (one example's ``rollouts_per_example``
rollouts) in flight at all times. A group starts as soon as a slot is free and the async
bound allows it; each step's batch is cut from the groups that completed first. So a long
completion holds its own slot only, never the whole step, and generation goes on while the
trainer trains and while new weights are loaded (``InferenceClient.reload_weights`` with
``keep``).

Versions. A group carries the policy version served when it started (``version``, the
oldest of its tokens) and the newest among its tokens (``last_version``, above it when a
reload landed while it was sampled). Step n trains on a group only if
``version >= n - max_off_policy`` (``async_level`` unless set higher); an older group is
dropped, counted and logged, never trained on. A step takes the groups that expire with it
first (they could train no later step), and waits for those still in flight rather than fill
its slots with newer groups that completed sooner, so a group goes stale only when more
expire together than a step holds.

Admission, the async bound ahead of time: the j-th group not yet in a batch (counting the
step's groups already cut, the completed ones and those in flight) will go to step
``next_step + j // groups_per_step``, so it starts only when the version served now can
train that step: ``version >= next_step + j // groups_per_step - async_level``, and only
when that step exists (< ``max_steps``). The orchestrator therefore never samples further
ahead than ``async_level``, nor past the run's last step.

Above ``async_level`` (``max_off_policy``, as the reference trainer's
``max_off_policy_steps``): a group may start in any free slot (``max_inflight``, counting
every group not yet sent: the step's taken ones, completed ones, those in flight) while the
step being cut may train it, ``version >= next_step - async_level``. So more groups start
than a step needs; the step takes the first to complete, and its stragglers land in later
steps, trained at most ``max_off_policy`` versions after they started (older ones are
dropped as above). The trainer then waits for a step's fastest groups, not its slowest.

One step in flight (``one_step``, `batching = "step"`): the step barrier is this pool with
groups started only for the step being cut, so nothing samples between cuts and the
orchestrator syncs the policy there (``orchestrator.main.sync_policy``); the step takes its
groups in start order, which it waits for all of anyway, so its batch depends on the
examples alone, not on which group finished first.

Filtering (``orchestrator.filtering``): a group the step's filter rejects leaves the step a
slot short, so another group starts in its place (the async bound and the slots allowing).

Load (``orchestrator.load``): a group started here takes its episodes from the limiter
before its first request, so it may wait there while memory or inference has no room; its
``version`` is the one served when it leaves that wait.

A group that fails (its episodes raise, or run past the environment's ``episode_timeout_s``)
is the environment's failure, not the run's: dropped, counted in `errors/<env>/episode_*`,
said once per kind, and its slot goes to another group; more failures in a row than a step
holds stop the run. Failures of what every group needs (``FATAL``: the worker, inference, the
chat template) stop it at once.

Determinism, for a resume: examples are picked from the seeded order as groups start.
``pending()`` lists the picks of the groups started but in no batch yet, in start order;
a resume re-starts them first and then continues the order from its recorded cursor, so
the same examples are sampled in the same order (which step each lands in depends on
when it completes).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
from prime_rl.chat import TemplateError
from prime_rl.config import FilterConfig
from prime_rl.envs import Environment, Rollout

from orchestrator.data import ExampleOrder
from orchestrator.client import InferenceError
from orchestrator.envworker import EnvironmentWorkerError
from orchestrator.filtering import StepFilter
from orchestrator.load import EpisodeLimiter


MIN_FAILED_IN_ROW = 4
"""Groups failing in a row that stop the run, at least (else a step's worth)."""


class EpisodeTimeout(Exception):
    """A group's episodes ran past the environment's ``episode_timeout_s``."""


FATAL = (EnvironmentWorkerError, InferenceError, TemplateError, httpx2.HTTPError)
"""Failures of what every group depends on (the worker, inference, the chat template): they
stop the run at once. Anything else a group raises is its environment's, and drops the group."""


def error_line(error: BaseException) -> str:
    """``Type: message`` and where it was raised, on one line."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}{where}"


@dataclass
class Group:
    seq: int
    """Start order."""

    pick: tuple[int, int]
    """(environment index, example index)."""

    version: int
    """Policy version served when its first request went out."""

    rollouts: list[tuple[str, Rollout]] = field(default_factory=list)
    """(environment name, rollout) of each of its rollouts, once complete."""

    @property
    def last_version(self) -> int:
        """Newest policy version among its tokens."""
        return max([self.version, *(r.versions[1] for _, r in self.rollouts)])


@dataclass
class Cut:
    """One step's groups and what it took to get them."""

    groups: list[Group]
    """In completion order."""

    stale: int
    """Groups dropped because their version is older than the step's bound."""

    wait_s: float
    """Time spent waiting for groups to complete (or for weights to admit new ones)."""

    in_flight: int
    """Groups still in flight when the batch was cut."""

    span_s: float
    """Time since the previous cut (or since the pool began): what this step's groups took
    to generate in the steady state, the basis of a rate. With one step in flight nothing
    generates between cuts: the cut's own time (``wait_s``)."""

    filter_row: dict[str, float | int]
    """The step's `filter/*` metrics (``StepFilter.row``)."""

    judged: list[Group]
    """Every group the step judged: its own and those its filter dropped, in judging order."""


class GroupPool:
    def __init__(
        self,
        envs: list[tuple[str, Environment]],
        order: ExampleOrder,
        sampler,
        *,
        rollouts_per_example: int,
        groups_per_step: int,
        async_level: int,
        max_inflight: int,
        version: Callable[[], int],
        pending: list[tuple[int, int]] = (),
        log: Callable[[str], None] = print,
        max_steps: int | None = None,
        one_step: bool = False,
        limiter: EpisodeLimiter | None = None,
        timeouts: list[float | None] | None = None,
        max_off_policy: int | None = None,
    ):
        self.envs, self.order, self.sampler = envs, order, sampler
        self.n, self.k, self.async_level, self.max_inflight = rollouts_per_example, groups_per_step, async_level, max_inflight
        self.version = version
        """The policy version the inference server serves now."""
        self.max_off_policy = async_level if max_off_policy is None else max_off_policy
        """Step n trains a group only if its ``version >= n - max_off_policy`` (at least
        ``async_level``): above ``async_level``, a step takes the groups that completed first
        and its stragglers land in a later one, within this bound."""
        self.max_steps = max_steps
        """No group starts that would land in a step at or past this one (the run's end)."""
        self.one_step = one_step
        """The step barrier: groups start only for the step being cut, taken in start order."""
        self._horizon = max_steps
        """No group starts for a step at or past this one now (``_open``)."""
        self.log = log
        self.timeouts = timeouts or [None] * len(envs)
        """Per environment: seconds a group may run before it is cut off (``episode_timeout_s``)."""
        self.failures: dict[str, int] = {}
        """Rollouts of groups that failed since the last cut, by `errors/<env>/<kind>` key."""
        self._failed_in_row = 0
        self._said: set[str] = set()
        self.limiter = limiter
        """Bounds the episodes in flight (``orchestrator.load``): a group started here may wait
        there before its first request. None = no bound but the slots."""
        self._restart = deque(tuple(p) for p in pending)
        """Picks to start before drawing new ones: a resumed run's groups that were in flight."""
        self._seq = 0
        self._in_flight: dict[int, tuple[Group, asyncio.Task]] = {}
        self._done: deque[Group] = deque()
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()
        self._last_cut = time.perf_counter()

    # ----------------------------------------------------------------------- the step's batch

    async def cut(self, step: int, stall: Callable[[int], str], stall_timeout_s: float, filter: FilterConfig | None = None) -> Cut:
        """The next ``groups_per_step`` usable groups for ``step``, in completion order (with
        one step in flight, start order); waits for groups in flight, and when none is in
        flight and the async bound admits none, for new weights (``stall(version needed)``
        names them; TimeoutError after ``stall_timeout_s``). With an enabled ``filter``, the
        groups it rejects are dropped while its ``max_extra_examples`` allow, then taken."""
        start = time.perf_counter()
        self._open(step)
        taken: list[Group] = []
        judged: list[Group] = []
        judge = StepFilter(filter, self.n)
        stale = 0
        bound = step - self.async_level
        while True:
            self._raise_failure()
            stale += self._drop_stale(step, step - self.max_off_policy)
            while len(taken) < self.k and (group := self._next_done(step, len(taken))) is not None:
                self._done.remove(group)
                judged.append(group)
                if judge.takes([r.reward for _, r in group.rollouts]):
                    taken.append(group)
            if len(taken) == self.k:
                break
            self._admit(step, len(taken))
            if self._in_flight:
                await self._wait_changed(None)
            else:
                await self.wait_for_version(bound, stall, stall_timeout_s)
        self._admit(step + 1, 0)  # keep generating while the trainer trains this step (not past the horizon)
        now = time.perf_counter()
        span, self._last_cut = now - (start if self.one_step else self._last_cut), now
        return Cut(taken, stale, now - start, len(self._in_flight), span, judge.row(), judged)

    def fill(self, next_step: int) -> None:
        """Start as many groups as the slots and the async bound allow for ``next_step`` on
        (``cut`` does it too; this starts generation before the first cut). With one step in
        flight, nothing: the step's groups start at its cut, after the policy is synced."""
        if not self.one_step:
            self._open(next_step)
            self._admit(next_step, 0)

    def pending(self) -> list[tuple[int, int]]:
        """Picks of the groups started but in no batch yet (completed or in flight), in start
        order, then those still waiting to be restarted: what a resume samples first."""
        groups = sorted([*self._done, *(group for group, _ in self._in_flight.values())], key=lambda g: g.seq)
        return [group.pick for group in groups] + list(self._restart)

    def notify(self) -> None:
        """The served version changed: the async bound may admit more groups."""
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """Something the pool's batches depend on failed (the weight follower): the next or
        current ``cut`` raises it."""
        self._failure = self._failure or error
        self._changed.set()

    async def close(self) -> None:
        """Cancel every group in flight and wait until each has stopped (its requests
        aborted, a worker's episodes cancelled): nothing keeps running after the run."""
        tasks = [task for _, task in self._in_flight.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._in_flight.clear()

    # ----------------------------------------------------------------------- internals

    def _open(self, step: int) -> None:
        """``step`` is the next to be cut: with one step in flight, groups may start for it
        alone; otherwise for every step up to the run's end."""
        self._horizon = step + 1 if self.one_step else self.max_steps

    def _drop_stale(self, step: int, bound: int) -> int:
        """Drop the completed groups older than ``bound`` (logged); returns how many."""
        stale = [group for group in self._done if group.version < bound]
        for group in stale:
            self._done.remove(group)
            knob = "async_level" if self.max_off_policy == self.async_level else "max_off_policy_steps"
            self.log(f"step {step}: dropped a group of policy version {group.version} ({knob} "
                     f"{self.max_off_policy} allows >= {bound}); it is not trained on")
        return len(stale)

    def _next_done(self, step: int, taken: int) -> Group | None:
        """The completed group ``step`` takes next: with one step in flight, the first
        started (all of them are the step's); otherwise the first one that could train no
        later step (it expires with this one), else the first to complete, unless the slots
        left are needed by groups still in flight that expire with this step (the step then
        waits for them rather than let them go stale); None = wait."""
        if self.one_step:
            first = min(self._done, key=lambda group: group.seq, default=None)
            return first if first is not None and first.seq < min(self._in_flight, default=self._seq) else None

        def expires(group: Group) -> bool:
            return group.version < step + 1 - self.max_off_policy

        for group in self._done:
            if expires(group):
                return group
        expiring = sum(expires(group) for group, _ in self._in_flight.values())
        if self._done and self.k - taken - 1 >= expiring:
            return self._done[0]
        return None

    def _admit(self, next_step: int, taken: int) -> None:
        """Start groups while ``_may_start`` allows (``next_step``: the step being cut)."""
        j = taken + len(self._done) + len(self._in_flight)
        while self._may_start(next_step, j):
            self._start(self._restart.popleft() if self._restart else self.order.next(1)[0])
            j += 1

    def _may_start(self, next_step: int, j: int) -> bool:
        """Whether the ``j``-th group not yet in a batch may start: a slot is free and the
        version served now may train the step it would land in (in start order; no step past
        the horizon). With ``max_off_policy`` above ``async_level``, any free slot (counting
        the groups not yet sent: taken, completed, in flight) while the step being cut may
        train it: more groups start than a step needs, the step takes the first to complete
        and the rest land in later steps."""
        lands = next_step + j // self.k
        if self._horizon is not None and lands >= self._horizon:
            return False
        if self.max_off_policy > self.async_level:
            free = j < self.max_inflight  # the step's groups taken and those done count: none piles up to go stale
            admitted = self.version() >= next_step - self.async_level
        else:
            free = len(self._in_flight) < self.max_inflight
            admitted = self.version() >= lands - self.async_level
        return free and admitted

    def _start(self, pick: tuple[int, int]) -> None:
        group = Group(self._seq, pick, self.version())
        self._seq += 1
        name, env = self.envs[pick[0]]
        task = asyncio.create_task(self._play(group, name, env, env.dataset[pick[1]], self.timeouts[pick[0]]))
        self._in_flight[group.seq] = (group, task)
        task.add_done_callback(lambda t, g=group, name=name: self._finished(g, name, t))

    async def _play(self, group: Group, name: str, env: Environment, example, timeout_s: float | None) -> list[Rollout]:
        async with self.limiter.episodes(name, self.n) if self.limiter is not None else contextlib.nullcontext():
            group.version = self.version()  # its first request goes out now, maybe on newer weights
            try:
                async with asyncio.timeout(timeout_s):
                    return await env.rollout_group(self.sampler, example, self.n)
            except TimeoutError:
                raise EpisodeTimeout(f"its episodes ran past episode_timeout_s = {timeout_s:g} s") from None

    def _finished(self, group: Group, name: str, task: asyncio.Task) -> None:
        self._in_flight.pop(group.seq, None)
        if task.cancelled():
            return
        if (error := task.exception()) is not None:
            if isinstance(error, FATAL) or not isinstance(error, Exception):
                self.fail(error)
            else:
                self._group_failed(name, error)
            return
        self._failed_in_row = 0
        rollouts = task.result()
        if len(rollouts) != self.n:
            self.fail(RuntimeError(f"environment {name!r} returned {len(rollouts)} rollouts for a group of {self.n}"))
            return
        group.rollouts = [(name, rollout) for rollout in rollouts]
        self._done.append(group)
        self._changed.set()

    def _group_failed(self, name: str, error: Exception) -> None:
        """A group the environment could not play (its episodes raised, or ran past their
        timeout): dropped, counted, said once per kind, and the slot goes to another group.
        Groups failing one after another (more than a step's worth) are the environment's
        failure, not an episode's: the run stops with the last one."""
        kind = "episode_timeout" if isinstance(error, EpisodeTimeout) else "episode_error"
        key = f"errors/{name}/{kind}"
        self.failures[key] = self.failures.get(key, 0) + self.n
        what = str(error) if kind == "episode_timeout" else f"its episodes raised {error_line(error)}"
        self._failed_in_row += 1
        if self._failed_in_row > max(self.k, MIN_FAILED_IN_ROW):
            self.fail(RuntimeError(f"environment {name!r}: {self._failed_in_row} groups in a row failed; the last: {what}"))
            return
        if key not in self._said:
            self._said.add(key)
            self.log(f"environment {name!r}: a group was dropped: {what}; another starts in its place (said once; "
                     f"counted in {key})")
        self._changed.set()

    def take_failures(self) -> dict[str, int]:
        """The `errors/<env>/episode_*` counts since the last call, then start over."""
        failures, self.failures = self.failures, {}
        return failures

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _wait_changed(self, timeout_s: float | None) -> bool:
        """Wait until a group completes, the version changes or something failed; False on timeout."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def wait_for_version(self, needed: int, stall: Callable[[int], str], timeout_s: float) -> None:
        """Return once the server serves version ``needed`` or newer; TimeoutError(``stall(needed)``)
        after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.version() < needed:
            self._raise_failure()
            if not await self._wait_changed(max(0.0, deadline - time.monotonic())) and self.version() < needed:
                raise TimeoutError(stall(needed))
