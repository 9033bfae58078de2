"""On-policy distillation against RL, over seeds, side by side in one invocation (issue 40).

    uv run --group bench python -m benchmarks.distill [--quick] [--repeats N]

Student: the quickstart's SFT model (`benchmarks.run.prepare_model`, the quickstart's recipe).
Teacher: the quickstart's RL run (`configs/reverse-text/rl.toml`, seed 0) continued to
``teacher_steps`` (240) steps, stronger than the ``rl_steps`` (120) RL runs it is compared
with. Then, for seeds 0 .. repeats - 1, the modes alternating within a seed:

- ``rl``: `rl.toml` for ``rl_steps`` steps, as the quickstart runs it;
- ``distill``: pure distillation as shipped (`configs/reverse-text/distill.toml` over
  `rl.toml`: reward_weight 0, the top-20 reverse KL, 4 rollouts of each of 64 prompts, lr
  2e-3, the teacher in the trainer), ``distill_steps``;
- ``distill-x1``: the same with one rollout of each of 256 prompts (the recipe before: more
  prompts a step, which neither vLLM nor the trainer can share);
- ``mix``: ``distill`` with reward_weight 1.

Last, the cost of a step with the teacher served by vLLM instead (``distill-x1`` with
`placement = "server"`, ``served_steps`` steps, seed 0), beside ``distill-x1``'s. The target is RL's final reward: the
median over the RL seeds of each run's last-5-step mean. Per run: the step and the seconds
from the command's start at which the 5-step mean reward first reaches it, RL's seconds to its
last step, and per step the seconds, the orchestrator's wait for its rollouts
(`time/generate`) and the teacher's time (the trainer's `time/teacher`, or a served teacher's
`distill/teacher_s` in the orchestrator). Writes `benchmarks/results/distill.json` (a quick
run: `outputs/bench/results/`) with its own RESULTS.md section, and `distill.png` (reward
against the step and against wall-clock time, every seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loadgen import free_port
from benchmarks.run import RESULTS, WORK, Recipe, alternating, cell, mean5, prepare_model, run_prime_rl, spread, write_part

CONFIG = "configs/reverse-text/rl.toml"
DISTILL = (CONFIG, "configs/reverse-text/distill.toml")
IN_TRAINER = ["--teacher.placement", "trainer"]
MODES = {
    "rl": (CONFIG, []),
    "distill": (DISTILL, [*IN_TRAINER, "--rollouts-per-example", "4"]),
    "distill-x1": (DISTILL, [*IN_TRAINER, "--rollouts-per-example", "1"]),
    "mix": (DISTILL, [*IN_TRAINER, "--rollouts-per-example", "4", "--trainer.loss.distill.reward-weight", "1"]),
}
"""Each mode's configs and flags, the shipped values named too so that a stored result stays
what it says when the shipped config changes (the teacher's folder is added to every one)."""
DEFAULT_MODES = tuple(MODES)
SERVED = "distill-x1, served teacher"


@dataclass(frozen=True)
class Plan:
    teacher_steps: int
    rl_steps: int
    distill_steps: int
    served_steps: int
    repeats: int


FULL = Plan(teacher_steps=240, rl_steps=120, distill_steps=60, served_steps=12, repeats=3)
QUICK = Plan(teacher_steps=6, rl_steps=6, distill_steps=4, served_steps=3, repeats=1)


def one_run(configs, model: Path, out: Path, flags: list[str], system: str) -> dict:
    """One `prime-rl` run: per step its seconds since the command started, reward, the
    orchestrator's seconds a step and wait for rollouts, the teacher's seconds."""
    curve = run_prime_rl(configs, model, out, flags, system=system)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    orchestrator = sorted((r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])
    trainer = sorted((r for r in rows if r["process"] == "trainer"), key=lambda r: r["step"])
    teacher = [r["time/teacher"] for r in trainer if "time/teacher" in r] or [r["distill/teacher_s"] for r in orchestrator
                                                                             if "distill/teacher_s" in r]
    return {"times": curve.times, "rewards": curve.rewards, "wall_s": curve.wall_s,
            "step_s": [r["time/step"] for r in orchestrator], "generate_s": [r["time/generate"] for r in orchestrator],
            "teacher_s": teacher, "reverse_kl": [r.get("loss/reverse_kl") for r in trainer]}


def measure(plan: Plan, out: Path, modes: tuple[str, ...] = DEFAULT_MODES, served: bool = True) -> dict:
    started = time.time()
    sft = prepare_model(Recipe())
    teacher = out / "teacher" / "weights" / f"step_{plan.teacher_steps}"
    if not (teacher / "STABLE").exists():
        one_run(CONFIG, sft, out / "teacher", ["--max-steps", str(plan.teacher_steps), "--seed", "0"], "teacher")
    print(f"[distill] teacher: {teacher} ({time.time() - started:.0f} s)", flush=True)

    def one(mode: str, seed: int) -> dict:
        configs, flags = MODES[mode]
        steps = plan.rl_steps if mode == "rl" else plan.distill_steps
        flags = ["--max-steps", str(steps), "--seed", str(seed), *flags]
        if mode != "rl":
            flags += ["--teacher.model", str(teacher)]
        run = one_run(configs, sft, out / f"{mode}-{seed}", flags, mode)
        print(f"[distill] {mode} seed {seed}: last5 {statistics.fmean(run['rewards'][-5:]):.3f} "
              f"({time.time() - started:.0f} s)", flush=True)
        return run

    runs = alternating(list(modes), plan.repeats, one)
    if served:
        flags = ["--max-steps", str(plan.served_steps), "--seed", "0", "--teacher.model", str(teacher),
                 "--rollouts-per-example", "1", "--teacher.placement", "server", "--teacher.port", str(free_port())]
        runs[SERVED] = [one_run(DISTILL, sft, out / "served", flags, SERVED)]
    return {"runs": runs, "minutes": (time.time() - started) / 60, "plan": plan.__dict__}


def first_crossing(rewards: list[float], target: float) -> int | None:
    """Index of the first step whose 5-step mean reaches ``target`` (None: never)."""
    return next((i for i, v in enumerate(mean5(rewards)) if v >= target), None)


def after_first(values: list[float]) -> float | None:
    """Median over the steps after the first (which carries start-up)."""
    values = [v for v in values[1:] if v is not None]
    return statistics.median(values) if values else None


def run_figures(run: dict, target: float) -> dict[str, float | None]:
    i = first_crossing(run["rewards"], target)
    steps_after_first = len(run["times"]) - 2
    return {
        "steps_to_target": None if i is None else i + 1,
        "time_to_target_s": None if i is None else run["times"][i],
        "time_to_last_step_s": run["times"][-1],
        "startup_s": run["times"][0],
        "s_per_step": (run["times"][-1] - run["times"][1]) / steps_after_first if steps_after_first > 0 else None,
        "orchestrator_s_per_step": after_first(run["step_s"]),
        "generate_wait_s": after_first(run["generate_s"]),
        "teacher_s_per_step": after_first(run["teacher_s"]),
        "reward_first5": statistics.fmean(run["rewards"][:5]),
        "reward_last5": statistics.fmean(run["rewards"][-5:]),
    }


def summarize(result: dict) -> dict:
    runs = result["runs"]
    target = statistics.median(statistics.fmean(r["rewards"][-5:]) for r in runs["rl"])
    figures = {mode: {key: spread([run_figures(r, target)[key] for r in mode_runs]) for key in run_figures(mode_runs[0], target)}
               for mode, mode_runs in runs.items()}
    rl = figures["rl"]
    rl_steps, rl_s, rl_step_s = result["plan"]["rl_steps"], rl["time_to_last_step_s"]["median"], rl["orchestrator_s_per_step"]["median"]
    ratios = {}
    for mode in (m for m in figures if m not in ("rl", SERVED)):
        steps, seconds = figures[mode]["steps_to_target"]["median"], figures[mode]["time_to_target_s"]["median"]
        ratios[f"{mode}: steps to RL's final reward / RL's steps"] = None if steps is None else steps / rl_steps
        ratios[f"{mode}: time to RL's final reward / RL's time"] = None if seconds is None or not rl_s else seconds / rl_s
    for mode in (m for m in figures if m != "rl"):  # a step's generation: RL's step, which generation bounds here
        teacher = figures[mode]["teacher_s_per_step"]["median"]
        ratios[f"{mode}: teacher's seconds a step / RL's seconds a step"] = None if teacher is None or not rl_step_s else teacher / rl_step_s
    return {"target": target, "figures": figures, "ratios": ratios}


def section(result: dict, summary: dict) -> list[str]:
    plan, figures = result["plan"], summary["figures"]
    modes = list(figures)
    lines = [
        f"On-policy distillation against RL (`benchmarks/distill.py`), {plan['repeats']} seed(s) a mode, alternating. Student: "
        f"the quickstart's SFT model; teacher: the quickstart's RL run continued to step {plan['teacher_steps']}. `rl` = "
        f"`{CONFIG}`, {plan['rl_steps']} steps; `distill` = `{DISTILL[1]}` over it as shipped (reward_weight 0, the "
        "top-20 reverse KL, 4 rollouts of each of 64 prompts, lr 2e-3, the teacher in the trainer), `distill-x1` = the "
        "same with 1 rollout of each of 256 prompts, `mix` = `distill` with reward_weight 1, "
        f"{plan['distill_steps']} steps each; `{SERVED}` = `distill-x1` with the teacher in a vLLM server of its own, "
        f"{plan['served_steps']} steps, for its cost a step. The target is RL's final "
        f"reward, {summary['target']:.3f} (the median over RL's seeds of each run's last-5-step mean); times are seconds "
        "from the command's start; median [min, max] over seeds.", "",
        "| figure | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes),
    ]
    for key in figures[modes[0]]:
        lines.append(f"| {key} | " + " | ".join(cell(figures[m][key], "-") for m in modes) + " |")
    lines += ["", "| ratio (medians) | value |", "|---|---|"]
    lines += [f"| {name} | {'-' if v is None else f'{v:.3g}'} |" for name, v in summary["ratios"].items()]
    return [*lines, "", "![reward against the step and the wall-clock time, every seed](results/distill.png)"]


def plot(result: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"rl": "tab:blue", "distill": "tab:orange", "distill-x1": "tab:purple", "mix": "tab:green", SERVED: "tab:red"}
    for mode, runs in result["runs"].items():
        for i, run in enumerate(runs):
            label = mode if i == 0 else None
            by_step.plot(range(1, len(run["rewards"]) + 1), mean5(run["rewards"]), color=colors[mode], alpha=0.8, label=label)
            by_time.plot(run["times"], mean5(run["rewards"]), color=colors[mode], alpha=0.8, label=label)
    for ax in (by_step, by_time):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel("reward (5-step mean)")
        ax.legend()
    by_step.axvline(result["plan"]["rl_steps"] / 3, color="grey", linestyle="--", linewidth=1)
    by_step.set(xlabel="step", title="reward against the step (dashed: a third of RL's steps)")
    by_time.set(xlabel="seconds since the command started", title="reward against wall-clock time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps, 1 seed: a smoke run (results under outputs/bench/)")
    parser.add_argument("--repeats", type=int, default=None, help="seeds a mode (default 3)")
    parser.add_argument("--add", nargs="+", choices=list(MODES), default=None,
                        help="run these modes only, with the stored result's teacher, and add them to (or replace them in) it")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.repeats:
        plan = Plan(**{**plan.__dict__, "repeats": args.repeats})
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    if args.add:
        stored = json.loads((results / "distill.json").read_text())["distill"]
        added = measure(plan, WORK / "distill", tuple(args.add), served=False)
        result = {**stored, "runs": {**stored["runs"], **added["runs"]}, "minutes": stored["minutes"] + added["minutes"]}
    else:
        result = measure(plan, WORK / "distill")
    summary = summarize(result)
    plot(result, summary["target"], results / "distill.png")
    mode = (f"{'quick' if args.quick else 'full'}: teacher {plan.teacher_steps} RL steps, RL {plan.rl_steps}, "
            f"distillation {plan.distill_steps}, seeds 0-{plan.repeats - 1}")
    write_part(results, "distill", mode, section(result, summary), {**result, **summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
