"""GEPA process: optimize an environment's system prompt (`prime-rl gepa`).

    python -m orchestrator.gepa --config OUTPUT_DIR/runs/<run>/configs/gepa.json

The search is the maintained ``gepa`` package's; ``orchestrator.gepa_adapter`` runs the
environment's rollouts for it. Top to bottom:
  (a) the environment, its own system prompt (the seed candidate), the first `num_train`
      training and `num_val` validation examples;
  (b) the rollout sampler (exact tokens through the local vLLM server, or text through an
      endpoint, as `prime-rl eval` samples) and the teacher (a chat model of an endpoint);
      both must answer before any work starts;
  (c) gepa.optimize under the budget, with a progress bar of the rollouts spent and the
      best validation score so far;
  (d) OUTPUT_DIR/<env>/<run>/: best_prompt.txt, pareto_frontier.jsonl (per validation
      example, its best score and the prompt that reached it) and metadata.json (settings,
      budget used, seed, validation scores before and after). An interrupted run writes
      the same from the search's last state and says so.
GEPA's own log (iterations, proposals, tracebacks of failed proposals) goes to
OUTPUT_DIR/runs/<run>/logs/search.log. Exit codes: 0, 2 for a config error, 1 for a
runtime failure, 130 when interrupted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gepa
import httpx
import numpy as np
from gepa.core.result import GEPAResult
from prime_rl.config import ClientConfig, EvalTarget, GepaRunConfig
from prime_rl.config.orchestrator import TracesConfig
from prime_rl.envs import Environment, Example
from prime_rl.keys import private_opener, redact
from prime_rl.rundir import write_failed, write_json_atomic
from prime_rl.settings import ConfigError, exit_process, help_text, one_line, process_config
from rich.console import Console
from rich.progress import Progress

from orchestrator.client import ChatClient, InferenceError
from orchestrator.entry import (
    EXPECTED_ERRORS, load_tokenizer, make_chat_client, make_client, make_sampler, progress_bar, run_entry, with_api_key,
)
from orchestrator.envs import load_env
from orchestrator.gepa_adapter import COMPONENT, EnvironmentAdapter, NoSystemPrompt, seed_prompt
from orchestrator.traces import TraceWriter, env_secrets


def log(msg: str) -> None:
    print(f"[gepa] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- (a) data


@dataclass
class Task:
    name: str
    env: Environment
    seed: str
    train: list[Example]
    val: list[Example]


def setup(argv: list[str]) -> tuple[GepaRunConfig, Task]:
    cfg = process_config(GepaRunConfig, argv)
    if cfg.target is None or cfg.reflection_target is None or cfg.run_id is None:
        raise ConfigError("the config has no `target` / `reflection_target` / `run_id`: start it with `prime-rl gepa`")
    entry = cfg.env[0]
    env = None
    try:
        env = load_env(entry, cfg.inference.output_dir, cfg.inference.model if cfg.target.type == "local" else None)
        seed = seed_prompt(env, entry.id)
    except (ValueError, NoSystemPrompt) as e:
        if env is not None:
            env.close()
        raise ConfigError(str(e)) from None
    train, val = list(env.dataset[: cfg.gepa.num_train]), env.eval_examples(cfg.gepa.num_val)
    if len(val) < cfg.gepa.num_val:
        log(f"{entry.metric_name} has {len(val)} validation examples, fewer than gepa.num_val = {cfg.gepa.num_val}")
    return cfg, Task(entry.metric_name, env, seed, train, val)


# --------------------------------------------------------------------------- (b) the two models


class Teacher:
    """GEPA's reflection LM: one chat completion of the teacher model per proposal, through the
    client every model call goes through (its retries, and a local server's key only once it
    proved it holds it). GEPA calls it synchronously, between the adapter's rollouts, so it
    runs on the adapter's event loop."""

    def __init__(self, client: ChatClient, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.loop = loop
        self.failures = 0

    def __call__(self, prompt: str) -> str:
        try:
            return self._complete(prompt)
        except InferenceError as e:
            # GEPA skips the proposal and goes on; say it once here, the rest goes to the search log
            self.failures += 1
            if self.failures == 1:
                log(f"the teacher failed to propose a prompt ({one_line(e)}); the search goes on, see its log")
            raise

    def _complete(self, prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        ((text, _, _),) = self.loop.run_until_complete(self.client.chat_text_n(messages, n=1, max_tokens=None, temperature=None))
        return text


class SearchLog:
    """GEPA's own log (iterations, scores, proposals, the tracebacks of failed ones) goes to
    a file, so the terminal shows the progress bar and one line per problem."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", opener=private_opener)  # proposals may quote the env's data

    def log(self, message: str) -> None:
        self.file.write(f"{message}\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def bearer(client_cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {client_cfg.api_key}"} if client_cfg.api_key else {}


def check_reachable(client_cfg: ClientConfig, target: EvalTarget, role: str) -> None:
    """One line before any work when an endpoint does not answer at all (any HTTP status
    counts as reachable: OpenAI-style APIs need not serve the path asked). A local vLLM
    server is still starting then: the run waits for it instead."""
    if target.type != "endpoint":
        return
    url = client_cfg.urls[0]
    try:
        httpx.get(url + "/models", headers=bearer(with_api_key(client_cfg, target)), timeout=10)
    except httpx.TransportError as e:
        raise ConfigError(f"the {role} model's endpoint {url} is unreachable ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- (c) the search


class BudgetBar:
    """A GEPA stop callback that never stops the search: it moves the progress bar (rollouts
    spent of the budget, the best validation score so far) and keeps the latest state, from
    which an interrupted run writes its results (a finished one writes GEPA's result)."""

    def __init__(self, progress: Progress, budget: int):
        self.progress = progress
        self.budget = budget
        self.bar = progress.add_task("best val -", total=budget)
        self.state = None

    def __call__(self, state) -> bool:
        self.state = state
        best = max(aggregate_scores(state.prog_candidate_val_subscores), default=float("nan"))
        self.progress.update(self.bar, completed=min(state.total_num_evals, self.budget), description=f"best val {best:.3f}")
        return False


def aggregate_scores(subscores: list[dict[Any, float]]) -> list[float]:
    """Each candidate's mean validation score."""
    return [float(np.mean(list(scores.values()))) if scores else float("nan") for scores in subscores]


def search(
    cfg: GepaRunConfig, task: Task, adapter: EnvironmentAdapter, teacher: Teacher, bar: BudgetBar, search_log: SearchLog
) -> GEPAResult:
    g = cfg.gepa
    return gepa.optimize(
        seed_candidate={COMPONENT: task.seed},
        trainset=task.train,
        valset=task.val,
        adapter=adapter,
        reflection_lm=teacher,
        max_metric_calls=g.max_calls,
        reflection_minibatch_size=g.minibatch_size,
        skip_perfect_score=g.perfect_score is not None,
        perfect_score=1.0 if g.perfect_score is None else g.perfect_score,
        seed=g.seed,
        stop_callbacks=[bar],
        logger=search_log,
    )


# --------------------------------------------------------------------------- (d) outputs


def results_dir(cfg: GepaRunConfig, task: Task) -> Path:
    return cfg.output_dir / task.name / cfg.run_id


def write_outputs(cfg: GepaRunConfig, task: Task, result: GEPAResult, rollouts: int, started: float, interrupted: bool) -> Path:
    """best_prompt.txt, pareto_frontier.jsonl, then metadata.json last (a folder with it is complete)."""
    folder = results_dir(cfg, task)
    candidates = [c[COMPONENT] for c in result.candidates]
    scores = aggregate_scores(result.val_subscores)
    best = int(np.nanargmax(scores))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "best_prompt.txt").write_text(candidates[best] + "\n")
        with open(folder / "pareto_frontier.jsonl", "w") as f:
            for val_id, holders in sorted(result.per_val_instance_best_candidates.items()):
                holders = sorted(holders)
                score = result.val_subscores[holders[0]][val_id]
                row = {"example_id": task.val[val_id].id, "score": score, "candidates": holders, "prompt": candidates[holders[0]]}
                f.write(json_line(row))
        # the env's args are the user's: redacted, and only theirs to read
        write_json_atomic(folder / "metadata.json", redact({
            "env": {"id": cfg.env[0].id, "name": task.name, "args": cfg.env[0].args},
            "model": cfg.target.model,
            "reflection_model": cfg.reflection_target.model,
            "settings": cfg.gepa.model_dump(mode="json"),
            "sampling": cfg.sampling.model_dump(mode="json"),
            "seed": cfg.gepa.seed,
            "budget": {"max_calls": cfg.gepa.max_calls, "used": rollouts},
            "num_train": len(task.train),
            "num_val": len(task.val),
            "num_candidates": len(candidates),
            "val_score": {"seed": scores[0], "best": scores[best]},
            "best_candidate": best,
            "val_scores": scores,
            "interrupted": interrupted,
            "run_id": cfg.run_id,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "time_s": time.time() - started,
        }), private=True)
    except OSError as e:
        raise write_failed("GEPA results", folder, e) from e
    return folder


def json_line(row: dict) -> str:
    return json.dumps(row) + "\n"


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print("python -m orchestrator.gepa [--config] CONFIG.{json,toml} [--flags]   (started by `prime-rl gepa`)\n")
        print("\n".join(help_text(GepaRunConfig)))
        return 0
    return run_entry("gepa", lambda: setup_and_optimize(argv), sigterm_interrupts=True)


def setup_and_optimize(argv: list[str]) -> int:
    cfg, task = setup(argv)
    try:
        return optimize(cfg, task)
    finally:
        task.env.close()


def optimize(cfg: GepaRunConfig, task: Task) -> int:
    check_reachable(cfg.client, cfg.target, "rollout")
    check_reachable(cfg.reflection_client, cfg.reflection_target, "reflection")
    tokenizer = load_tokenizer(cfg.inference.model) if cfg.target.type == "local" else None
    client = make_client(cfg.client, cfg.target)
    run_dir = cfg.output_dir / "runs" / cfg.run_id
    traces = TraceWriter(run_dir, TracesConfig(groups="all"), tokenizer, cfg.inference.seq_len, secrets=[
        cfg.model_dump(mode="json"), env_secrets(cfg.target.api_key_var, cfg.reflection_target.api_key_var)])
    adapter = EnvironmentAdapter(task.env, make_sampler(cfg, client, tokenizer), cfg.gepa.state_columns, traces, task.name)
    log(f"{task.name}: seed prompt {task.seed!r}; {len(task.train)} training, {len(task.val)} validation examples; "
        f"budget {cfg.gepa.max_calls} rollouts; model {cfg.target.model!r}, teacher {cfg.reflection_target.model!r}")
    started, interrupted, code, result = time.time(), False, 0, None
    bar = BudgetBar(progress_bar(Console(stderr=True)), cfg.gepa.max_calls)
    search_log = SearchLog(run_dir / "logs" / "search.log")
    log(f"the search's own log: {search_log.path}")
    teacher_client = make_chat_client(cfg.reflection_client, cfg.reflection_target)
    teacher = Teacher(teacher_client, adapter.loop)
    try:
        if cfg.target.type == "local":
            adapter.loop.run_until_complete(client.wait_healthy(cfg.client.startup_timeout_s))
        with bar.progress:
            result = search(cfg, task, adapter, teacher, bar, search_log)
    except KeyboardInterrupt:
        interrupted, code = True, 130
    except EXPECTED_ERRORS as e:  # the results so far are still written below
        log(f"error: {one_line(e)}")
        code = 1
    finally:
        adapter.loop.run_until_complete(client.close())
        adapter.loop.run_until_complete(teacher_client.close())
        adapter.close()
        search_log.close()
    if teacher.failures:
        log(f"the teacher failed {teacher.failures} time(s): those proposals were skipped (details in {search_log.path})")
    if result is None and bar.state is not None:  # interrupted or failed mid-search: what it had so far
        result = GEPAResult.from_state(bar.state)
    if result is None:
        log("interrupted before the seed prompt was scored: nothing saved" if interrupted else "no result to save")
        return code
    folder = write_outputs(cfg, task, result, adapter.metric_calls, started, interrupted)
    if interrupted:
        log(f"interrupted after {adapter.metric_calls} rollouts: the best prompt so far and the frontier are saved")
    print(f"[gepa] results in {folder}/", flush=True)
    return code


if __name__ == "__main__":
    exit_process(main())
