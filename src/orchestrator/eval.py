"""Eval process: a model's scores on the eval splits of environments (`prime-rl eval`).

    python -m orchestrator.eval --config OUTPUT_DIR/runs/<run>/configs/eval.json

`prime-rl eval` resolves the model first (``EvalTarget``): an endpoint of the endpoints file,
or a local model it serves with its own vLLM server. Then, top to bottom:
  (a) load the environments and, for a local model, its tokenizer;
  (b) the sampler: exact tokens through the local vLLM server (``TokenSampler``, as RL
      samples), or text through the endpoint's chat completions API (``ChatSampler``);
  (c) the first ``num_examples`` of each eval split, ``rollouts_per_example`` rollouts of
      each, every environment at once, with a progress bar counting rollouts;
  (d) one table per environment: mean reward (± std), metric means, pass@k when rewards are 0/1;
  (e) with ``save_results``: ``results.jsonl`` (a row per rollout) and ``summary.json`` per
      environment in OUTPUT_DIR/<env>--<model>/<run>/;
  (f) every rollout traced (kind `eval`, step 0) in OUTPUT_DIR/runs/<run>/traces/, for
      `prime-rl dashboard OUTPUT_DIR/runs/<run>`.
Exit codes: 0, 2 for a config error (e.g. an environment's args), 1 for a runtime failure
(e.g. an endpoint still unreachable after the retries), one line saying why.
This module knows nothing of training: no steps, no advantages, no trainer.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prime_rl.config import EvalEnvConfig, EvalRunConfig
from prime_rl.config.orchestrator import TracesConfig
from prime_rl.envs import Environment, Example, ModelClient, Rollout
from prime_rl.keys import redact
from prime_rl.registry import PASS_PARSER
from prime_rl.rundir import log_path, write_failed, write_json_atomic
from prime_rl.settings import ConfigError, exit_process, help_text, process_config
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from orchestrator.entry import check_tool_parser, make_client, make_sampler, progress_bar, run_entry, start_loading_tokenizer
from orchestrator.envs import load_env
from orchestrator.rollouts import run_groups, summarize
from orchestrator.traces import TraceWriter, env_secrets


@dataclass
class EnvResult:
    entry: EvalEnvConfig
    examples: list[Example]
    rollouts_per_example: int
    groups: list[list[Rollout]]
    """``rollouts_per_example`` rollouts of each example, in example order."""

    time_s: float

    @property
    def name(self) -> str:
        return self.entry.metric_name

    def figures(self) -> dict[str, float]:
        """``summarize``'s figures plus the share of replies cut by max_tokens."""
        rollouts = [r for group in self.groups for r in group]
        if not rollouts:
            return {}
        return {**summarize(self.groups), "truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts]))}


# --------------------------------------------------------------------------- (a) setup


def setup(argv: list[str]) -> tuple[EvalRunConfig, list[tuple[EvalEnvConfig, Environment]], object | None]:
    """Config, environments and (local model) tokenizer; ConfigError for what the user must fix."""
    cfg = process_config(EvalRunConfig, argv)
    if cfg.target is None or cfg.run_id is None:
        raise ConfigError("the config has no `target` / `run_id`: start evaluations with `prime-rl eval`, which resolves the model")
    local = cfg.target.type == "local"
    envs: list[tuple[EvalEnvConfig, Environment]] = []
    tokenizer_loaded = start_loading_tokenizer(cfg.inference.model if local else None)
    try:
        for entry in cfg.eval:
            envs.append((entry, load_env(entry.env_config(), cfg.inference.output_dir, cfg.inference.model if local else None)))
        tokenizer = tokenizer_loaded()
        if local:  # an endpoint's API parses its own tool calls
            check_tool_parser([(entry.id, env) for entry, env in envs], cfg.inference.tool_call_parser, PASS_PARSER)
    except (ValueError, ConfigError) as e:
        for _, env in envs:
            env.close()
        raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from None
    return cfg, envs, tokenizer


# --------------------------------------------------------------------------- (c) rollouts


async def run(
    cfg: EvalRunConfig, envs: list[tuple[EvalEnvConfig, Environment]], tokenizer, progress: Progress
) -> list[EnvResult]:
    client = make_client(cfg.client, cfg.target)
    try:
        if cfg.target.type == "local":
            log(f"waiting for the vLLM server at {client.base_url} (its log: {log_path(cfg.inference.output_dir, 'inference')})")
            await client.wait_healthy(cfg.client.startup_timeout_s)
        sampler = make_sampler(cfg, client, tokenizer)  # (b)
        # Every environment at once: the client caps the requests in flight.
        async with asyncio.TaskGroup() as tasks:
            futures = [tasks.create_task(evaluate_env(entry, env, sampler, cfg, progress)) for entry, env in envs]
        return [f.result() for f in futures]
    finally:
        await client.close()


async def evaluate_env(
    entry: EvalEnvConfig, env: Environment, sampler: ModelClient, cfg: EvalRunConfig, progress: Progress
) -> EnvResult:
    examples = env.eval_examples(cfg.num_examples if entry.num_examples is None else entry.num_examples)
    n = entry.rollouts_per_example or cfg.rollouts_per_example
    bar = progress.add_task(entry.metric_name, total=len(examples) * n)
    start = time.perf_counter()
    groups = await run_groups(env, sampler, examples, n, on_group=lambda group: progress.advance(bar, len(group)))
    return EnvResult(entry, examples, n, groups, time.perf_counter() - start)


# --------------------------------------------------------------------------- (d) tables


def result_table(result: EnvResult, model: str) -> Table:
    figures = result.figures()
    table = Table(title=f"{result.name} · {model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("rollouts", f"{len(result.examples)} examples x {result.rollouts_per_example}")
    if not figures:
        return table
    table.add_row("reward", f"{figures['reward/mean']:.3f} ± {figures['reward/std']:.3f}")
    for key, value in figures.items():
        if key.startswith("metrics/"):
            table.add_row(key.removeprefix("metrics/"), f"{value:.3f}")
    for key, value in figures.items():
        if key.startswith("pass@"):
            table.add_row(key, f"{value:.3f}")
    for key, value in figures.items():
        if key.startswith("errors/"):
            table.add_row(f"errors: {key.removeprefix('errors/')}", f"{int(value)} rollouts")
    table.add_row("truncated (max_tokens)", f"{figures['truncated_frac']:.0%}")
    table.add_row("time", f"{result.time_s:.1f} s")
    return table


# --------------------------------------------------------------------------- (e) results


def results_dir(cfg: EvalRunConfig, result: EnvResult) -> Path:
    """OUTPUT_DIR/<env>--<model>/<run>/ (the model name's slashes become `--`)."""
    model = cfg.target.model.strip("/").replace("/", "--")
    return cfg.output_dir / f"{result.name}--{model}" / cfg.run_id


def result_rows(result: EnvResult) -> Iterator[dict]:
    for example, group in zip(result.examples, result.groups, strict=True):
        for index, rollout in enumerate(group):
            yield {
                "example_id": example.id,
                "rollout": index,
                "prompt": rollout.prompt,
                "completion": rollout.completion,
                "answer": example.answer,
                "reward": rollout.reward,
                "metrics": rollout.metrics,
                "errors": list(rollout.errors),
                "stop_condition": rollout.stop_condition,
                "finish_reason": rollout.finish_reason,
                "turns": rollout.num_turns,
            }


def save_results(cfg: EvalRunConfig, result: EnvResult, started: float) -> Path:
    """results.jsonl, then summary.json last (written whole or not at all): a folder with a
    summary is complete."""
    folder = results_dir(cfg, result)
    try:
        folder.mkdir(parents=True, exist_ok=False)
        tmp = folder / "results.jsonl.tmp"
        with open(tmp, "w") as f:
            for row in result_rows(result):
                f.write(json.dumps(row, default=str) + "\n")
        os.replace(tmp, folder / "results.jsonl")
        # the env's args and the endpoint's URL are the user's: redacted, and only theirs to read
        write_json_atomic(folder / "summary.json", redact(summary(cfg, result, started)), private=True)
    except OSError as e:
        raise write_failed("eval results", folder, e) from e
    return folder


def summary(cfg: EvalRunConfig, result: EnvResult, started: float) -> dict:
    return {
        "env": {"id": result.entry.id, "name": result.name, "args": result.entry.args},
        "model": cfg.target.model,
        "endpoint_id": cfg.target.endpoint_id,
        "type": cfg.target.type,
        "base_url": cfg.client.base_url,
        "num_examples": len(result.examples),
        "rollouts_per_example": result.rollouts_per_example,
        "sampling": cfg.sampling.model_dump(mode="json"),
        "run_id": cfg.run_id,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "time_s": result.time_s,
        **result.figures(),
    }


def write_traces(cfg: EvalRunConfig, results: list[EnvResult], tokenizer) -> None:
    """(f) every rollout as a trace row (``orchestrator.traces``) in the run's folder (none
    without a run id: a config not started by `prime-rl eval`)."""
    if cfg.run_id is None:
        return
    run_dir = cfg.output_dir / "runs" / cfg.run_id
    writer = TraceWriter(run_dir, TracesConfig(groups="all"), tokenizer, cfg.inference.seq_len,
                         secrets=[cfg.model_dump(mode="json"), env_secrets(cfg.target.api_key_var)])
    try:
        for result in results:
            writer.write(writer.lines(writer.group_rows("eval", 0, result.name, result.groups, tag=result.name)))
    except OSError as e:
        raise write_failed("eval traces", writer.path, e) from e
    log(f"traces of every rollout in {writer.path} (prime-rl dashboard {run_dir})")


# --------------------------------------------------------------------------- entry point


def log(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print("python -m orchestrator.eval [--config] CONFIG.{json,toml} [--flags]   (started by `prime-rl eval`)\n")
        print("\n".join(help_text(EvalRunConfig)))
        return 0
    return run_entry("eval", lambda: evaluate(argv), sigterm_interrupts=True)


def evaluate(argv: list[str]) -> None:
    cfg, envs, tokenizer = setup(argv)
    console = Console()
    where = f"endpoint {cfg.target.endpoint_id!r} at" if cfg.target.type == "endpoint" else "local vLLM server at"
    log(f"model {cfg.target.model!r} ({where} {cfg.client.base_url}); environments: {', '.join(e.metric_name for e, _ in envs)}")
    started = time.time()
    try:
        with progress_bar(console) as progress:
            results = asyncio.run(run(cfg, envs, tokenizer, progress))
        for result in results:
            console.print(result_table(result, cfg.target.model))
        if cfg.save_results:
            for result in results:
                # print, not rich: a path must not be wrapped at the console's width
                print(f"[eval] {result.name}: results in {save_results(cfg, result, started)}/", flush=True)
        write_traces(cfg, results, tokenizer)
    finally:
        for _, env in envs:
            env.close()


if __name__ == "__main__":
    exit_process(main())
