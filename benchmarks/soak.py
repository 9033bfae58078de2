"""Long runs stay flat (issue 38): each process's memory, open files and threads over a long run.

    uv run --group bench python -m benchmarks.soak [--run quickstart|wiki-search] [--steps N] [--write]
    uv run --group bench python -m benchmarks.soak [--run ...] --reanalyze   (the stored samples again)

Runs the quickstart (`configs/reverse-text/rl.toml` on its model, 1,000 steps), or the
multi-turn tool environment wiki-search (`configs/wiki-search/rl.toml`, 300 steps at a batch
of 16, on the tiny model after a 300-step tool-use warm-up: it opens with a `search_pages`
call, so episodes run several turns of tool calls), headless, with the config's own
checkpoint, weight and evaluation settings, for ``--steps`` steps and samples, every ``INTERVAL_S
seconds, each process of the run's tree by role (``benchmarks.profile.role``: trainer,
orchestrator, vLLM's API server, engine core and worker; others as `other`): resident memory
(RSS), open file descriptors and threads, with the step the orchestrator last logged. Then,
per role:

- RSS, open files and threads at steps 100, 500 and the last one (the nearest sample);
- the RSS slope in MB per 100 steps, a least-squares line over the second half of the run
  (after warm-up: allocators and caches fill early), and its share of the role's RSS;
- whether anything the run made is left behind: new entries in the system's temporary folder
  after the run, and the step folders of `rollouts/`, `weights/` and `checkpoints/` against
  their `keep_last`.

``--write`` stores `benchmarks/results/soak.json` (`soak-wiki-search.json`) and regenerates RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from prime_rl.config import CheckpointConfig, TrainerConfig
from prime_rl.launch.launcher import die_with_parent
from prime_rl.rundir import checkpoints_dir, metrics_path, rollouts_dir, step_dirs, weights_dir

from benchmarks.profile import role
from benchmarks.run import QUICKSTART, REPO, RESULTS, WORK, Recipe, free_port, prepare_model, write_part, write_results_md

INTERVAL_S = 5.0
MILESTONES = (100, 500)


@dataclass(frozen=True)
class Soak:
    config: str
    recipe: Recipe
    steps: int
    flags: tuple[str, ...] = ()
    """prime-rl flags over the config's."""


WIKI_ARGS = '{"source": "generated", "max_turns": 6}'  # configs/wiki-search/rl.toml's [[env]] args
SOAKS = {
    "quickstart": Soak(QUICKSTART.config, QUICKSTART.full.recipe, 1000),
    # the full warm-up (1,000 steps, ~19 min) answers well; 300 steps teach the tool calls, which is
    # what a soak needs: multi-turn episodes with tools. A batch of 16 (two groups of 8) keeps
    # 300 steps within ~30 min on two cores
    "wiki-search": Soak("configs/wiki-search/rl.toml", Recipe(
        data_args=("--env", "wiki-search", "--num-examples", "2000", "--args", WIKI_ARGS),
        sft_config="configs/wiki-search/sft.toml", sft_flags=("--max-steps", "300")), 300, ("--batch-size", "16")),
}


@dataclass
class Sampler:
    """(seconds since start, step, {role: (rss MB, open files, threads)}) of a process tree."""

    pid: int
    run_dir: Path
    samples: list[tuple[float, int | None, dict[str, tuple[float, int, int]]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    interval_s: float = INTERVAL_S

    def run(self) -> None:
        root, t0 = psutil.Process(self.pid), time.time()
        while not self.stop.wait(self.interval_s):
            by_role: dict[str, list[float]] = {}
            try:
                procs = root.children(recursive=True)
            except psutil.Error:
                return
            for proc in procs:
                try:
                    rss, fds, threads = proc.memory_info().rss / 2**20, proc.num_fds(), proc.num_threads()
                except psutil.Error:
                    continue
                totals = by_role.setdefault(role(proc) or "other", [0.0, 0, 0])
                totals[0] += rss
                totals[1] += fds
                totals[2] += threads
            self.samples.append((time.time() - t0, last_step(self.run_dir), {k: tuple(v) for k, v in by_role.items()}))


def last_step(run_dir: Path) -> int | None:
    """The newest step the orchestrator logged (its metrics rows)."""
    try:
        lines = metrics_path(run_dir).read_bytes().splitlines()[-40:]
    except OSError:
        return None
    steps = [row["step"] for row in map(json.loads, filter(None, lines)) if row.get("process") == "orchestrator"
             and isinstance(row.get("step"), int)] if lines else []
    return max(steps, default=None)


def slope_per_100(steps: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``values`` against ``steps``, per 100 steps, and the standard
    deviation of the values about that line (the noise the slope is read against)."""
    if len(steps) < 3 or len(set(steps)) < 2:
        return 0.0, 0.0
    x, y = np.asarray(steps, float), np.asarray(values, float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope * 100), float(np.std(y - (slope * x + intercept)))


def figures(samples, steps: int) -> dict[str, dict[str, float]]:
    """Per role: RSS / files / threads at the milestones and the end, and the RSS slope over
    the second half."""
    stepped = [(s, r) for _, s, r in samples if s is not None]
    out: dict[str, dict[str, float]] = {}
    for name in sorted({k for _, r in stepped for k in r}):
        mine = [(s, r[name]) for s, r in stepped if name in r]
        row: dict[str, float] = {}
        for at in [*[m for m in MILESTONES if m < steps], mine[-1][0]]:
            _, (rss, fds, threads) = min(mine, key=lambda p: abs(p[0] - at))
            label = "end" if at == mine[-1][0] else str(at)
            row.update({f"rss_mb@{label}": rss, f"fds@{label}": fds, f"threads@{label}": threads})
        late = [(s, v[0]) for s, v in mine if s >= steps // 2]
        row["rss_slope_mb_per_100_steps"], row["rss_noise_mb"] = slope_per_100([s for s, _ in late], [v for _, v in late])
        # against the role's largest RSS: a process exiting with the run reads 0 at the end
        row["rss_slope_share"] = row["rss_slope_mb_per_100_steps"] / max(max(v[0] for _, v in mine), 1e-9)
        out[name] = row
    return out


def left_behind(run_dir: Path, tmp_before: set[str], keep: dict[str, int]) -> dict[str, object]:
    """New entries of the temporary folder, and each step folder's count against its keep_last."""
    tmp = Path(tempfile.gettempdir())
    new = sorted(p.name for p in tmp.iterdir() if p.name not in tmp_before)
    return {"new_in_tmp": new,
            **{f"{name}_kept": len(step_dirs(folder)) for name, folder in
               (("rollouts", rollouts_dir(run_dir)), ("weights", weights_dir(run_dir)), ("checkpoints", checkpoints_dir(run_dir)))},
            **{f"{name}_keep_last": n for name, n in keep.items()}}


def markdown(result: dict, what: str = "the quickstart") -> list[str]:
    lines = [f"Soak (`benchmarks/soak.py`): {what} for {result['steps']} steps, each process's resident "
             f"memory (MB), open files and threads sampled every {INTERVAL_S:g} s; the RSS slope is a least-squares "
             "line over the second half of the run, σ the standard deviation of the samples about it.", "",
             "| process | RSS @100 | RSS @500 | RSS at the end | slope (MB / 100 steps) | slope / RSS | σ (MB) | files @100 / end | threads @100 / end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["processes"].items():
        get = lambda key: row.get(key)  # noqa: E731
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        lines.append(f"| {name} | {fmt(get('rss_mb@100'))} | {fmt(get('rss_mb@500'))} | {fmt(get('rss_mb@end'))} | "
                     f"{row['rss_slope_mb_per_100_steps']:+.2f} | {row['rss_slope_share']:+.2%} | {row.get('rss_noise_mb', 0):.1f} | "
                     f"{fmt(get('fds@100'))} / {fmt(get('fds@end'))} | {fmt(get('threads@100'))} / {fmt(get('threads@end'))} |")
    left = result["left_behind"]
    lines += ["", f"Left behind: {len(left['new_in_tmp'])} new entries in the temporary folder "
              f"({', '.join(left['new_in_tmp'][:5]) or 'none'}); rollouts/ {left['rollouts_kept']} step folders, "
              f"weights/ {left['weights_kept']} (keep_last {left['weights_keep_last']}), checkpoints/ "
              f"{left['checkpoints_kept']} (keep_last {left['checkpoints_keep_last']}). Wall time {result['wall_s']:.0f} s."]
    return lines


def soak(config: str | Path, model: Path, out: Path, steps: int, flags: tuple[str, ...] = (),
         interval_s: float = INTERVAL_S) -> dict:
    """Run ``config`` on ``model`` for ``steps`` steps headless in ``out``, sampling its
    processes every ``interval_s``; the figures, what was left behind and the samples."""
    with open(REPO / config, "rb") as f:
        shipped = tomllib.load(f)
    keep = {"checkpoints": shipped.get("ckpt", {}).get("keep_last", CheckpointConfig().keep_last),
            "weights": shipped.get("trainer", {}).get("weights", {}).get("keep_last", TrainerConfig().weights.keep_last)}
    tmp_before = {p.name for p in Path(tempfile.gettempdir()).iterdir()}
    cmd = [sys.executable, "-m", "prime_rl.cli", str(config), "--model", str(model), "--output-dir", str(out),
           "--max-steps", str(steps), "--clean", "--no-tmux", "--quiet", "--inference.port", str(free_port()),
           "--transport.port", str(free_port()), *flags]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
    sampler = Sampler(proc.pid, out, interval_s=interval_s)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    finally:
        sampler.stop.set()
        thread.join()
    time.sleep(2)  # the launcher has stopped its children; give the OS a moment to reap them
    return {"steps": steps, "wall_s": time.time() - started, "processes": figures(sampler.samples, steps),
            "left_behind": left_behind(out, tmp_before, keep),
            "samples": [[round(t, 1), s, {k: [round(v[0], 1), v[1], v[2]] for k, v in r.items()}] for t, s, r in sampler.samples]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=sorted(SOAKS), default="quickstart")
    parser.add_argument("--steps", type=int, help="default: 1,000 for the quickstart, 300 for wiki-search")
    parser.add_argument("--write", action="store_true", help="store results/soak*.json and regenerate RESULTS.md")
    parser.add_argument("--reanalyze", action="store_true",
                        help="recompute the stored run's figures from its samples (no run), keeping its date")
    args = parser.parse_args(argv)
    spec = SOAKS[args.run]
    part = "soak" if args.run == "quickstart" else f"soak-{args.run}"
    what = "the quickstart" if args.run == "quickstart" else f"`{spec.config}` ({' '.join(spec.flags)})"
    if args.reanalyze:
        stored = json.loads((RESULTS / f"{part}.json").read_text())
        result = stored[part]
        result["processes"] = figures(result["samples"], result["steps"])
        stored["lines"] = markdown(result, what)
        (RESULTS / f"{part}.json").write_text(json.dumps(stored, indent=1))
        print("\n".join(stored["lines"]))
        print(f"wrote {write_results_md(RESULTS)}")
        return 0
    steps = args.steps or spec.steps
    result = soak(spec.config, prepare_model(spec.recipe), WORK / part, steps, spec.flags)
    lines = markdown(result, what)
    if args.write:
        write_part(RESULTS, part, f"{steps} steps, one run", lines, result)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
