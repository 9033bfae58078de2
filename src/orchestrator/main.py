"""Orchestrator process: sample rollouts, score them, compute advantages, ship batches.

    python -m orchestrator.main --config RUN/configs/orchestrator.json [--dotted.flags]

Per step n (0..max_steps-1), top to bottom:
  (a)-(d) the step's groups, cut from one pool of groups in flight (`orchestrator.inflight`)
      on either of two schedules (`batching`):
      continuous (the default): groups stay in flight across step boundaries, up to
        `max_inflight_groups`; the step's batch is cut from the groups that completed first;
        a group older than n - async_level (or `max_off_policy_steps`) is dropped (counted in
        `batch/stale_groups_dropped`, never trained on). Meanwhile the weight follower loads
        each new complete `weights/step_K/` as soon as it appears, while requests are in
        flight (vLLM's `/pause?mode=keep`: they continue on the new weights, so one
        completion may hold tokens of two versions; each keeps the logprob it was sampled
        with, and the prefix cache is salted per version). Evaluation runs beside the groups
        in flight;
      step (the barrier: the same pool with one step in flight): (a) sync the policy:
        inference must serve weights of version >= n - async_level, reloaded between steps
        (with LoRA, the adapter; with `client.verify_reload`, the replicas must then score a
        probe prompt alike); (b) evaluate every `eval.interval` steps; (c)-(d) the step's
        groups all start at once and are taken in start order.
      Either way, with `[orchestrator.filter]`, groups that teach nothing are dropped and
      replaced (`orchestrator.filtering`);
  (d') step 0 of a fresh run: the preflight check of the task's difficulty reads the step's
      groups, sampled by the starting model (`orchestrator.preflight`);
  (e) advantages within each example's group of rollouts;
  (e') with a distillation teacher, its logprob of every sampled token;
  (e'') a few whole groups traced: readable rows in `RUN/traces/` (`orchestrator.traces`);
  (f) pack one batch per trainer rank, record it, send it;
  (g) log a metrics row (overall, and per environment); `time/step` spans (a)-(f).
Each batch is recorded in `rollouts/step_n/` before it is sent (`orchestrator.progress`),
so a resume from a trainer checkpoint re-sends what was sampled but not yet trained on
and samples on from the recorded data cursor (with continuous batching, the examples in
flight first). At the end, groups still in flight are cancelled, the last evaluation waits
for the final weights (bounded by `weights_timeout_s`), and the process exits. Every wait
is named in `RUN/logs/orchestrator.heartbeat.json` for the launcher's watchdog.
Versions count optimizer steps: 0 is the initial model and `weights/step_K` holds the
weights after K steps (the trainer writes it after training on batch K-1), so the trainer
trains step n with version n and a sample's staleness n - version is its true off-policy
gap. Every sample records the oldest and newest version its tokens were sampled with, and
every sample of step n has oldest version >= n - async_level, or n - max_off_policy_steps
where that is set (checked before sending); async_level 0 is fully on-policy.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from prime_rl.chat import TemplateError
from prime_rl.config import EnvConfig, OrchestratorConfig
from prime_rl.cores import take_back_cores
from prime_rl.envs import Environment
from prime_rl.heartbeat import Heartbeat
from prime_rl.keys import API_KEY_ENV
from prime_rl.metrics import Metrics, make_metrics
from prime_rl.registry import SET_PARSER
from prime_rl.rundir import MARKER, latest_weights_step, weights_dir, weights_step_dir
from prime_rl.settings import ConfigError, exit_process, help_text, process_config
from prime_rl.transfer import Announcement, read_announcement
from prime_rl.wire import encode_batch

from orchestrator.advantages import group_advantages, zero_variance_groups
from orchestrator.batch import ScoredRollout, pack_batches
from orchestrator.client import InferenceClient
from orchestrator.data import ExampleOrder
from orchestrator.envs import load_env
from orchestrator.entry import check_tool_parser, run_entry, start_loading_tokenizer
from orchestrator.envworker import WorkerEnvironment
from orchestrator.inflight import Group, GroupPool
from orchestrator.load import EpisodeLimiter
from orchestrator.preflight import PreflightFailed, preflight
from orchestrator.progress import (
    Cursor,
    ResumeError,
    StepRecord,
    plan_resume,
    prune_records,
    repacked_frames,
    save_record,
)
from orchestrator.rollouts import function_figures, run_groups, summarize
from orchestrator.sampler import TokenSampler, check_multi_turn_template
from orchestrator.sender import BatchSender
from orchestrator.teacher import Teacher, TeacherError
from orchestrator.traces import TraceWriter, env_secrets

CONSOLE_KEYS = ("reward/mean", "distill/reverse_kl", "policy/version", "staleness/max", "seq/completion_len_mean", "time/step")
WEIGHTS_POLL_S = 0.1
PROGRESS_POLL_S = 10.0
RATE_WINDOW_S = 10.0


# --------------------------------------------------------------------------- (a) policy sync


@dataclass(frozen=True)
class PolicySync:
    version: int
    """Weights version inference serves after the sync."""

    reloaded_step: int | None
    wait_s: float
    reload_s: float
    probe_logprobs: tuple[float, ...] = ()
    """Each replica's score of the fixed probe prompt after the reload (`client.verify_reload`);
    empty without a reload or without the check."""


def newest_policy(run_dir: Path) -> tuple[int, Path | Announcement] | None:
    """The newest policy version the trainer published and where it is: a complete
    `weights/step_K`, or in memory mode a version it announced (``prime_rl.transfer``)."""
    step = latest_weights_step(run_dir)
    announced = read_announcement(run_dir)
    if announced is not None and (step is None or announced.version > step):
        return announced.version, announced
    return None if step is None else (step, weights_step_dir(run_dir, step))


async def wait_for_weights(run_dir: Path, min_step: int, timeout_s: float) -> tuple[int, Path | Announcement]:
    """Poll until policy version K >= min_step is published (``newest_policy``); returns the newest."""
    deadline = time.monotonic() + timeout_s
    while (newest := newest_policy(run_dir)) is None or newest[0] < min_step:
        if time.monotonic() >= deadline:
            raise TimeoutError(weights_missing(run_dir, min_step, timeout_s))
        await asyncio.sleep(WEIGHTS_POLL_S)
    return newest


async def sync_policy(
    step: int, loaded: int, cfg: OrchestratorConfig, client: InferenceClient, async_level: int | None = None
) -> PolicySync:
    """Reload the newest complete weights if newer than ``loaded``; block if they are older than
    ``async_level`` (default `cfg.async_level`) steps. With `client.verify_reload`, check that
    every replica then serves the same weights."""
    start = time.perf_counter()
    required = step - (cfg.async_level if async_level is None else async_level)
    if loaded < required:
        newest = await wait_for_weights(cfg.output_dir, required, cfg.weights_timeout_s)
    else:
        newest = newest_policy(cfg.output_dir)
    wait_s = time.perf_counter() - start
    if newest is None or newest[0] <= loaded:
        return PolicySync(version=loaded, reloaded_step=None, wait_s=wait_s, reload_s=0.0)
    start = time.perf_counter()
    latest, weights = newest
    await client.reload_weights(weights, latest)
    reload_s = time.perf_counter() - start
    probes = await client.probe_replicas() if cfg.client.verify_reload else []
    return PolicySync(version=latest, reloaded_step=latest, wait_s=wait_s, reload_s=reload_s, probe_logprobs=tuple(probes))


def off_policy_bound(cfg: OrchestratorConfig) -> tuple[int, str]:
    """How many versions behind its step a sample may be, and the setting that says so:
    `max_off_policy_steps` with continuous batching where set, else `async_level`."""
    if cfg.max_off_policy_steps is None or cfg.batching == "step":
        return cfg.async_level, "async_level"
    return cfg.max_off_policy_steps, "max_off_policy_steps"


def check_async_bound(items: list[ScoredRollout], step: int, cfg: OrchestratorConfig) -> None:
    bound, knob = off_policy_bound(cfg)
    oldest = min(item.policy_version for item in items)
    if oldest < step - bound:  # a bug, never a user error: the sync step and the pool must prevent it
        raise RuntimeError(f"step {step}: a sample of policy version {oldest} breaks {knob} {bound}")


# --------------------------------------------------------------------------- (f) metrics


@dataclass
class RateWindow:
    """Sampled tokens per second over the last ``seconds`` of steps at least (all steps so far
    until then). One step's rate is no rate a person can read with continuous batching: two
    cuts close together make a step whose groups took almost no time since the last cut."""

    seconds: float = RATE_WINDOW_S
    steps: deque = field(default_factory=deque)
    """(tokens, seconds) of the steps in the window, oldest first."""

    def add(self, tokens: int, span_s: float) -> float:
        """Add a step's tokens and the time they took; returns the window's rate."""
        self.steps.append((tokens, span_s))
        while len(self.steps) > 1 and sum(s for _, s in self.steps) - self.steps[0][1] >= self.seconds:
            self.steps.popleft()
        return sum(t for t, _ in self.steps) / max(sum(s for _, s in self.steps), 1e-9)


def step_metrics(
    step: int,
    items: list[ScoredRollout],
    sync: PolicySync,
    cfg: OrchestratorConfig,
    generate_s: float,
    step_s: float,
    client_retries: int,
    requests_per_replica: list[int],
    rate_s: float | None = None,
    window: RateWindow | None = None,
) -> dict[str, float | int]:
    rewards = np.array([item.rollout.reward for item in items])
    staleness = np.array([step - item.policy_version for item in items])
    completion_lens = np.array([item.rollout.completion_tokens for item in items])
    total_lens = np.array([item.rollout.total_tokens for item in items])
    row: dict[str, float | int] = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "staleness/max": int(staleness.max()),
        "staleness/mean": float(staleness.mean()),
        # rollouts whose tokens came from two policies (a reload landed while they were sampled)
        "staleness/mixed_frac": float(np.mean([(item.last_policy_version or item.policy_version) > item.policy_version
                                               for item in items])),
        "policy/version": sync.version,
        "batch/zero_adv_groups_frac": float(zero_variance_groups(rewards, cfg.rollouts_per_example).mean()),
        "batch/finish_length_frac": float(np.mean([item.rollout.finish_reason == "length" for item in items])),
        "batch/rollouts_without_tokens": sum(not item.rollout.turns for item in items),
        "seq/completion_len_mean": float(completion_lens.mean()),
        "seq/len_max": int(total_lens.max()),
        "seq/truncated_frac": float((total_lens > cfg.seq_len).mean()),
        "perf/tokens_per_s": (window or RateWindow(0.0)).add(int(completion_lens.sum()), generate_s if rate_s is None else rate_s),
        "time/generate": generate_s,
        "time/wait_weights": sync.wait_s,
        "time/reload": sync.reload_s,
        "time/step": step_s,
        "inference/retries": client_retries,
        "seq/turns_mean": float(np.mean([item.rollout.num_turns for item in items])),
        # rollouts whose environment re-rendered the conversation (several exact samples each)
        "seq/restarted_frac": float(np.mean([any(t.restart for t in item.rollout.turns) for item in items])),
        **{
            f"stop/{cond}_frac": float(np.mean([item.rollout.stop_condition == cond for item in items]))
            for cond in sorted({item.rollout.stop_condition for item in items})
        },
        **env_metrics(items),
    }
    if sync.reloaded_step is not None:
        row["weights/reloaded_step"] = sync.reloaded_step
    row.update(probe_row(sync.probe_logprobs, "weights"))
    if len(requests_per_replica) > 1:  # cumulative: how evenly requests spread over the replicas
        row.update({f"inference/requests/{i}": count for i, count in enumerate(requests_per_replica)})
    return row


def probe_row(values, prefix: str) -> dict[str, float]:
    """`<prefix>/probe_logprob/<replica>`: each replica's score of the probe prompt."""
    return {f"{prefix}/probe_logprob/{i}": value for i, value in enumerate(values)}


def env_metrics(items: list[ScoredRollout]) -> dict[str, float | int]:
    """Per environment: `reward/<env>/mean`, `batch/<env>/rollouts`, `metrics/<env>/<function>`
    (mean raw value) and `errors/<env>/<function>` (rollouts whose function raised)."""
    row: dict[str, float | int] = {}
    for name in dict.fromkeys(item.env for item in items):
        rollouts = [item.rollout for item in items if item.env == name]
        row[f"reward/{name}/mean"] = float(np.mean([r.reward for r in rollouts]))
        row[f"batch/{name}/rollouts"] = len(rollouts)
        for key, value in function_figures(rollouts).items():
            kind, function = key.split("/", 1)
            row[f"{kind}/{name}/{function}"] = value
        for metric in (m for r in rollouts for m in r.metrics):  # a function with a value has an error count, 0 or more
            row.setdefault(f"errors/{name}/{metric}", 0)
    return row


# --------------------------------------------------------------------------- (a)-(d) the step's groups


@dataclass
class Reloads:
    """The weights loaded since the last step was cut: by the step's own sync (one step in
    flight) or by the weight follower (continuous batching)."""

    steps: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    seconds: float = 0.0
    probe_logprobs: tuple[float, ...] = ()

    def add(self, sync: PolicySync) -> None:
        if sync.reloaded_step is not None:
            self.steps.append(sync.reloaded_step)
        self.wait_s += sync.wait_s
        self.seconds += sync.reload_s
        self.probe_logprobs = sync.probe_logprobs or self.probe_logprobs

    def take(self, version: int) -> PolicySync:
        """This step's share, as one sync reports it; then start over."""
        sync = PolicySync(version, self.steps[-1] if self.steps else None, self.wait_s, self.seconds, self.probe_logprobs)
        self.steps, self.wait_s, self.seconds, self.probe_logprobs = [], 0.0, 0.0, ()
        return sync


@dataclass
class Generation:
    """Where every step's groups come from: the pool, and how new weights reach inference."""

    pool: GroupPool
    reloads: Reloads
    follower: asyncio.Task | None = None
    """Continuous batching: loads each new policy while groups are in flight. None = one
    step in flight: the policy is synced between steps (``sync_policy``)."""


def start_generation(cfg: OrchestratorConfig, envs, order: ExampleOrder, sampler: TokenSampler, client: InferenceClient,
                     pending: list[tuple[int, int]], limiter: EpisodeLimiter | None = None) -> Generation:
    """The pool of groups in flight (``batching = "step"``: one step's groups at a time, all
    of them at once, as the step barrier samples them), and with continuous batching the
    weight follower beside it."""
    one_step = cfg.batching == "step"
    groups = cfg.batch_size // cfg.rollouts_per_example
    pool = GroupPool(
        envs, order, sampler, rollouts_per_example=cfg.rollouts_per_example, groups_per_step=groups,
        async_level=cfg.async_level,
        max_inflight=groups if one_step else cfg.max_inflight_groups or (cfg.async_level + 1) * groups,
        max_off_policy=off_policy_bound(cfg)[0],
        version=lambda: client.version, pending=pending, log=log, max_steps=cfg.max_steps, one_step=one_step,
        limiter=limiter, timeouts=[env_cfg.episode_timeout_s for env_cfg in cfg.env],
    )
    reloads = Reloads()
    follower = None if one_step else asyncio.create_task(follow_weights(cfg, client, pool, reloads))
    return Generation(pool, reloads, follower)


async def stop_generation(generation: Generation | None) -> None:
    """Cancel the weight follower and every group in flight, and wait until they stopped."""
    if generation is None:
        return
    if generation.follower is not None:
        generation.follower.cancel()
        await asyncio.gather(generation.follower, return_exceptions=True)
    await generation.pool.close()


async def follow_weights(cfg: OrchestratorConfig, client: InferenceClient, pool: GroupPool, reloads: Reloads) -> None:
    """Load every new complete `weights/step_K` as soon as it appears, while requests are
    in flight (``keep``: they continue on the new weights); a failure fails the pool's cut."""
    try:
        while True:
            newest = newest_policy(cfg.output_dir)
            if newest is not None and newest[0] > client.version:
                start = time.perf_counter()
                latest, weights = newest
                await client.reload_weights(weights, latest, keep=True)
                probes = tuple(await client.probe_replicas()) if cfg.client.verify_reload else ()
                reloads.add(PolicySync(latest, latest, 0.0, time.perf_counter() - start, probes))
                pool.notify()
            await asyncio.sleep(WEIGHTS_POLL_S)
    except Exception as e:  # noqa: BLE001 - handed to the loop, which raises it
        pool.fail(e)


async def report_answers(client: InferenceClient, hb: Heartbeat, limiter: EpisodeLimiter) -> None:
    """Answered generation requests are progress too (a long evaluation or preflight sends
    no batch for a while): the heartbeat says so whenever their count moved. It also says
    what is in flight (the limiter's view), which the watchdog shows when the run stalls."""
    seen = client.answered
    while True:
        await asyncio.sleep(PROGRESS_POLL_S)
        hb.detail(limiter.describe())
        if client.answered != seen:
            seen = client.answered
            hb.progress(f"{seen} generation requests answered")


def start_limiter(cfg: OrchestratorConfig, envs: list[tuple[str, Environment]], client: InferenceClient) -> EpisodeLimiter:
    """The bound on episodes in flight (``orchestrator.load``), over every environment; the
    workers' pids tell it which processes are whose episodes."""
    workers = {name: env.worker.proc.pid for name, env in envs if isinstance(env, WorkerEnvironment)}
    return EpisodeLimiter(cfg.load, cfg.output_dir, envs, workers, client, log, inference_floor=cfg.batch_size)


def weights_stall(cfg: OrchestratorConfig, step: int) -> str:
    """Why step ``step`` cannot be sampled: the policy it needs is not there yet."""
    return weights_missing(cfg.output_dir, step, cfg.weights_timeout_s)


def weights_missing(run_dir: Path, step: int, timeout_s: float) -> str:
    """The one-line error of a wait for `weights/step_<step>` that ran out."""
    latest = latest_weights_step(run_dir)
    announced = read_announcement(run_dir)
    in_memory = f"; newest announced in memory: {announced.version}" if announced is not None else ""
    return (
        f"waited {timeout_s:.0f} s for {weights_step_dir(run_dir, step)} (with its {MARKER} marker); "
        f"newest complete weights: {latest if latest is not None else 'none'} in {weights_dir(run_dir)}{in_memory}. "
        "Is the trainer running and receiving batches?"
    )


# --------------------------------------------------------------------------- the loop


@dataclass
class StepBatch:
    """A step's groups before advantages, with what a resume needs to sample on."""

    groups: list[Group]
    """In the order the step took them: each one example's rollouts, with their versions."""

    sync: PolicySync
    generate_s: float
    """Seconds the step waited for its groups."""

    rate_s: float
    """Seconds the step's tokens took to generate, for `perf/tokens_per_s` (with continuous
    batching the time since the previous step was cut)."""

    row: dict[str, float | int]
    cursor: Cursor
    """Where sampling stands after the step."""

    judged: list[Group] = field(default_factory=list)
    """Every group the step judged: ``groups`` and those its filter dropped."""

    eval_row: dict | None = None
    """The evaluation that ran before the step (`eval.interval`)."""


async def step_batch(step: int, envs, sampler: TokenSampler, cfg: OrchestratorConfig, client: InferenceClient,
                     generation: Generation, hb: Heartbeat, traces: TraceWriter) -> StepBatch:
    """(a) the policy: with one step in flight, synced here, between steps; otherwise the
    weight follower loaded each new one meanwhile. (b) evaluation on its interval, with a
    policy the step may train on. (c)-(d) the step's groups, cut from the pool."""
    pool, bound = generation.pool, step - cfg.async_level
    stall = lambda needed: weights_stall(cfg, needed)  # noqa: E731
    if generation.follower is None:
        with hb.waiting(f"weights step >= {bound} for step {step}"):
            generation.reloads.add(await sync_policy(step, client.version, cfg, client))
    eval_row = None
    if eval_due(cfg, step):
        with hb.waiting(f"weights step {bound} for the evaluation at step {step}"):
            await pool.wait_for_version(bound, stall, cfg.weights_timeout_s)
        with hb.waiting(f"the evaluation at step {step}"):
            eval_row = await evaluate(envs, sampler, cfg, client.version, step, traces, pool.limiter)
    with hb.waiting(f"step {step}'s {pool.k} groups (policy {client.version}, weights step >= {bound} needed)"):
        cut = await pool.cut(step, stall, cfg.weights_timeout_s, cfg.filter)
    return StepBatch(
        groups=cut.groups,
        sync=generation.reloads.take(client.version),
        generate_s=cut.wait_s,
        rate_s=cut.span_s,
        row={**cut.filter_row, "batch/stale_groups_dropped": cut.stale, "batch/groups_in_flight": cut.in_flight,
             **(pool.limiter.row() if pool.limiter is not None else {}), **pool.take_failures()},
        cursor=Cursor(pool.order.state_dict(), pool.pending()),
        judged=cut.judged,
        eval_row=eval_row,
    )


def eval_due(cfg: OrchestratorConfig, step: int) -> bool:
    return bool(cfg.eval.interval) and step % cfg.eval.interval == 0


def scored_items(batch: StepBatch, cfg: OrchestratorConfig, step: int) -> list[ScoredRollout]:
    """(e) advantages within each example's group."""
    rollouts = [(group, name, r) for group in batch.groups for name, r in group.rollouts]
    advantages = group_advantages(
        [r.reward for _, _, r in rollouts], cfg.rollouts_per_example, normalize_std=cfg.advantage.normalize_std
    )
    newest = {group.seq: group.last_version for group in batch.groups}
    items = [
        ScoredRollout(r, float(a), group.version, name, newest[group.seq])
        for (group, name, r), a in zip(rollouts, advantages, strict=True)
    ]
    check_async_bound(items, step, cfg)
    return items


async def run(cfg: OrchestratorConfig, envs: list[tuple[str, Environment]], tokenizer) -> None:
    sizes = [len(env.dataset) for _, env in envs]
    weights = [env_cfg.weight for env_cfg in cfg.env]
    order = ExampleOrder(sizes, seed=cfg.seed, weights=weights)
    examples_per_step = cfg.batch_size // cfg.rollouts_per_example
    data = {"seed": cfg.seed, "dataset_sizes": sizes, "weights": weights, "examples_per_step": examples_per_step}
    record_progress = cfg.ckpt.interval > 0
    metrics = make_metrics("orchestrator", cfg.output_dir, CONSOLE_KEYS, cfg.wandb, cfg.model_dump(mode="json"))
    memory = cfg.weight_transfer if cfg.weight_transfer.mode == "memory" else None
    client = InferenceClient(cfg.client, cfg.model, lora_adapter=cfg.lora_adapter, weight_transfer=memory)
    sampler = TokenSampler(
        client, tokenizer, cfg.sampling, cfg.seq_len, per_turn=cfg.multi_turn == "per_turn",
        tool_call_parser=cfg.tool_call_parser,
        teacher_system_prompt=cfg.teacher.system_prompt if cfg.teacher is not None else cfg.teacher_system_prompt,
    )
    teacher = Teacher(cfg.teacher) if cfg.teacher is not None else None
    rate = RateWindow()  # perf/tokens_per_s
    traces = TraceWriter(cfg.output_dir, cfg.traces, tokenizer, cfg.seq_len, secrets=run_secrets(cfg), seed=cfg.seed,
                         wandb=metrics.wandb_run, per_turn=cfg.multi_turn == "per_turn")
    hb = Heartbeat(cfg.output_dir, "orchestrator")
    sender, generation, delivered = None, None, False
    limiter = start_limiter(cfg, envs, client)
    answers = asyncio.create_task(report_answers(client, hb, limiter))
    try:
        sender = BatchSender(cfg.transport, cfg.num_trainer_ranks)  # bind early so trainer ranks can connect
        start, version, cursor = 0, 0, Cursor(order.state_dict())  # a fresh run: the initial model
        if cfg.ckpt.resume_step is not None:
            start, version, cursor = resume(cfg, data, order, sender, metrics, traces)
        startup_row = await prepare_servers(cfg, client, teacher, tokenizer, version, hb)
        await limiter.start()  # measured once inference is up: the budget counts what it holds
        generation = start_generation(cfg, envs, order, sampler, client, cursor.pending, limiter)
        generation.pool.fill(start)  # continuous: the first groups sample while the trainer starts
        for step in range(start, cfg.max_steps):
            step_start = time.perf_counter()
            # (a)-(d): the policy synced, evaluation on its interval, the step's groups
            batch = await step_batch(step, envs, sampler, cfg, client, generation, hb, traces)
            if batch.eval_row is not None:
                metrics.log(step, batch.eval_row, process="eval")
            # (d') a fresh run's first groups, sampled by the starting model, are the preflight's sample
            if step == 0 and cfg.preflight.enabled:
                checked = [(envs[group.pick[0]][0], [r for _, r in group.rollouts]) for group in batch.judged]
                metrics.log(0, preflight(checked, [name for name, _ in envs], cfg.preflight, log), process="preflight")
            # (e) advantages within each example's group, and the teacher's scores
            items, teacher_row = await score_step(batch, cfg, step, teacher, hb)
            # (e'') a few whole groups traced; the trainer traces its view of the same samples
            sizes = [len(group.rollouts) for group in batch.groups]
            items = traces.mark(step, items, sizes)
            trace_lines = traces.lines(traces.train_rows(step, items, sizes))
            # (f) one batch per trainer rank, recorded (for a resume) before it is sent
            frames = [encode_batch(b) for b in pack_step(items, step, cfg)]
            row = {**step_metrics(step, items, batch.sync, cfg, batch.generate_s, time.perf_counter() - step_start,
                                  client.retries, client.requests_per_replica(), batch.rate_s, rate),
                   **batch.row, **teacher_row, **startup_row}
            startup_row = {}
            record = step_record(step, frames, cursor, batch, data, row, trace_lines) if record_progress else None
            ship_step(step, frames, sender, cfg, record, traces, trace_lines)
            cursor = batch.cursor
            # (g) metrics; time/step covers the whole step, the record and the send included
            row["time/step"] = time.perf_counter() - step_start
            metrics.log(step, row)
            hb.progress(f"sent the batch of step {step}")
        # The end: the groups still in flight are cancelled (nothing keeps sampling), then
        # the final policy is evaluated once the trainer has written it.
        await stop_generation(generation)
        generation = None
        if cfg.eval.interval:
            with hb.waiting(f"the final weights (step {cfg.max_steps}) for the last evaluation"):
                sync = await sync_policy(cfg.max_steps, client.version, cfg, client, async_level=0)
            with hb.waiting("the last evaluation"):
                metrics.log(cfg.max_steps, await evaluate(envs, sampler, cfg, sync.version, cfg.max_steps, traces, limiter),
                            process="eval")
        delivered = True
    finally:
        answers.cancel()
        await stop_generation(generation)
        await limiter.close()
        # After the last step, linger so queued batches still reach the trainer; on an error, drop them.
        if sender is not None:
            sender.close(flush=delivered)
        await client.close()
        if teacher is not None:
            await teacher.close()
        metrics.close()


async def prepare_servers(cfg: OrchestratorConfig, client: InferenceClient, teacher: Teacher | None, tokenizer, version: int,
                          hb: Heartbeat) -> dict[str, float]:
    """Before the first step: inference healthy and serving ``version``'s weights (the
    launcher's choice; a warm server gets this run's own), the teacher checked. Returns the
    start-up figures for the first step's row."""
    client.version = version
    with hb.waiting(f"the inference server at {', '.join(cfg.client.urls)} to become healthy"):
        await client.wait_healthy(cfg.client.startup_timeout_s)
    if teacher is not None:
        with hb.waiting(f"the teacher at {teacher.url}"):
            await teacher.check(tokenizer, cfg.seq_len)
    row = {"startup/server_ready_unix": time.time()}  # benchmarks.run reads it
    if cfg.initial_weights is not None:  # a running server (another run's): our own weights first
        await client.resume()  # a run killed mid-reload leaves it paused
        await client.reload_weights(cfg.initial_weights, version)
    elif version > 0 and cfg.lora_adapter is not None:  # LoRA: inference serves the base; load the adapter
        await client.reload_weights(weights_step_dir(cfg.output_dir, version), version)
    if cfg.client.verify_reload:  # the replicas must start alike too; later probes must differ from this
        row.update(probe_row(await client.probe_replicas(), "startup"))
    return row


async def score_step(batch: StepBatch, cfg: OrchestratorConfig, step: int, teacher: Teacher | None,
                     hb: Heartbeat) -> tuple[list[ScoredRollout], dict[str, float]]:
    """(e) advantages within each example's group; with a distillation teacher, (e') its logprob
    of every sampled token and its metrics."""
    items = scored_items(batch, cfg, step)
    if teacher is None:
        return items, {}
    with hb.waiting(f"the teacher's logprobs for step {step}"):
        return await teacher.score(items, cfg.seq_len, cfg.multi_turn == "per_turn")


def ship_step(step: int, frames: list[bytes], sender: BatchSender, cfg: OrchestratorConfig, record: StepRecord | None,
              traces: TraceWriter, trace_lines: list[str]) -> None:
    """(f) the step's frames to the trainer ranks; with a ``record``, first into
    `rollouts/step_n/`, which a resume re-sends from (its trace rows with it)."""
    if record is not None:
        save_record(cfg.output_dir, record)
        prune_records(cfg.output_dir)
    traces.write(trace_lines, step)
    for rank, frame in enumerate(frames):
        sender.send_frame(rank, step, frame)


def step_record(step: int, frames: list[bytes], before: Cursor, batch: StepBatch, data: dict, row: dict,
                trace_lines: list[str]) -> StepRecord:
    """The step's batch and cursors, as `rollouts/step_n/` keeps them for a resume."""
    return StepRecord(
        step=step,
        frames=frames,
        before=before,
        after=batch.cursor,
        picks=[group.pick for group in batch.groups],
        min_version=min(group.version for group in batch.groups),
        max_version=max(group.last_version for group in batch.groups),
        data=data,
        metrics=row,
        traces=trace_lines,
    )


def pack_step(items: list[ScoredRollout], step: int, cfg: OrchestratorConfig):
    return pack_batches(
        items,
        step=step,
        num_ranks=cfg.num_trainer_ranks,
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.sampling.temperature,
        seq_len=cfg.seq_len,
        per_turn=cfg.multi_turn == "per_turn",
    )


async def evaluate(envs: list[tuple[str, Environment]], sampler: TokenSampler, cfg: OrchestratorConfig, version: int,
                   step: int, traces: TraceWriter, limiter: EpisodeLimiter | None) -> dict:
    """`eval/<env>/...` figures on the first `eval.num_examples` of each eval split, and the
    overall `eval/reward/mean`; the chosen groups of each traced (kind `eval`)."""
    start = time.perf_counter()
    row: dict[str, float | int] = {"eval/policy_version": version}
    all_groups = []
    for name, env in envs:
        examples = env.eval_examples(cfg.eval.num_examples)
        groups = await run_groups(env, sampler, examples, cfg.eval.rollouts_per_example, limiter=limiter, name=name)
        all_groups += groups
        row.update({f"eval/{name}/{key}": value for key, value in summarize(groups).items()})
        traces.write(traces.lines(traces.group_rows("eval", step, name, groups, tag=name)))
    row["eval/reward/mean"] = summarize(all_groups)["reward/mean"]
    row["time/eval"] = time.perf_counter() - start
    log(f"eval with policy version {version}: mean reward {row['eval/reward/mean']:.3f}")
    return row


def resume(
    cfg: OrchestratorConfig, data: dict, order: ExampleOrder, sender: BatchSender, metrics: Metrics, traces: TraceWriter
) -> tuple[int, int, Cursor]:
    """Continue after trainer checkpoint N: re-send the recorded batches sampled but not yet
    trained on (with their metrics rows and trace rows; re-packed if the trainer now has another
    number of ranks) and restore the data cursor. Inference serves weights/step_N. Returns (first step
    to sample, policy version inference serves, the cursor: the order's state and the
    examples that were in flight, which are sampled first)."""
    step = cfg.ckpt.resume_step
    plan = plan_resume(cfg.output_dir, step, data)
    order.load_state_dict(plan.cursor.order)
    for record in plan.replay:
        frames = record.frames
        if len(frames) != cfg.num_trainer_ranks:
            frames = repacked_frames(record, cfg.num_trainer_ranks, cfg.micro_batch_size)
            log(f"re-packed step {record.step}'s batch from {len(record.frames)} ranks to {len(frames)}")
        for rank, frame in enumerate(frames):
            sender.send_frame(rank, record.step, frame)
        metrics.log(record.step, {**record.metrics, "resume/replayed": 1})
        traces.write(record.traces)
    log(f"resumed at checkpoint step {step}: re-sent {len(plan.replay)} recorded batches, sampling from step {plan.next_step}")
    return plan.next_step, step, plan.cursor


def run_secrets(cfg: OrchestratorConfig) -> list[dict]:
    """What a trace must not show: the settings' secret-named values (``keys.scrub`` finds them)
    and the keys the run reads from its environment."""
    return [cfg.model_dump(mode="json"), env_secrets(API_KEY_ENV, cfg.teacher and cfg.teacher.api_key_env)]


def log(msg: str) -> None:
    print(f"[orchestrator] {msg}", flush=True)


# --------------------------------------------------------------------------- entry point


def setup(argv: list[str]) -> tuple[OrchestratorConfig, list[tuple[str, Environment]], object]:
    """Config, environments (by metric name) and tokenizer; raises ConfigError for anything
    the user must fix first (including a chat template multi-turn rollouts cannot use)."""
    cfg = process_config(OrchestratorConfig, argv)
    tokenizer_loaded = start_loading_tokenizer(cfg.tokenizer or cfg.model)
    envs = load_envs(cfg.env, cfg.output_dir, cfg.tokenizer or cfg.model)
    try:
        for (_, env), env_cfg in zip(envs, cfg.env):
            if not env.dataset:
                raise ConfigError(f"environment {env_cfg.id!r} has no training examples (only an eval split)")
        check_tool_parser([(env_cfg.id, env) for (_, env), env_cfg in zip(envs, cfg.env)], cfg.tool_call_parser, SET_PARSER)
        tokenizer = tokenizer_loaded()
        if cfg.multi_turn == "sequence" and any(env.max_turns != 1 and not getattr(env, "renders_prompts", False)
                                                for _, env in envs):
            try:
                check_multi_turn_template(tokenizer, cfg.tokenizer or cfg.model)
            except TemplateError as e:
                raise ConfigError(str(e)) from None
    except ConfigError:
        close_envs(envs)
        raise
    return cfg, envs, tokenizer


def load_envs(entries: list[EnvConfig], run_dir: Path, tokenizer: str | None = None) -> list[tuple[str, Environment]]:
    """Every entry's environment (by metric name); the ones already started are closed again
    when a later one fails."""
    envs: list[tuple[str, Environment]] = []
    try:
        for env_cfg in entries:
            envs.append((env_cfg.metric_name, load_env(env_cfg, run_dir, tokenizer)))
    except ValueError as e:
        close_envs(envs)
        raise ConfigError(str(e)) from None
    return envs


def close_envs(envs: list[tuple[str, Environment]]) -> None:
    for _, env in envs:
        env.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print("python -m orchestrator.main [--config] CONFIG.{json,toml} [--flags]\n")
        print("\n".join(help_text(OrchestratorConfig)))
        return 0
    # a strict preflight that fails is the user's to fix, like a config error: exit 2
    return run_entry("orchestrator", lambda: orchestrate(argv), (ResumeError, TemplateError, TeacherError),
                     usage_errors=(PreflightFailed,))


def orchestrate(argv: list[str]) -> None:
    cfg, envs, tokenizer = setup(argv)
    take_back_cores("orchestrator")  # started on one core while vLLM started (deployment.cpu_vllm_first)
    try:
        asyncio.run(run(cfg, envs, tokenizer))
    finally:
        close_envs(envs)


if __name__ == "__main__":
    exit_process(main())
