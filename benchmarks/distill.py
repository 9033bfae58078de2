"""On-policy distillation against RL, side by side in one invocation.

    uv run --group bench python -m benchmarks.distill [--quick] [--steps N]

Student: the quickstart's SFT model (`benchmarks.run.prepare_model`, the quickstart's
recipe). RL: `configs/reverse-text/rl.toml` from it for `steps` steps, as the quickstart runs
it; its final weights (`weights/step_<steps>`) are the teacher. Then, from the same SFT
model with the same config and seed: pure distillation (`reward_weight = 0, kl_weight = 1`:
the reward is only logged) and the mix (`1, 1`), each for `steps` steps with the teacher in
a vLLM process of its own. Per run: the reward per step, the reverse KL to the teacher per
step (`distill/reverse_kl`) and the number of steps to RL's final reward (the first step
whose 5-step mean reaches RL's last 5-step mean). Writes `benchmarks/results/distill.json`
(a quick run: `outputs/bench/results/`) with its own RESULTS.md section, and `distill.png`
(reward and reverse KL against the step).
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
MODES = {"distill": (0.0, 1.0), "mix": (1.0, 1.0)}
"""(reward_weight, kl_weight) of each distillation run."""


def rows_of(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])


def steps_to(rewards: list[float], target: float) -> int | None:
    """Steps until the 5-step mean first reaches ``target`` (None: never)."""
    return next((i + 1 for i, v in enumerate(mean5(rewards)) if v >= target), None)


def measure(steps: int, out: Path) -> dict:
    sft = prepare_model(Recipe())
    flags = ["--max-steps", str(steps)]
    runs: dict[str, list[dict]] = {}
    start = time.time()
    run_prime_rl(CONFIG, sft, out / "rl", flags)
    runs["rl"] = rows_of(out / "rl")
    teacher = out / "rl" / "weights" / f"step_{steps}"
    for mode, (reward_weight, kl_weight) in MODES.items():
        run_prime_rl(CONFIG, sft, out / mode, [
            *flags, "--teacher.model", str(teacher), "--teacher.port", str(free_port()),
            "--trainer.loss.distill.reward-weight", str(reward_weight), "--trainer.loss.distill.kl-weight", str(kl_weight),
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
    return {"target": target, "figures": figures, "curves": curves, "minutes": (time.time() - start) / 60}


def mean_of(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def section(result: dict, steps: int) -> list[str]:
    figures = result["figures"]
    modes = list(figures)
    lines = [f"On-policy distillation against RL (`benchmarks/distill.py`): the quickstart's SFT model, "
             f"`{CONFIG}`, {steps} steps each; the teacher is the RL run's `weights/step_{steps}`; `distill` = "
             "reward_weight 0, kl_weight 1; `mix` = 1, 1. `steps_to_rl_final` is the first step whose 5-step "
             f"mean reward reaches the RL run's last 5-step mean ({result['target']:.3f}).", "",
             "| figure | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for key in figures[modes[0]]:
        lines.append(f"| {key} | " + " | ".join(fmt(figures[m][key]) for m in modes) + " |")
    rl = figures["rl"]["steps_to_rl_final"]
    for mode in MODES:
        ours = figures[mode]["steps_to_rl_final"]
        share = "not reached" if ours is None or rl is None else f"{ours / rl:.2f}"
        lines.append(f"\nsteps to RL's final reward, {mode} / rl: {share}")
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
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args(argv)
    steps = 6 if args.quick else args.steps
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    result = measure(steps, WORK / "distill")
    plot(result, results / "distill.png")
    mode = f"{'quick' if args.quick else 'full'}: {steps} steps a run, 1 repeat"
    write_part(results, "distill", mode, section(result, steps), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
