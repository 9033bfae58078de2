"""Context distillation on reverse-text: bake an instruction into the weights, then drop it.

    uv run --group bench python -m benchmarks.context_distill [--quick] [--steps N] [--placement trainer|server]

(a) The quickstart's SFT model (`benchmarks.run.prepare_model`) is evaluated with
`prime-rl eval` on the first 100 examples of reverse-text's held-out eval split (4 rollouts
each, temperature 1) under the student's prompt (``STUDENT``: the bare text, no system
message) and under each candidate teacher prompt of ``PROMPTS``. (b) The candidate that scores
best is the teacher's prompt: the same SFT model, served as the teacher, scores the student's
tokens under it, while the student samples and trains under its own prompt (pure distillation:
`configs/reverse-text/context-distill.toml` over the quickstart's `rl.toml`) for `steps` steps,
the teacher in the trainer's process (`--placement trainer`, the default) or in a vLLM server.
(c) The student's final weights are evaluated under the student's prompt on the same 100
examples: before / after. Writes `benchmarks/results/context-distill.json` (a quick run:
`outputs/bench/results/`) with its own RESULTS.md section.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.loadgen import free_port
from benchmarks.run import REPO, RESULTS, WORK, Recipe, prepare_model, run_prime_rl, write_part
from orchestrator.envs.reverse_text import SYSTEM_PROMPT

CONFIG = ("configs/reverse-text/rl.toml", "configs/reverse-text/context-distill.toml")
STUDENT = ""
"""The student's system prompt: none (the environment's `system_prompt` argument, "" = no system message)."""
PROMPTS = {
    "instruction": SYSTEM_PROMPT,
    "two-examples": f"{SYSTEM_PROMPT}\nExample: abc -> cba\nExample: hello -> olleh",
    "spelled-out": "Reverse the text character by character: write its last character first, then the one "
                   "before it, and so on until its first character.",
    "terse": "Reverse the text.",
}
"""Candidate teacher prompts; "instruction" is the environment's own, the one SFT trained on."""
EVAL = ["-n", "100", "-r", "4", "-T", "1.0", "-s"]


def evaluate(model: Path, out: Path, prompt: str, num_examples: str = "100") -> float:
    """Mean reward of ``model`` on reverse-text's eval split under system prompt ``prompt`` ("": none)."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [*EVAL, "-a", json.dumps({"system_prompt": prompt})]
    flags[1] = num_examples
    cmd = [sys.executable, "-m", "prime_rl.cli", "eval", "reverse-text", "-m", str(model), *flags,
           "--output-dir", str(out), "--inference.port", str(free_port())]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = max(out.glob("*/*/summary.json"), key=lambda p: p.stat().st_mtime)  # this evaluation's, not an earlier run's
    return json.loads(summary.read_text())["reward/mean"]


def measure(steps: int, out: Path, num_examples: str, placement: str = "trainer") -> dict:
    sft = prepare_model(Recipe())
    scores = {"student (none)": evaluate(sft, out / "eval-student", STUDENT, num_examples)}
    for name, prompt in PROMPTS.items():
        scores[name] = evaluate(sft, out / f"eval-{name}", prompt, num_examples)
    best = max(PROMPTS, key=scores.__getitem__)
    curve = run_prime_rl(CONFIG, sft, out / "run", [
        "--max-steps", str(steps), "--teacher.model", str(sft), "--teacher.port", str(free_port()),
        "--teacher.system-prompt", PROMPTS[best], "--teacher.placement", placement,
    ])
    after = evaluate(out / "run" / "weights" / f"step_{steps}", out / "eval-after", STUDENT, num_examples)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = sorted((r for r in rows if r["process"] == "trainer" and "loss/reverse_kl" in r), key=lambda r: r["step"])
    kl = [r["loss/reverse_kl"] for r in trainer]  # both placements log it
    return {"scores": scores, "best": best, "prompt": PROMPTS[best], "after": after, "num_examples": int(num_examples),
            "reverse_kl_first5": sum(kl[:5]) / len(kl[:5]), "reverse_kl_last5": sum(kl[-5:]) / len(kl[-5:]),
            "placement": placement, "s_per_step": (curve.times[-1] - curve.times[1]) / max(1, len(curve.times) - 2)}


def section(result: dict, steps: int) -> list[str]:
    scores = result["scores"]
    before, teacher = scores["student (none)"], scores[result["best"]]
    lines = ["Context distillation on reverse-text (`benchmarks/context_distill.py`): the SFT model's mean reward "
             f"on the first {result['num_examples']} held-out examples (4 rollouts each, temperature 1) under the student's prompt (none: "
             "the bare text) and under each candidate teacher prompt; the best candidate "
             f"({result['best']!r}) is the teacher's prompt for {steps} steps of pure distillation (teacher = the SFT "
             "model itself, `configs/reverse-text/context-distill.toml`, placed in the "
             f"{result.get('placement', 'server')}); the student is evaluated under its own prompt before and after.", "",
             "| system prompt | reward |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in scores.items()]
    lines += ["", "| figure | value |", "|---|---|",
              f"| student's prompt (none), before | {before:.3f} |",
              f"| teacher's prompt ({result['best']}), before | {teacher:.3f} |",
              f"| student's prompt (none), after {steps} steps of context distillation | {result['after']:.3f} |",
              f"| reverse KL to the teacher, first 5 steps | {result['reverse_kl_first5']:.4f} |",
              f"| reverse KL to the teacher, last 5 steps | {result['reverse_kl_last5']:.4f} |"]
    if "s_per_step" in result:
        lines.append(f"| seconds a step (after the first) | {result['s_per_step']:.3g} |")
    if teacher <= before:
        lines += ["", "No candidate beats the student's own prompt here: the teacher is no better than the student "
                  "(the mechanism, not a gain)."]
    else:
        gained = (result["after"] - before) / (teacher - before)
        lines += ["", f"The student without its prompt recovered {gained:.0%} of what the teacher's prompt adds."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, 8 examples: a smoke run (results under outputs/bench/)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--placement", choices=("trainer", "server"), default="trainer", help="where the teacher scores")
    args = parser.parse_args(argv)
    steps, num_examples = (6, "8") if args.quick else (args.steps, "100")
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    result = measure(steps, WORK / "context-distill", num_examples, args.placement)
    mode = f"{'quick' if args.quick else 'full'}: {steps} steps, {num_examples} eval examples, the teacher in the {args.placement}"
    write_part(results, "context-distill", mode, section(result, steps), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
