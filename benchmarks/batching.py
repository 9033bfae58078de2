"""Continuous batching against the step barrier, side by side in one invocation.

    uv run --group bench python -m benchmarks.batching [--quick] [--repeats N] [--only quickstart,multi-turn]

The same prime-rl config, model and async bound, once with `orchestrator.batching =
"continuous"` (groups in flight across step boundaries, in-flight weight updates) and once
with `"step"` (every step samples its own groups, reloads between steps), alternating so
that drift in the machine's speed hits both alike. Regimes:

- `quickstart`: `configs/reverse-text/rl.toml` on the quickstart's SFT model (single-turn,
  ~7-token completions, 256 a step);
- `multi-turn`: `configs/alphabet-sort/rl.toml` on its SFT warm-up (`scripts/train_env.sh
  alphabet-sort`'s recipe: two turns, up to 96 tokens each, 32 rollouts a step).

- `quickstart-disjoint`, `long-tail-disjoint`: generation and training on cores of their own,
  as on two GPUs (``benchmarks.profile.DISJOINT``: all of vLLM on core 0, the trainer with one
  thread and the orchestrator on core 1): the quickstart, and multi-turn alphabet-sort whose
  episodes vary within a step (`benchmarks/configs/long-tail.toml`: 1-4 turns, replies of
  1-8 names, 64 rollouts a step), on the same SFT warm-up as `multi-turn`.
- `long-tail-disjoint-off-policy-2`: the long tail with `orchestrator.max_off_policy_steps = 2`
  (more groups start than a step needs; a step takes the first to complete, its stragglers
  land in later steps) and `client.inflight_kv = "keep"`; neither changes the step barrier.

Per run, after the first step (start-up): rollouts per second (rollouts trained / seconds
between the trainer's first and last step), the trainer's idle share (its mean
`time/wait_batch` over its mean step), seconds per step, the reward of the first and last 5
steps, groups dropped as too old, the share of rollouts that spanned a reload, the cores
each process kept busy (`cores/<role>`, ``benchmarks.profile``), and reward against
wall-clock time (plotted). Ratios are continuous over step. Writes
`benchmarks/results/batching.json` (a quick run: `outputs/bench/results/`), the PNGs beside
it, and regenerates RESULTS.md (`benchmarks.run.write_results_md`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from benchmarks.profile import DISJOINT, DISJOINT_FLAGS
from benchmarks.run import RESULTS, WORK, Recipe, alternating, cell, machine, plot_rewards, prepare_model, run_prime_rl, spread, write_results_md

ALPHABET_ARGS = ('{"min_turns": 2, "max_turns": 2, "min_names_per_turn": 1, "max_names_per_turn": 2, '
                 '"names_path": "configs/alphabet-sort/names.txt"}')
MODES = ("continuous", "step")




@dataclass(frozen=True)
class Setting:
    name: str
    config: str
    recipe: Recipe
    steps: int
    quick_steps: int
    disjoint: bool = False
    """vLLM and the trainer on cores of their own (``benchmarks.profile.DISJOINT``), as on two GPUs."""
    flags: tuple[str, ...] = ()
    """Flags over the config, for both modes (settings the step barrier does not use)."""


ALPHABET_SORT = Recipe(data_args=("--env", "alphabet-sort", "--num-examples", "4000", "--args", ALPHABET_ARGS),
                       sft_config="configs/alphabet-sort/sft.toml")
SETTINGS = {
    s.name: s
    for s in (
        Setting("quickstart", "configs/reverse-text/rl.toml", Recipe(), steps=60, quick_steps=6),
        Setting("multi-turn", "configs/alphabet-sort/rl.toml", ALPHABET_SORT, steps=30, quick_steps=4),
        Setting("quickstart-disjoint", "configs/reverse-text/rl.toml", Recipe(), steps=60, quick_steps=6,
                disjoint=True),
        Setting("long-tail-disjoint", "benchmarks/configs/long-tail.toml", ALPHABET_SORT, steps=30, quick_steps=4,
                disjoint=True),
        Setting("long-tail-disjoint-off-policy-2", "benchmarks/configs/long-tail.toml", ALPHABET_SORT, steps=30,
                quick_steps=4, disjoint=True,
                flags=("--orchestrator.max-off-policy-steps", "2", "--orchestrator.client.inflight-kv", "keep")),
    )
}


def run_figures(out: Path, t0_curve) -> dict[str, float | None]:
    """The figures of one run from its metrics rows (and the curve ``run_prime_rl`` read)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = sorted((r for r in rows if r["process"] == "trainer"), key=lambda r: r["step"])
    orch = sorted((r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])
    steady_t, steady_o = trainer[1:], orch[1:]
    span = trainer[-1]["wall"] - trainer[0]["wall"] if len(trainer) > 1 else None
    rollouts = sum(r["perf/samples"] for r in steady_t)
    training = sum(r["time/train"] for r in steady_t)
    wait = statistics.fmean(r["time/wait_batch"] for r in steady_t) if steady_t else None
    step = statistics.fmean(r["time/step"] for r in steady_t) if steady_t else None
    rewards = t0_curve.rewards
    return {
        "rollouts_per_s": rollouts / span if span else None,
        # the most any schedule could get: the trainer never waiting for a batch
        "trainer_limit_rollouts_per_s": rollouts / training if training else None,
        "s_per_step": span / (len(trainer) - 1) if span else None,
        "trainer_idle_share": wait / step if wait is not None and step else None,
        "startup_s": t0_curve.times[0] if t0_curve.times else None,
        "reward_first5": statistics.fmean(rewards[:5]) if rewards else None,
        "reward_last5": statistics.fmean(rewards[-5:]) if rewards else None,
        "stale_groups_dropped": sum(r.get("batch/stale_groups_dropped", 0) for r in orch),
        "mixed_frac": statistics.fmean(r.get("staleness/mixed_frac", 0.0) for r in steady_o) if steady_o else None,
        "mismatch_kl_step0": trainer[0]["loss/mismatch_kl"] if trainer else None,
    }


def measure(setting: Setting, steps: int, repeats: int, started: float) -> dict:
    model = prepare_model(setting.recipe)
    print(f"[batching] {setting.name}: model ready ({time.time() - started:.0f} s)", flush=True)

    def one(mode: str, seed: int) -> dict:
        out = WORK / "batching" / setting.name / f"{mode}-{seed}"
        flags = ["--max-steps", str(steps), "--seed", str(seed), "--orchestrator.batching", mode, *setting.flags]
        curve = run_prime_rl(setting.config, model, out, flags + list(DISJOINT_FLAGS if setting.disjoint else ()),
                             pin=DISJOINT if setting.disjoint else None)
        cores = {k: v for k, v in curve.profile.items() if k.startswith("cores/")}  # where the cores went
        run = {"figures": {**run_figures(out, curve), **cores}, "times": curve.times, "rewards": curve.rewards}
        print(f"[batching] {setting.name} {mode} seed {seed}: {run['figures']} ({time.time() - started:.0f} s)", flush=True)
        return run

    runs = alternating(list(MODES), repeats, one)
    served = serving(setting, model) if setting.disjoint else None
    spreads = {mode: {key: spread([r["figures"].get(key) for r in runs[mode]]) for key in runs[mode][0]["figures"]}
               for mode in MODES}
    medians = {mode: {key: s["median"] for key, s in spreads[mode].items()} for mode in MODES}
    ratios = {}
    for key in ("rollouts_per_s", "s_per_step", "trainer_idle_share"):
        a, b = medians["continuous"][key], medians["step"][key]
        ratios[f"{key} continuous/step"] = a / b if a and b else None
    result = {"steps": steps, "repeats": repeats, "date": time.strftime("%Y-%m-%d"), "medians": medians,
              "spreads": spreads, "ratios": ratios, "runs": runs}
    return result | ({"serving": served} if served else {})


SERVING_GROUPS = (1, 2, 4, 8, 16)


def serving(setting: Setting, model: Path) -> list[dict]:
    """vLLM alone on the disjoint regime's inference core (``benchmarks.loadgen``, all its
    processes on core 0): generated tokens/s with 8 to 128 sequences in flight, each as long
    as the regime's replies may be. Shows how much a fuller batch buys on that core."""
    cfg = tomllib.loads(Path(setting.config).read_text())
    rows = []
    for groups in SERVING_GROUPS:
        cmd = ["taskset", "-c", "0", sys.executable, "-m", "benchmarks.loadgen", str(model), "--groups", str(groups),
               "--n", "8", "--max-tokens", str(cfg["sampling"]["max_tokens"]), "--seq-len", str(cfg["seq_len"]),
               "--rounds", "4", "--env", "VLLM_CPU_OMP_THREADS_BIND=0"]
        result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        rows.append({"sequences": groups * 8, "tokens_per_s": result["tokens_per_s"],
                     "tokens_per_s_per_sequence": result["tokens_per_s"] / (groups * 8)})
        print(f"[batching] {setting.name} serving alone: {rows[-1]}", flush=True)
    return rows


def plot(name: str, result: dict, path: Path) -> None:
    series = {mode: [(run["times"], run["rewards"]) for run in result["runs"][mode]] for mode in MODES}
    plot_rewards(series, path, title=f"{name}: continuous batching vs the step barrier")


def section(results: dict) -> list[str]:
    """RESULTS.md's lines for this part."""
    lines = ["Continuous batching (`orchestrator.batching = \"continuous\"`) against the step barrier (`\"step\"`), "
             "same config, model and async bound, alternating (`benchmarks/batching.py`); figures after the first "
             "step, medians over seeds (repeat i runs seed i: data order, trainer, vLLM's sampling).", ""]
    for name, result in results.items():
        keys = list(result["medians"]["continuous"])
        when = result.get("date", "a run before 2026-12-05")
        lines += [f"**{name}** ({result['steps']} steps, {result['repeats']} seed(s), {when})", "",
                  "| figure | continuous | step |", "|---|---|---|"]
        if "spreads" in result:  # median [min, max] over seeds
            lines += [f"| {k} | {cell(result['spreads']['continuous'][k])} | {cell(result['spreads']['step'][k])} |" for k in keys]
        else:
            lines += [f"| {k} | {fmt(result['medians']['continuous'][k])} | {fmt(result['medians']['step'][k])} |" for k in keys]
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in result["ratios"].items()]
        if result.get("serving"):
            lines += ["", "vLLM alone on core 0 (`benchmarks.loadgen`, the regime's reply length):", "",
                      "| sequences in flight | tokens/s | tokens/s per sequence |", "|---|---|---|"]
            lines += [f"| {r['sequences']} | {fmt(r['tokens_per_s'])} | {fmt(r['tokens_per_s_per_sequence'])} |"
                      for r in result["serving"]]
        lines += ["", f"![{name}: reward against wall-clock time](results/batching-{name}.png)", ""]
    return lines


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batching", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="seeds per mode (default 3, quick 1): repeat i runs seed i")
    parser.add_argument("--only", default=",".join(SETTINGS), help=f"comma-separated regimes (default: {', '.join(SETTINGS)})")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in names if n not in SETTINGS]:
        parser.error(f"--only: unknown regime(s) {unknown}; expected some of {list(SETTINGS)}")
    results_dir = WORK / "results" if args.quick else RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    repeats = args.repeats or (1 if args.quick else 3)  # issue 36: 3 seeds a side
    started = time.time()
    previous = results_dir / "batching.json"
    results = json.loads(previous.read_text())["batching"] if previous.is_file() else {}  # regimes not rerun stay
    for name in names:
        setting = SETTINGS[name]
        results[name] = measure(setting, setting.quick_steps if args.quick else setting.steps, repeats, started)
        plot(name, results[name], results_dir / f"batching-{name}.png")
        for key, value in results[name]["ratios"].items():
            print(f"[batching] {name} {key}: {fmt(value)}", flush=True)
    data = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": f"{'quick' if args.quick else 'full'}: {repeats} repeat(s)",
            "machine": machine(), "batching": results, "lines": section(results)}
    (results_dir / "batching.json").write_text(json.dumps(data, indent=1))
    print(f"[batching] {write_results_md(results_dir)} ({time.time() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
