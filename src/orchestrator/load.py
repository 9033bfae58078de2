"""Episodes in flight, bounded by what the machine holds and what inference keeps up with.

Every group of rollouts the orchestrator plays (the pool's, so also the preflight's, which
reads step 0's groups, and evaluation's) takes its ``n`` episodes from one
``EpisodeLimiter`` before it starts and gives them back when it ends::

    async with limiter.episodes(env_name, n):
        rollouts = await env.rollout_group(client, example, n)

Groups wait in the order they asked (first come, first served: a big group is never
starved by smaller ones behind it). A group starts when all three bounds allow it:

- **Memory.** Every ``poll_s`` the limiter measures the memory the run's processes hold
  (the launcher's tree: inference, trainer, orchestrator, environment workers and whatever
  their episodes started; each process's resident memory less its shared pages,
  ``procmem.ProcInfo.anon``) and each environment's episodes: for an environment in a worker
  process, the worker's children with what they started (a v1 harness program per
  episode, say) plus the worker's own growth since it started; for one in the orchestrator,
  the orchestrator's children outside workers (sandboxed tool calls). An episode's
  footprint is that divided by the programs running (an episode is admitted before its
  program starts, seconds before on a loaded machine), or by the episodes in flight where
  there are none, kept as a slowly decaying maximum (a harness grows during its episode). A group starts only while the estimated memory of
  all episodes in flight plus its own stays within the allowance: the budget
  (``[orchestrator.load] memory_budget_gb``; by default 90% of what the machine could give
  the run when the orchestrator started) less what the run holds besides episodes, and never
  more than the machine still has available less a 5% reserve (other programs grow too).
- **Slow start.** An environment's episodes in flight at most double every poll (from one
  group; polls come every quarter second meanwhile), and only once the last measurement
  covered them (half of them running their programs; for an environment never seen running
  any, a second since its first group started), so that its footprint is measured before
  many episodes start at once. An environment in this process that declares its episodes
  start no programs (``Environment.runs_programs = False``, as the built-ins without a
  sandbox do) has none: its episodes hold only the orchestrator's own memory, and a whole
  step starts at once. The slow start cost the quickstart's first batch 1.5-1.9 s against
  0.8-1.0 s without it (its groups of 0.1 s ran one at a time for a second).
- **CPU.** A group of an environment whose episodes run programs waits while the programs
  runnable at the last poll (state R: starting up, say), with those admitted since, number
  the run's CPUs or more: a v1 harness program's start-up costs a second or two of CPU, and
  hundreds started at once on two cores starved vLLM's worker until its engine died
  (measured). The slow start of such an environment also waits while its footprint still
  grows (by more than a tenth a poll: its programs are loading).
- **Inference** (``inference_signals``). vLLM's `/metrics`: when it preempts requests or its
  KV cache is 95% full, the cap on all episodes in flight drops to three quarters of those in
  flight (at most once every 5 s, never under one step's episodes, which the async pipeline
  needs in flight). vLLM's preemption counter also counts the sequences a reload with
  generation in flight froze: its pause resets the prefix cache and they recompute on the new
  weights (the quickstart logged "inference is full (KV cache 1%, 74 requests preempted)"
  for that). The sequences in flight at each such reload (``Replica.frozen``) are taken out
  of it. While the cache is under 80% full, nothing is preempted and no request waits in its
  queue, it grows by a group a poll, and is lifted once it passes twice the episodes in
  flight. (The reference trainer
  sizes its in-flight rollouts the same way.) A server without `/metrics` (an endpoint)
  turns this bound off, said once.

At least one group always runs: when nothing is in flight the first waiting group starts
whatever the bounds say, so a budget smaller than one group slows the run, never stalls it
(said once in the log).

What the limiter saw goes to three places: each step's metrics row (``row``: `load/*`, the
episodes in flight over time, and `inference/*`), `RUN/logs/load.json` (rewritten every poll:
the launcher's out-of-memory report reads the budget and the workers' pids there), and the
orchestrator's heartbeat (``describe``: what a stalled run is waiting on).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.config import LoadConfig
from prime_rl.procmem import GB, MB, MachineMemory, machine_memory, process_tree, run_root, usable_cpus
from prime_rl.rundir import load_state_path, write_json_atomic

BUDGET_SHARE = 0.9
"""The default budget's share of what the machine could give the run."""

RESERVE_SHARE = 0.05
"""Of the machine's memory, what episodes never take, whatever the budget (others grow too)."""

FOOTPRINT_DECAY = 0.97
"""Per poll: how fast a measured episode footprint is forgotten (a decaying maximum)."""

SETTLE_S = 1.0
"""Seconds after its first group started before the slow start of an environment never seen
running programs takes the measurement to cover its episodes (their programs may be slow to start)."""

GROWING = 1.1
"""A footprint that grew by more than this factor in a poll is still growing: the slow start waits."""

SLOW_START_POLL_S = 0.25
"""Seconds between polls while an environment's episodes double each poll (its slow start)."""

CUT_EVERY_S = 5.0
"""At most one cut of the inference cap in this many seconds."""

KV_HIGH, KV_LOW, CUT = 0.95, 0.80, 0.75
"""vLLM's KV cache usage over which the inference cap is cut (to CUT x the episodes in
flight), and under which it grows again."""


# --------------------------------------------------------------------------- vLLM's signals


@dataclass(frozen=True)
class Signals:
    """vLLM's figures summed (max for the usage) over its engines and replicas."""

    kv_usage: float
    preemptions: float
    """Requests preempted since the server started (a counter)."""

    waiting: float
    """Requests waiting in its queue."""


SIGNAL_FAMILIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_preemptions",
                   "vllm:num_requests_waiting")
"""The families ``parse_signals`` reads (a counter's samples and type line add `_total`)."""
_SIGNAL_LINES = SIGNAL_FAMILIES + tuple(f"# {kind} {name}" for kind in ("HELP", "TYPE") for name in SIGNAL_FAMILIES)


def signal_lines(text: str) -> str:
    """The lines of a Prometheus text about ``SIGNAL_FAMILIES`` (samples, `# HELP`, `# TYPE`).
    vLLM's /metrics is ~600 lines, mostly histogram buckets, and the parser is pure Python:
    9.6 ms a page here against 0.34 ms for these lines, at up to 4 polls a second a replica
    (py-spy put ~20% of the quickstart orchestrator's samples in the whole page's parse)."""
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith(_SIGNAL_LINES))


def parse_signals(texts: list[str | None]) -> Signals | None:
    """vLLM's Prometheus texts (one per replica) as ``Signals``; None when none of them holds
    vLLM's KV cache usage (not a vLLM server, or its metrics are off)."""
    from prometheus_client.parser import text_string_to_metric_families

    usage, preempted, waiting, found = 0.0, 0.0, 0.0, False
    for text in texts:
        if not text:
            continue
        try:
            families = list(text_string_to_metric_families(signal_lines(text)))
        except ValueError:  # not Prometheus text
            continue
        for family in families:
            values = [s.value for s in family.samples if not s.name.endswith(("_created", "_bucket", "_sum", "_count"))]
            if not values:
                continue
            if family.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage, found = max(usage, *values), True
            elif family.name == "vllm:num_preemptions":
                preempted += sum(values)
            elif family.name == "vllm:num_requests_waiting":
                waiting += sum(values)
    return Signals(usage, preempted, waiting) if found else None


@dataclass
class InferenceCap:
    """The cap on all episodes in flight that vLLM's signals set (None: no cap), pure."""

    cap: int | None = None
    preemptions: float | None = None
    """The counter at the last update (None before the first)."""

    cut_at: float = -math.inf
    """When the cap was last cut."""

    frozen: float | None = None
    """The client's count of sequences its reloads froze, at the last update."""

    excused: float = 0.0
    """Of the last poll's frozen sequences, those vLLM had not counted yet (a reload's count may
    land in the next poll)."""

    def update(self, signals: Signals, in_flight: int, group: int, floor: int = 0, now: float = 0.0,
               frozen: float = 0.0) -> tuple[int | None, float]:
        """The new cap after one poll's ``signals`` with ``in_flight`` episodes; ``group`` is
        the step of growth, ``floor`` the lowest cap (at least a group: one step's episodes,
        which the async pipeline needs in flight); ``now`` in seconds, for one cut per
        ``CUT_EVERY_S`` (the engine needs a while to drain); ``frozen``, the sequences the
        orchestrator's reloads froze so far (a counter, ``Replica.frozen``), which vLLM counts
        as preempted and which are taken out. Returns (cap, requests preempted since the
        previous poll besides those the reloads froze)."""
        counted = 0.0 if self.preemptions is None else max(0.0, signals.preemptions - self.preemptions)
        new_frozen = 0.0 if self.frozen is None else max(0.0, frozen - self.frozen)
        self.preemptions, self.frozen = signals.preemptions, frozen
        excused = self.excused + new_frozen
        preempted = max(0.0, counted - excused)
        self.excused = min(new_frozen, max(0.0, excused - counted))
        if preempted > 0 or signals.kv_usage >= KV_HIGH:
            if now - self.cut_at >= CUT_EVERY_S:
                self.cut_at = now
                cut = max(group, floor, math.floor(CUT * in_flight))
                self.cap = cut if self.cap is None else min(self.cap, cut)
        elif self.cap is not None and signals.kv_usage < KV_LOW and signals.waiting == 0:  # room, and no queue
            self.cap += group
            if self.cap > 2 * max(in_flight, group):
                self.cap = None
        return self.cap, preempted


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Measure:
    """One measurement of the run's memory, in bytes (each process's ``ProcInfo.anon``)."""

    used: int
    """Memory all of the run's processes hold."""

    machine: MachineMemory | None
    episodes: dict[str, int]
    """Per environment: its episodes' memory (see the module docstring)."""

    programs: dict[str, int]
    """Per environment: its episodes' programs running now (each child process of its worker,
    with what it started; for environments in the orchestrator, their share of its children)."""

    in_flight: dict[str, int]
    """Per environment: its episodes in flight when measured."""

    worker_own: dict[str, int]
    """Per environment in a worker process: the memory of the worker itself."""

    busy: dict[str, int] = field(default_factory=dict)
    """Per environment: of its episodes' programs, those runnable now (starting up, say)."""


def measure(root: int, orchestrator: int, workers: dict[str, int], baselines: dict[str, int],
            in_process: list[str], in_flight: dict[str, int]) -> Measure:
    """Walk the run's process tree from ``root``. ``workers``: environment -> worker pid;
    ``baselines``: a worker's own memory when it started; ``in_process``: the environments
    played in the orchestrator, which share its other children by their episodes in flight."""
    procs = process_tree(root)
    if not any(p.pid == orchestrator for p in procs):  # not under the launcher: our own tree
        procs = process_tree(orchestrator)
    children: dict[int, list] = {}
    for proc in procs:
        children.setdefault(proc.ppid, []).append(proc)

    def descendants(kids) -> list:
        """``kids`` and everything they started."""
        found, todo = [], list(kids)
        while todo:
            proc = todo.pop()
            found.append(proc)
            todo += children.get(proc.pid, [])
        return found

    own = {p.pid: p.anon for p in procs}
    episodes: dict[str, int] = {}
    programs: dict[str, int] = {}
    busy: dict[str, int] = {}
    for name, pid in workers.items():
        kids = children.get(pid, [])
        tree = descendants(kids)
        programs[name], busy[name] = len(kids), sum(p.running for p in tree)
        episodes[name] = sum(p.anon for p in tree) + max(0, own.get(pid, 0) - baselines.get(name, own.get(pid, 0)))
    others = [kid for kid in children.get(orchestrator, []) if kid.pid not in workers.values()]
    tree = descendants(others)
    memory = sum(p.anon for p in tree)
    playing = sum(in_flight.get(name, 0) for name in in_process)
    runnable = sum(p.running for p in tree)
    for name in in_process:
        share = in_flight.get(name, 0) / playing if playing else 0.0
        episodes[name], programs[name] = int(memory * share), round(len(others) * share)
        busy[name] = round(runnable * share)
    worker_own = {name: own[pid] for name, pid in workers.items() if pid in own}
    return Measure(sum(own.values()), machine_memory(), episodes, programs, dict(in_flight), worker_own, busy)


@dataclass
class Footprints:
    """Each environment's estimated memory per episode (a decaying maximum), pure. An episode
    is charged from its admission, but its program starts later (seconds later on a loaded
    machine): memory is divided by the programs running, not by the episodes in flight, where
    an environment has programs."""

    bytes: dict[str, float] = field(default_factory=dict)

    def update(self, m: Measure) -> None:
        for name, total in m.episodes.items():
            old = self.bytes.get(name, 0.0) * FOOTPRINT_DECAY
            n, running = m.in_flight.get(name, 0), m.programs.get(name, 0)
            per = total / min(running, n) if n and running else total / n if n else 0.0
            self.bytes[name] = max(old, per)

    def cost(self, in_flight: dict[str, int]) -> float:
        return sum(self.bytes.get(name, 0.0) * n for name, n in in_flight.items())


def allowance(budget: float, m: Measure) -> float:
    """Bytes all episodes in flight may hold: the budget less what the run holds besides them,
    and no more than the machine could still give them, less the reserve."""
    episodes = sum(m.episodes.values())
    room = budget - (m.used - episodes)
    if m.machine is not None:
        room = min(room, m.machine.available + episodes - RESERVE_SHARE * m.machine.total)
    return room


# --------------------------------------------------------------------------- the limiter


@dataclass
class _Waiter:
    env: str
    n: int
    future: asyncio.Future


@dataclass
class _Window:
    """What the limiter saw since the last metrics row."""

    in_flight: list[int] = field(default_factory=list)
    waiting_max: int = 0
    used_max: int = 0
    available_min: int | None = None
    throttled_s: float = 0.0
    busy_max: int = 0
    kv_max: float | None = None
    preempted: float = 0.0
    queue_max: float | None = None


class EpisodeLimiter:
    def __init__(self, config: LoadConfig, run_dir: Path, envs: list[tuple[str, object]], workers: dict[str, int],
                 client=None, log: Callable[[str], None] = print, inference_floor: int = 0):
        """``envs``: (name, environment) of every environment; ``workers``: name -> worker pid
        of those in worker processes; ``client``: the inference client whose `/metrics` to
        read (None: no inference bound); ``inference_floor``: the fewest episodes vLLM's
        signals may cut to (one step's)."""
        self.config, self.run_dir, self.client, self.log = config, run_dir, client, log
        self.inference_floor = inference_floor
        self.names = [name for name, _ in envs]
        self.workers = dict(workers)
        self.in_process = [name for name in self.names if name not in self.workers]
        self.in_flight: dict[str, int] = dict.fromkeys(self.names, 0)
        self.started: dict[str, dict[int, float]] = {name: {} for name in self.names}
        """Per environment: unix start time of each group in flight, by ticket."""
        self.limit: dict[str, int | None] = {
            name: 0 if name in self.workers or getattr(env, "runs_programs", True) else None for name, env in envs}
        """Slow start: most episodes in flight per environment (0 = one group; None = no limit,
        from the start for one in this process that declares it runs no programs)."""
        self.footprints = Footprints()
        self.growing: dict[str, bool] = dict.fromkeys(self.names, False)
        """Per environment: its footprint grew by more than a tenth at the last poll (its programs still load)."""
        self.cpus = usable_cpus()
        self._started_since = 0
        """Episodes of environments with programs admitted since the last measurement (their programs are starting)."""
        self.has_programs: dict[str, bool] = dict.fromkeys(self.names, False)
        self.first_played: dict[str, float] = {}
        """Per environment: unix time its first group was admitted."""
        """Per environment: its episodes were seen running programs (then its slow start waits for them)."""
        self.inference = InferenceCap()
        self.budget: float | None = None
        self.budget_from = ""
        self.last: Measure | None = None
        self._baselines: dict[str, int] = {}
        self._waiters: deque[_Waiter] = deque()
        self._tickets = itertools.count()
        self._window = _Window()
        self._blocked_since: float | None = None
        self._said: set[str] = set()
        self._task: asyncio.Task | None = None
        self._measure_s = 0.0
        """How long the last measurement took."""
        self._signals_on = client is not None and config.inference_signals
        self._group: int | None = None
        """The smallest group asked for: the inference cap's step and floor."""

    # ----------------------------------------------------------------------- life

    async def start(self) -> None:
        """The first measurement (the budget and the workers' baselines), then a poll every ``poll_s``."""
        first = await asyncio.to_thread(self._measure)
        self._baselines = dict(first.worker_own)
        self.budget, self.budget_from = self._resolve_budget(first)
        self.log(f"memory budget {self.budget / GB:.1f} GB ({self.budget_from}); the run holds {first.used / GB:.1f} GB "
                 "now; episodes start while their estimated memory fits")
        self._record(first)
        self._write_state()
        self._task = asyncio.create_task(self._poll())

    def _resolve_budget(self, first: Measure) -> tuple[float, str]:
        if self.config.memory_budget_gb is not None:
            return self.config.memory_budget_gb * GB, f"[orchestrator.load] memory_budget_gb = {self.config.memory_budget_gb:g}"
        if first.machine is None:
            return math.inf, "no memory figures on this system: no budget"
        could = min(first.machine.total, first.machine.available + first.used)  # RSS counts shared pages twice
        return BUDGET_SHARE * could, (f"{BUDGET_SHARE:.0%} of the {could / GB:.1f} GB the machine could give the run; "
                                      "set [orchestrator.load] memory_budget_gb to change it")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # ----------------------------------------------------------------------- admission

    @contextlib.asynccontextmanager
    async def episodes(self, env: str, n: int) -> AsyncIterator[None]:
        """Hold ``n`` episodes of ``env`` for the block; waits (first come, first served) until they fit."""
        self._group = n if self._group is None else min(self._group, n)
        if not self._waiters and self._fits(env, n):
            self._take(env, n)
        else:
            waiter = _Waiter(env, n, asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            self._blocked()
            try:
                await waiter.future
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.future.done() and not waiter.future.cancelled():
                    self._give_back(env, n, None)  # admitted as it was cancelled
                self._dispatch()
                raise
        ticket = next(self._tickets)
        self.started[env][ticket] = time.time()
        try:
            yield
        finally:
            self._give_back(env, n, ticket)
            self._dispatch()

    def _take(self, env: str, n: int) -> None:
        self.in_flight[env] += n
        if self.has_programs[env]:
            self._started_since += n
        self.first_played.setdefault(env, time.time())

    def _give_back(self, env: str, n: int, ticket: int | None) -> None:
        self.in_flight[env] -= n
        if ticket is not None:
            self.started[env].pop(ticket, None)

    def _fits(self, env: str, n: int) -> bool:
        total = sum(self.in_flight.values())
        if total == 0:
            if not self._memory_fits(env, n):
                self._say_once("small", f"the memory budget ({self.budget / GB:.1f} GB, {self.budget_from}) holds less "
                                        f"than a group of {n} episodes of {env!r} besides the rest of the run; groups run "
                                        "one at a time")
            return True
        limit = self.limit[env]
        if limit is not None and self.in_flight[env] + n > max(limit, n):
            return False
        if self.inference.cap is not None and total + n > self.inference.cap:
            return False
        if self.has_programs[env] and self._cpus_busy():
            return False
        return self._memory_fits(env, n)

    def _cpus_busy(self) -> bool:
        """The episodes' programs runnable at the last measurement, with those admitted since
        (starting now), fill the run's CPUs: a group that starts more programs waits. A
        harness program's start-up costs a second or two of CPU: hundreds started at once on
        two cores starved vLLM's worker past its own timeout (its engine died, measured)."""
        if self.last is None:
            return False
        return sum(self.last.busy.values()) + self._started_since >= self.cpus

    def _memory_fits(self, env: str, n: int) -> bool:
        if self.last is None or self.budget is None:
            return True
        room = allowance(self.budget, self.last)
        return self.footprints.cost(self.in_flight) + n * self.footprints.bytes.get(env, 0.0) <= room

    def _dispatch(self) -> None:
        """Start waiting groups in order while the first one fits."""
        while self._waiters and self._fits(self._waiters[0].env, self._waiters[0].n):
            waiter = self._waiters.popleft()
            if waiter.future.done():  # cancelled while waiting
                continue
            self._take(waiter.env, waiter.n)
            waiter.future.set_result(None)
        self._blocked()

    def _blocked(self) -> None:
        now = time.monotonic()
        if self._waiters and self._blocked_since is None:
            self._blocked_since = now
        elif not self._waiters and self._blocked_since is not None:
            self._window.throttled_s += now - self._blocked_since
            self._blocked_since = None

    # ----------------------------------------------------------------------- polls

    def _measure(self) -> Measure:
        return measure(run_root(), os.getpid(), self.workers, self._baselines, self.in_process, dict(self.in_flight))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval())
            try:
                began = time.monotonic()
                m = await asyncio.to_thread(self._measure)
                self._measure_s = time.monotonic() - began
                self._record(m)
                if self._signals_on:
                    await self._read_signals()
                self._grow_limits()
                self._dispatch()
                self._write_state()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - monitoring never stops the run; the bounds stay as they were
                self._say_once("poll", f"measuring the run's load failed ({type(e).__name__}: {e}); the episode "
                                       "bounds stay as last measured")

    def _record(self, m: Measure) -> None:
        self.last = m
        self._started_since = 0
        before = dict(self.footprints.bytes)
        self.footprints.update(m)
        for name, now in self.footprints.bytes.items():
            self.growing[name] = now > GROWING * before.get(name, 0.0)
        for name, running in m.programs.items():
            self.has_programs[name] = self.has_programs[name] or running > 0
        w = self._window
        w.in_flight.append(sum(self.in_flight.values()))
        w.waiting_max = max(w.waiting_max, sum(x.n for x in self._waiters))
        w.used_max = max(w.used_max, m.used)
        w.busy_max = max(w.busy_max, sum(m.busy.values()))
        if m.machine is not None:
            w.available_min = m.machine.available if w.available_min is None else min(w.available_min, m.machine.available)
        if self.budget is not None and m.used > self.budget:
            self._say_once("over", f"the run holds {m.used / GB:.1f} GB, over its memory budget of "
                                   f"{self.budget / GB:.1f} GB ({self.budget_from}); no more episodes start until it "
                                   "is back inside")

    def _interval(self) -> float:
        """``poll_s``, or a quarter second at most while an environment playing now is in its
        slow start (its doublings wait for polls); never under five times the last
        measurement's own time."""
        starting = any(self.in_flight[name] and limit is not None for name, limit in self.limit.items())
        interval = min(self.config.poll_s, SLOW_START_POLL_S) if starting else self.config.poll_s
        # a walk of hundreds of processes on a loaded machine takes a while: at most a fifth of a core
        return max(interval, 5 * self._measure_s)

    def _grow_limits(self) -> None:
        """Slow start: double an environment's limit once the last measurement covered its
        episodes in flight (half of them running their programs, or, for one never seen
        running any, a second since its first group started)."""
        m, now = self.last, time.time()
        for name, limit in self.limit.items():
            if limit is None or m is None or not m.in_flight.get(name):
                continue
            if self.has_programs[name]:  # and they have grown to their size
                settled = 2 * m.programs.get(name, 0) >= m.in_flight[name] and not self.growing[name]
            else:  # its episodes' memory shows at once, unless programs are yet to start: give them a second
                settled = now - self.first_played.get(name, now) >= SETTLE_S
            if settled:
                grown = max(2 * limit, 2 * m.in_flight[name])
                self.limit[name] = None if grown > 1 << 20 else grown

    async def _read_signals(self) -> None:
        texts = await self.client.server_metrics()
        signals = parse_signals(texts)
        if signals is None and any(texts):  # it answered, without vLLM's figures (a timeout is retried)
            self._signals_on = False
            self._say_once("signals", "the inference server shows no vLLM KV cache figures at /metrics; episodes in "
                                      "flight are bounded by memory alone")
            return
        if signals is None:
            return
        total = sum(self.in_flight.values())
        before = self.inference.cap
        cap, preempted = self.inference.update(signals, total, self._group or 1, self.inference_floor, time.monotonic(),
                                               frozen=self.client.frozen_by_reloads())
        w = self._window
        w.kv_max = max(w.kv_max or 0.0, signals.kv_usage)
        w.preempted += preempted
        w.queue_max = max(w.queue_max or 0.0, signals.waiting)
        if cap is not None and (before is None or cap < before):
            self.log(f"inference is full (KV cache {signals.kv_usage:.0%}, {preempted:g} requests preempted): at most "
                     f"{cap} episodes in flight until it has room")

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log(message)

    # ----------------------------------------------------------------------- what it saw

    def row(self) -> dict[str, float]:
        """The `load/*` and `inference/*` metrics since the previous row, then start over."""
        self._blocked()
        if self._blocked_since is not None:  # still blocked: count up to now
            now = time.monotonic()
            self._window.throttled_s += now - self._blocked_since
            self._blocked_since = now
        w, self._window = self._window, _Window()
        seen = w.in_flight or [sum(self.in_flight.values())]
        if not w.in_flight and self.last is not None:  # no poll since the last row: the last one's figures
            w.used_max = self.last.used
            w.available_min = self.last.machine.available if self.last.machine is not None else None
        row: dict[str, float] = {
            "load/episodes_in_flight": sum(seen) / len(seen),
            "load/episodes_in_flight_max": max(seen),
            "load/episodes_waiting_max": w.waiting_max,
            "load/throttled_s": w.throttled_s,
            "load/memory_gb": w.used_max / GB,
            "load/programs_runnable_max": w.busy_max,
        }
        if self.budget is not None and math.isfinite(self.budget):
            row["load/memory_budget_gb"] = self.budget / GB
        if w.available_min is not None:
            row["load/memory_available_gb"] = w.available_min / GB
        for name in self.names:
            row[f"load/episode_mb/{name}"] = self.footprints.bytes.get(name, 0.0) / MB
        if self.inference.cap is not None:
            row["load/inference_cap"] = self.inference.cap
        if w.kv_max is not None:
            row["inference/kv_cache_usage"] = w.kv_max
            row["inference/preemptions"] = w.preempted
            row["inference/requests_waiting"] = w.queue_max
        return row

    def oldest(self, name: str) -> float | None:
        """When ``name``'s oldest episode in flight started (unix time); None when none runs."""
        return min(self.started[name].values(), default=None)

    def describe(self) -> str:
        """What is in flight and what waits, for the heartbeat (one line)."""
        parts = []
        for name in self.names:
            if self.in_flight[name]:
                oldest = self.oldest(name)
                since = f" (oldest since {time.strftime('%H:%M:%S', time.localtime(oldest))})" if oldest else ""
                parts.append(f"{self.in_flight[name]} episodes in flight in environment {name!r}{since}")
        if self._waiters:
            why = ""
            if self.last is not None and self.budget is not None and math.isfinite(self.budget):
                why = f" (the run holds {self.last.used / GB:.1f} GB of its {self.budget / GB:.1f} GB budget"
                busy = sum(self.last.busy.values())
                why += f"; {busy} episode programs runnable on {self.cpus} CPUs)" if busy >= self.cpus else ")"
            parts.append(f"{len(self._waiters)} groups waiting to start{why}")
        return "; ".join(parts) or "no episodes in flight"

    def _write_state(self) -> None:
        m = self.last
        envs = {}
        for name in self.names:
            envs[name] = {"in_flight": self.in_flight[name], "waiting": sum(w.n for w in self._waiters if w.env == name),
                          "oldest_unix": self.oldest(name), "episode_bytes": int(self.footprints.bytes.get(name, 0.0)),
                          "worker_pid": self.workers.get(name)}
        state = {"time_unix": time.time(), "budget_from": self.budget_from, "envs": envs,
                 "used_bytes": m.used if m else None,
                 "available_bytes": m.machine.available if m and m.machine else None,
                 "budget_bytes": int(self.budget) if self.budget is not None and math.isfinite(self.budget) else None}
        path = load_state_path(self.run_dir)
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, state)
