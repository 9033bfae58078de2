"""Context distillation on reverse-text: bake a helpful system prompt into the weights.

    uv run --group bench python -m benchmarks.context_distill [--quick] [--steps N]

(a) The quickstart's SFT model (`benchmarks.run.prepare_model`) is evaluated with
`prime-rl eval` on the first 100 examples of reverse-text's held-out eval split (4 rollouts
each, temperature 1) under its own system prompt and under each candidate teacher prompt of
``PROMPTS``. (b) The candidate that scores best is the teacher's prompt: the same SFT model,
served as the teacher, scores the student's tokens under it, while the student samples and
trains under its plain prompt (pure distillation: `reward_weight = 0`), for `steps` steps of
the quickstart's config. (c) The student's final weights are evaluated under the plain
prompt on the same 100 examples: before / after. Writes `benchmarks/results/context-distill.json`
(a quick run: `outputs/bench/results/`) with its own RESULTS.md section.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.loadgen import free_port
from benchmarks.run import REPO, RESULTS, WORK, Recipe, prepare_model, run_prime_rl, write_part

CONFIG = "configs/reverse-text/rl.toml"
PROMPTS = {
    "two-examples": "Reverse the text character by character.\nExample: abc -> cba\nExample: hello -> olleh",
    "spelled-out": "Reverse the text character by character: write its last character first, then the one "
                   "before it, and so on until its first character.",
    "terse": "Reverse the text.",
}
"""Candidate teacher prompts (the environment's own: "Reverse the text character by character.")."""
EVAL = ["-n", "100", "-r", "4", "-T", "1.0", "-s"]


def evaluate(model: Path, out: Path, prompt: str | None, num_examples: str = "100") -> float:
    """Mean reward of ``model`` on reverse-text's eval split under ``prompt`` (None: the environment's)."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [*EVAL]
    flags[1] = num_examples
    if prompt is not None:
        (out / "prompt.txt").write_text(prompt)
        flags += ["--system-prompt-file", str(out / "prompt.txt")]
    cmd = [sys.executable, "-m", "prime_rl.cli", "eval", "reverse-text", "-m", str(model), *flags,
           "--output-dir", str(out), "--inference.port", str(free_port())]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (summary,) = out.glob("*/*/summary.json")
    return json.loads(summary.read_text())["reward/mean"]


def measure(steps: int, out: Path, num_examples: str) -> dict:
    sft = prepare_model(Recipe())
    scores = {"plain": evaluate(sft, out / "eval-plain", None, num_examples)}
    for name, prompt in PROMPTS.items():
        scores[name] = evaluate(sft, out / f"eval-{name}", prompt, num_examples)
    best = max(PROMPTS, key=scores.__getitem__)
    run_prime_rl(CONFIG, sft, out / "run", [
        "--max-steps", str(steps), "--teacher.model", str(sft), "--teacher.port", str(free_port()),
        "--teacher.system-prompt", PROMPTS[best], "--trainer.loss.distill.reward-weight", "0",
        "--trainer.loss.distill.kl-weight", "1",
    ])
    after = evaluate(out / "run" / "weights" / f"step_{steps}", out / "eval-after", None, num_examples)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kl = [r["distill/reverse_kl"] for r in rows if r["process"] == "orchestrator" and "distill/reverse_kl" in r]
    return {"scores": scores, "best": best, "prompt": PROMPTS[best], "after": after,
            "reverse_kl_first5": sum(kl[:5]) / len(kl[:5]), "reverse_kl_last5": sum(kl[-5:]) / len(kl[-5:])}


def section(result: dict, steps: int) -> list[str]:
    scores = result["scores"]
    lines = ["Context distillation on reverse-text (`benchmarks/context_distill.py`): the SFT model's mean reward "
             "on the first 100 held-out examples (4 rollouts each, temperature 1) under each system prompt; the "
             f"best candidate ({result['best']!r}) is the teacher's prompt for {steps} steps of pure distillation "
             "(teacher = the SFT model itself); the student is evaluated under the plain prompt before and after.", "",
             "| system prompt | reward |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in scores.items()]
    lines += ["", "| figure | value |", "|---|---|",
              f"| plain prompt, before | {scores['plain']:.3f} |",
              f"| teacher's prompt ({result['best']}), before | {scores[result['best']]:.3f} |",
              f"| plain prompt, after {steps} steps of context distillation | {result['after']:.3f} |",
              f"| reverse KL to the teacher, first 5 steps | {result['reverse_kl_first5']:.4f} |",
              f"| reverse KL to the teacher, last 5 steps | {result['reverse_kl_last5']:.4f} |"]
    if scores[result["best"]] <= scores["plain"]:
        lines += ["", "No candidate beats the plain prompt here, so the teacher is worse than the student: the student "
                  "moves toward the teacher's prompt's reward under its own prompt (the mechanism, not a gain)."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, 8 examples: a smoke run (results under outputs/bench/)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    steps, num_examples = (6, "8") if args.quick else (args.steps, "100")
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    result = measure(steps, WORK / "context-distill", num_examples)
    mode = f"{'quick' if args.quick else 'full'}: {steps} steps, {num_examples} eval examples"
    write_part(results, "context-distill", mode, section(result, steps), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
