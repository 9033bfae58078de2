"""Ablation of the off-policy correction (`[trainer.loss] importance`) on the quickstart task.

Runs the reverse-text RL config (the tiny model after its SFT warm-up: `bash
scripts/quickstart.sh` first) once per mode at a large off-policy gap (`async_level` 4), one
run after the other, then writes the reward curves to a PNG and prints a table.

    uv run --with matplotlib python scripts/ablate_importance.py [--max-steps 120] [--async-level 4]
        [--modes none token_mask sequence_mask truncated] [--out docs/importance_ablation.png]
    uv run --with matplotlib python scripts/ablate_importance.py --plot-only   (re-plot finished runs)

Runs go to outputs/ablation/<mode>/ (replaced on each invocation).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from prime_rl.rundir import metrics_path, read_jsonl

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "token_mask", "sequence_mask", "truncated")


def run_dir(mode: str) -> Path:
    return REPO / "outputs" / "ablation" / mode


def train(mode: str, max_steps: int, async_level: int) -> None:
    cmd = [sys.executable, "-m", "prime_rl.cli", "configs/reverse-text/rl.toml", "--no-tmux", "--clean",
           "--output-dir", str(run_dir(mode)), "--max-steps", str(max_steps), "--async-level", str(async_level),
           "--trainer.loss.importance", mode]
    print(f"== {mode}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def curves(mode: str) -> dict[str, list[float]]:
    rows = read_jsonl(metrics_path(run_dir(mode)))
    orch = sorted((r for r in rows if r.get("process") == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])
    trainer = sorted((r for r in rows if r.get("process") == "trainer" and "loss/mismatch_kl" in r), key=lambda r: r["step"])
    return {
        "reward": [r["reward/mean"] for r in orch],
        "staleness": [r["staleness/mean"] for r in orch],
        "mismatch_kl": [r["loss/mismatch_kl"] for r in trainer],
        "masked_frac": [r["loss/masked_frac"] for r in trainer],
    }


def mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


def smooth(xs: list[float], k: int = 5) -> list[float]:
    return [mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def report(modes: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    print("| importance | reward first 5 | reward last 5 | mean staleness | mismatch KL (mean) | masked tokens (mean) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        c = curves(mode)
        ax.plot(smooth(c["reward"]), label=mode)
        print(f"| {mode} | {mean(c['reward'][:5]):.3f} | {mean(c['reward'][-5:]):.3f} | {mean(c['staleness']):.2f} | "
              f"{mean(c['mismatch_kl']):.2e} | {mean(c['masked_frac']):.4f} |")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (5-step moving average)")
    ax.set_title("reverse-text, tiny model, async_level 4: off-policy correction")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--async-level", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "importance_ablation.png")
    parser.add_argument("--plot-only", action="store_true", help="plot runs already in outputs/ablation/")
    args = parser.parse_args()
    if not args.plot_only:
        for mode in args.modes:
            train(mode, args.max_steps, args.async_level)
    report(args.modes, args.out)


if __name__ == "__main__":
    main()
