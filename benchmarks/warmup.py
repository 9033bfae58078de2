"""The quickstart from scratch over seeds: does it land the same everywhere? (issue 36, item 2)

    uv run --group bench python -m benchmarks.warmup [--seeds 3] [--steps 120] [--write]

Seed i builds the tiny model with `--seed i`, warms it up with `configs/reverse-text/sft.toml`
and `--seed i` (the chats are the quickstart's, the same for every seed), then runs the
quickstart's RL (`configs/reverse-text/rl.toml`, `--seed i`) from it. A different seed is
the closest this machine comes to another machine: a different float rounding moves the
warm-up the way a different seed does (docs/benchmarks.md, "Where the quickstart's warm-up
stops"). `benchmarks.run` varies only RL's seed, on one warm-up.

Per seed: the warm-up's steps, seconds and last loss; RL's reward at step 0, over its first
and last 5 steps, the gain between them, the steps and seconds to a 5-step mean of 0.85.
Targets: the start reward (first 5 steps) varies by <= 0.03 across seeds, the median gain
is >= +0.20. ``--write`` stores `benchmarks/results/warmup.json` and regenerates RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.run import QUICKSTART, RESULTS, WORK, Recipe, cell, figures, prepare_model, repeat_flags, run_prime_rl, spread, write_part

START_RANGE, GAIN = 0.03, 0.20


def warmup_figures(sft) -> dict[str, float]:
    """The warm-up's steps, seconds of its steps and mean loss of its last 50 steps, from its metrics."""
    rows = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r["loss/sft"] for r in rows[-50:]]
    return {"sft_steps": rows[-1]["step"], "sft_s": sum(r["time/step"] for r in rows), "sft_last_loss": statistics.fmean(last)}


def one_seed(seed: int, steps: int) -> dict[str, float | None]:
    sft = prepare_model(Recipe(build_args=("--seed", str(seed)), sft_flags=("--seed", str(seed))))
    curve = run_prime_rl(QUICKSTART.config, sft, WORK / "warmup" / f"rl-{seed}", repeat_flags(steps, seed))
    rl = figures(curve, QUICKSTART.full)
    return {**warmup_figures(sft), "reward_step0": curve.rewards[0], "reward_first5": rl["reward_first5"],
            "reward_last5": rl["reward_last5"], "gain": rl["reward_last5"] - rl["reward_first5"],
            "steps_to_0.85": rl["steps_to_0.85"], "time_to_0.85_s": rl["time_to_0.85_s"], "wall_s": rl["wall_s"]}


def summarize(seeds: list[dict[str, float | None]], steps: int) -> dict:
    """Each figure's median [min, max] over the seeds, the start reward's range, the median gain."""
    starts = [s["reward_first5"] for s in seeds]
    return {"steps": steps, "seeds": seeds, "spread": {k: spread([s[k] for s in seeds]) for k in seeds[0]},
            "start_range": max(starts) - min(starts), "median_gain": statistics.median(s["gain"] for s in seeds)}


def markdown(r: dict) -> list[str]:
    """The RESULTS.md section."""
    keys = list(r["seeds"][0])
    lines = ["The quickstart from scratch (`benchmarks/warmup.py`): seed i builds the model, warms it up and "
             f"runs RL ({r['steps']} steps); a row a seed, then median [min, max].", "",
             "| seed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for i, row in enumerate(r["seeds"]):
        lines.append(f"| {i} | " + " | ".join("-" if row[k] is None else f"{row[k]:.4g}" for k in keys) + " |")
    lines.append("| all | " + " | ".join(cell(r["spread"][k]) for k in keys) + " |")
    return lines + ["", f"Start reward (first 5 steps) range {r['start_range']:.3f} (target <= {START_RANGE}), "
                        f"median gain {r['median_gain']:+.3f} (target >= +{GAIN})."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    parser.add_argument("--steps", type=int, default=QUICKSTART.full.steps, help="RL steps a seed")
    parser.add_argument("--write", action="store_true", help="store results/warmup.json and regenerate RESULTS.md")
    args = parser.parse_args(argv)
    started = time.time()
    seeds = []
    for seed in range(args.seeds):
        seeds.append(one_seed(seed, args.steps))
        print(f"[warmup] seed {seed}: {seeds[-1]} ({time.time() - started:.0f} s)", flush=True)
    result = summarize(seeds, args.steps)
    lines = markdown(result)
    if args.write:
        write_part(RESULTS, "warmup", f"{args.seeds} seeds, {args.steps} RL steps", lines, result)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
