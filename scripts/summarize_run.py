"""Print what an RL run did, from its metrics.jsonl: reward at the start and at the end (and,
for tool environments, the tool-call rate, calls and malformed calls per rollout).

    python scripts/summarize_run.py RUN_DIR [--window 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prime_rl.rundir import metrics_path, read_jsonl


TOOL_METRICS = ("/made_tool_call", "/total_tool_calls", "/malformed_calls")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(run_dir: Path, window: int = 5) -> dict[str, float]:
    rows = read_jsonl(metrics_path(run_dir))
    steps = sorted((r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])
    rewards = [r["reward/mean"] for r in steps]
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r]
    if not rewards or not trainer:
        raise SystemExit(f"{metrics_path(run_dir)}: no orchestrator/trainer rows; did the run start?")
    orchestrator = sorted((r for r in rows if r["process"] == "orchestrator"), key=lambda r: r["step"])
    tools = {}
    for key in sorted({k for r in orchestrator for k in r if k.startswith("metrics/") and k.endswith(TOOL_METRICS)}):
        values = [r[key] for r in orchestrator if key in r]
        tools[key] = (mean(values[:window]), mean(values[-window:]))
    return {
        "tools": tools,
        "steps": len(rewards),
        "reward_first": mean(rewards[:window]),
        "reward_last": mean(rewards[-window:]),
        "mismatch_kl_first": trainer[0]["loss/mismatch_kl"],
        "seconds": max(r["time"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()
    s = summarize(args.run_dir, args.window)
    w = args.window
    print(f"steps: {s['steps']}   RL wall time: {s['seconds']:.0f} s")
    print(f"mean reward, first {w} steps: {s['reward_first']:.3f}")
    print(f"mean reward, last {w} steps:  {s['reward_last']:.3f}   (change {s['reward_last'] - s['reward_first']:+.3f})")
    print(f"mismatch KL trainer vs vLLM at the first step (step 0): {s['mismatch_kl_first']:.2e}")
    for key, (first, last) in s["tools"].items():
        print(f"{key}: first {w} steps {first:.3f}, last {w} steps {last:.3f}")


if __name__ == "__main__":
    main()
