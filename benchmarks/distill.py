"""On-policy distillation against RL, side by side in one invocation.

    uv run --group bench python -m benchmarks.distill [--quick] [--steps N] [--distill-steps M]

Student: the quickstart's SFT model (`benchmarks.run.prepare_model`, the quickstart's
recipe). RL: `configs/reverse-text/rl.toml` from it for `steps` steps, as the quickstart runs
it; its final weights (`weights/step_<steps>`) are the teacher. Then, from the same SFT
model and seed, for `distill_steps` steps each with the teacher in a vLLM process of its own:
pure distillation as shipped (`configs/reverse-text/distill.toml` over `rl.toml`:
`reward_weight = 0`, the reward only logged; the top-20 reverse KL; one rollout of each of 256
prompts; lr 2e-3) and the mix (the same with `reward_weight = 1` and 4 rollouts an example,
so that groups have an advantage). Per run: the reward per step, the reverse KL to the
teacher per step (`distill/reverse_kl`) and the number of steps to RL's final reward (the
first step whose 5-step mean reaches RL's last 5-step mean). Writes
`benchmarks/results/distill.json` (a quick run: `outputs/bench/results/`) with its own
RESULTS.md section, and `distill.png` (reward and reverse KL against the step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.loadgen import free_port
from benchmarks.run import RESULTS, WORK, Recipe, mean5, prepare_model, run_prime_rl, write_part

CONFIG = "configs/reverse-text/rl.toml"
DISTILL = (CONFIG, "configs/reverse-text/distill.toml")
MODES = {"distill": [], "mix": ["--trainer.loss.distill.reward-weight", "1", "--rollouts-per-example", "4"]}
"""Flags of each distillation run over ``DISTILL``."""
LEVELS = (0.70, 0.72, 0.73, 0.74)
"""Reward levels the section also gives the steps to (those below RL's final)."""


def rows_of(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])


def steps_to(rewards: list[float], target: float) -> int | None:
    """Steps until the 5-step mean first reaches ``target`` (None: never)."""
    return next((i + 1 for i, v in enumerate(mean5(rewards)) if v >= target), None)


def measure(steps: int, distill_steps: int, out: Path) -> dict:
    sft = prepare_model(Recipe())
    runs: dict[str, list[dict]] = {}
    start = time.time()
    run_prime_rl(CONFIG, sft, out / "rl", ["--max-steps", str(steps)])
    runs["rl"] = rows_of(out / "rl")
    teacher = out / "rl" / "weights" / f"step_{steps}"
    for mode, extra in MODES.items():
        run_prime_rl(DISTILL, sft, out / mode, [
            "--max-steps", str(distill_steps), "--teacher.model", str(teacher), "--teacher.port", str(free_port()), *extra,
        ])
        runs[mode] = rows_of(out / mode)
    target = statistics.fmean([r["reward/mean"] for r in runs["rl"]][-5:])
    curves = {mode: {"reward": [r["reward/mean"] for r in rows], "reverse_kl": [r.get("distill/reverse_kl") for r in rows],
                     "teacher_s": [r.get("distill/teacher_s") for r in rows], "step_s": [r.get("time/step") for r in rows]}
              for mode, rows in runs.items()}
    figures = {mode: {
        "reward_first5": statistics.fmean(c["reward"][:5]), "reward_last5": statistics.fmean(c["reward"][-5:]),
        "steps_to_rl_final": steps_to(c["reward"], target),
        "reverse_kl_first5": mean_of(c["reverse_kl"][:5]), "reverse_kl_last5": mean_of(c["reverse_kl"][-5:]),
        "teacher_s_per_step": mean_of(c["teacher_s"][1:]), "orchestrator_s_per_step": mean_of(c["step_s"][1:]),
    } for mode, c in curves.items()}
    return {"target": target, "figures": figures, "curves": curves, "minutes": (time.time() - start) / 60,
            "steps": steps, "distill_steps": distill_steps}


def mean_of(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def section(result: dict) -> list[str]:
    figures, steps, distill_steps = result["figures"], result["steps"], result["distill_steps"]
    modes = list(figures)
    lines = [f"On-policy distillation against RL (`benchmarks/distill.py`): the quickstart's SFT model; RL = "
             f"`{CONFIG}` for {steps} steps, whose `weights/step_{steps}` is the teacher; `distill` = "
             f"`{DISTILL[1]}` over it (reward_weight 0, the top-20 reverse KL, 1 rollout of each of 256 prompts, "
             f"lr 2e-3) and `mix` = the same with reward_weight 1 and 4 rollouts an example, {distill_steps} steps "
             "each. `steps_to_rl_final` is the first step whose 5-step mean reward reaches the RL run's last "
             f"5-step mean ({result['target']:.3f}).", "",
             "| figure | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for key in figures[modes[0]]:
        lines.append(f"| {key} | " + " | ".join(fmt(figures[m][key]) for m in modes) + " |")
    levels = [level for level in LEVELS if level < result["target"]] + [round(result["target"], 3)]
    lines += ["", "Steps until the 5-step mean reward first reaches each level:", "",
              "| reward | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for level in levels:
        lines.append(f"| {level:.3f} | " + " | ".join(fmt(steps_to(result["curves"][m]["reward"], level)) for m in modes) + " |")
    rl = figures["rl"]["steps_to_rl_final"]
    for mode in MODES:
        ours = figures[mode]["steps_to_rl_final"]
        if ours is None:
            lines.append(f"\n{mode}: RL's {steps}-step reward not reached in {distill_steps} steps")
            continue
        first = "" if rl is None else f"; {ours / rl:.2f} of the {rl} RL needed to first reach it"
        lines.append(f"\n{mode}: RL's {steps}-step reward at step {ours}, {ours / steps:.2f} of RL's {steps} steps{first}")
    return [*lines, "", "![reward and reverse KL against the step](results/distill.png)"]


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, kl) = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, curve), color in zip(result["curves"].items(), ("tab:blue", "tab:orange", "tab:green")):
        reward.plot(range(1, len(curve["reward"]) + 1), mean5(curve["reward"]), color=color, label=mode)
        if any(v is not None for v in curve["reverse_kl"]):
            kl.plot(range(1, len(curve["reverse_kl"]) + 1), curve["reverse_kl"], color=color, label=mode)
    reward.axhline(result["target"], color="grey", linestyle=":", linewidth=1)
    if "steps" in result:
        reward.axvline(result["steps"] / 3, color="grey", linestyle="--", linewidth=1, label="a third of RL's steps")
    reward.set(xlabel="step", ylabel="reward (5-step mean)", title="reward")
    kl.set(xlabel="step", ylabel="mean log p_student - log p_teacher", title="reverse KL to the teacher")
    reward.legend()
    kl.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps each: a smoke run (results under outputs/bench/)")
    parser.add_argument("--steps", type=int, default=120, help="RL's steps (the teacher is its last weights)")
    parser.add_argument("--distill-steps", type=int, default=60, help="steps of each distillation run")
    args = parser.parse_args(argv)
    steps, distill_steps = (6, 6) if args.quick else (args.steps, args.distill_steps)
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    result = measure(steps, distill_steps, WORK / "distill")
    plot(result, results / "distill.png")
    mode = f"{'quick' if args.quick else 'full'}: RL {steps} steps, distillation {distill_steps}, 1 repeat"
    write_part(results, "distill", mode, section(result), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
