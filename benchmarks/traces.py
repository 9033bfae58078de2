"""What writing rollout traces costs a quickstart step (issue 37: < 2% at the default sample size).

    uv run --group bench python -m benchmarks.traces [--repeats 2] [--steps 40] [--write]

Two measurements, side by side in one invocation:

- **the traces' own work**, in this process, on a step shaped like the quickstart's (256
  rollouts in groups of 8, ~20-token prompts, 16-token completions, the quickstart model's
  tokenizer): the orchestrator's (``TraceWriter``: choosing 2 groups, building, scrubbing and
  appending their 16 rows) and the trainer's (``trainer.traces.sample_traces`` over a
  micro-batch of the step's 256 samples, then its append): the median of 50 steps each;
- **the quickstart itself** (`configs/reverse-text/rl.toml`, ``--steps`` steps) with traces
  on (the default, 2 groups a step) and off (`--orchestrator.traces.groups 0`), alternating,
  ``--repeats`` runs each: the median seconds per step of each and their ratio.

The cost's share is the traces' work over the traced runs' seconds per step (the target);
the on/off ratio is the same cost seen end to end, where run-to-run noise of a few percent
hides a difference that small (it is reported, not judged). ``--write`` stores
`benchmarks/results/traces.json` and regenerates RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from prime_rl.config import LossConfig
from prime_rl.config.orchestrator import TracesConfig
from prime_rl.envs import Rollout, Turn
from orchestrator.batch import ScoredRollout
from orchestrator.traces import TraceWriter
from trainer.traces import sample_traces, write_traces

from benchmarks.run import QUICKSTART, RESULTS, WORK, alternating, prepare_model, run_prime_rl, write_part

TARGET = 0.02
BATCH, GROUP, PROMPT, COMPLETION = 256, 8, 20, 16


def quickstart_step(seed: int = 0) -> list[ScoredRollout]:
    rng = np.random.default_rng(seed)
    items = []
    for i in range(BATCH):
        ids = rng.integers(97, 123, COMPLETION).tolist()
        text = "".join(chr(c) for c in ids)
        rollout = Rollout(i // GROUP, [Turn(rng.integers(0, 256, PROMPT).tolist(), ids, (-rng.random(COMPLETION)).tolist(),
                                            versions=(3, 3))],
                          float(rng.random()), prompt=[{"role": "system", "content": "Reverse the text."},
                                                       {"role": "user", "content": text[::-1]}],
                          completion=[{"role": "assistant", "content": text}], metrics={"lcs_reward_func": 0.5},
                          stop_condition="completed", finish_reason="stop")
        items.append(ScoredRollout(rollout, float(rng.normal()), 3, "reverse-text", 3))
    return items


def orchestrator_cost(tokenizer, run_dir: Path, steps: int = 50) -> float:
    """Median seconds of one step's trace work in the orchestrator (default sample size)."""
    writer = TraceWriter(run_dir, TracesConfig(), tokenizer, 128, secrets=[{"api_key": "sk-benchmark-key-0000000000"}])
    items, sizes = quickstart_step(), [GROUP] * (BATCH // GROUP)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        marked = writer.mark(step, items, sizes)
        writer.write(writer.lines(writer.train_rows(step, marked, sizes)), step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trainer_cost(run_dir: Path, steps: int = 50) -> float:
    """Median seconds of one step's trace work in the trainer: a micro-batch of the step's
    samples (prompt + completion, right-padded), 16 of them traced."""
    torch.manual_seed(0)
    length = PROMPT + COMPLETION - 1
    mask = torch.zeros(BATCH, length, dtype=torch.bool)
    mask[:, PROMPT - 1:] = True
    trainer_lp, inference_lp = -torch.rand(BATCH, length), -torch.rand(BATCH, length)
    entropy = torch.rand(int(mask.sum()))
    traces = [(f"train-0-{i // GROUP}-{i % GROUP}", 0) if i < 2 * GROUP else None for i in range(BATCH)]
    cfg = LossConfig(importance="sequence_mask")
    times = []
    for step in range(steps):
        start = time.perf_counter()
        write_traces(run_dir, step, 0, sample_traces(traces, trainer_lp, inference_lp, mask, entropy, cfg))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown(r: dict) -> list[str]:
    """The RESULTS.md section."""
    runs = lambda mode: ", ".join(f"{v:.3f}" for v in r["runs"][mode])  # noqa: E731
    return [
        "Rollout traces' cost on the quickstart (`benchmarks/traces.py`; target: the traces' work under "
        f"{r['target']:.0%} of a step):", "",
        "| measure | value |", "|---|---|",
        f"| trace work a step, orchestrator (2 groups of 8 rows: choose, build, scrub, append) | {r['orchestrator_ms']:.2f} ms |",
        f"| trace work a step, trainer (its view of the 16 traced samples, append) | {r['trainer_ms']:.2f} ms |",
        f"| quickstart s/step, traces on (runs: {runs('on')}) | {r['s_per_step']['on']:.3f} |",
        f"| quickstart s/step, traces off (runs: {runs('off')}) | {r['s_per_step']['off']:.3f} |",
        f"| **trace work / s per step** | **{r['share_of_step']:.2%}** ({'holds' if r['holds'] else 'misses'}) |",
        f"| s/step on / off (end to end, within run-to-run noise) | {r['on_over_off']:.3f} |",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="quickstart runs with traces on, and off, each")
    parser.add_argument("--steps", type=int, default=40, help="steps of each quickstart run")
    parser.add_argument("--write", action="store_true", help="store results/traces.json and regenerate RESULTS.md")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model = prepare_model(QUICKSTART.full.recipe)
    tokenizer = AutoTokenizer.from_pretrained(model)
    with tempfile.TemporaryDirectory() as tmp:
        orchestrator_s, trainer_s = orchestrator_cost(tokenizer, Path(tmp)), trainer_cost(Path(tmp))
    print(f"[traces] trace work a step: orchestrator {orchestrator_s * 1e3:.2f} ms, trainer {trainer_s * 1e3:.2f} ms", flush=True)
    flags = {"on": [], "off": ["--orchestrator.traces.groups", "0"]}

    def one(mode: str, seed: int) -> float:
        out = WORK / "traces" / f"{mode}-{seed}"
        curve = run_prime_rl(QUICKSTART.config, model, out, ["--max-steps", str(args.steps), "--seed", str(seed),
                                                              *flags[mode]])
        print(f"[traces] quickstart, traces {mode}, seed {seed}: {curve.profile['mean_s_per_step']:.3f} s/step", flush=True)
        return curve.profile["mean_s_per_step"]

    runs = alternating(list(flags), args.repeats, one)
    per_step = {mode: statistics.median(values) for mode, values in runs.items()}
    share = (orchestrator_s + trainer_s) / per_step["on"]
    result = {
        "steps": args.steps, "repeats": args.repeats,
        "orchestrator_ms": orchestrator_s * 1e3, "trainer_ms": trainer_s * 1e3, "s_per_step": per_step, "runs": runs,
        "share_of_step": share, "on_over_off": per_step["on"] / per_step["off"], "target": TARGET, "holds": share < TARGET,
    }
    mode = f"{args.steps} steps, {args.repeats} runs a mode"
    if args.write:
        write_part(RESULTS, "traces", mode, markdown(result), result)
    else:
        print("\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
