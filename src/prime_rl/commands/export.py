"""`prime-rl export RUN_DIR`: a run's `weights/step_N` as a folder of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prime_rl.launch.resolve import checked_model_path
from prime_rl.rundir import complete_steps, weights_dir, weights_step_dir
from prime_rl.settings import ConfigError


def main(argv: list[str]) -> int:
    """`prime-rl export`: a run's `weights/step_N` as a folder of its own (the merged model or
    the LoRA adapter); the work runs in `trainer.export`, which imports torch."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="prime-rl export",
        description="Write a run's weights/step_N as a standalone folder: with LoRA the PEFT adapter, or with "
        "--merge the base model with the adapter merged in (an HF model folder); full fine-tuning weights are copied.",
    )
    parser.add_argument("run_dir", type=Path, help="the run's output_dir")
    parser.add_argument("--step", type=int, default=None, help="weights/step_N to export (default: the newest complete one)")
    parser.add_argument("--merge", action="store_true", help="merge the LoRA adapter into the base model")
    parser.add_argument("--output", type=Path, default=None, help="folder to create (default: RUN_DIR/exports/step_N[-merged])")
    parser.add_argument("--base", default=None, help="base model of the adapter, if it moved (default: the one adapter_config.json names)")
    args = parser.parse_args(argv)
    complete = complete_steps(weights_dir(args.run_dir))
    if not complete:
        raise ConfigError(f"{str(args.run_dir)!r}: no complete weights/step_N in {weights_dir(args.run_dir)} (is it a run's output_dir?)")
    step = complete[-1] if args.step is None else args.step
    if step not in complete:
        raise ConfigError(f"--step {step}: {weights_step_dir(args.run_dir, step)} is not complete; complete ones: {', '.join(map(str, complete))}")
    output = args.output or args.run_dir / "exports" / f"step_{step}{'-merged' if args.merge else ''}"
    if output.exists():
        raise ConfigError(f"--output: {str(output)!r} exists already; remove it or choose another folder")
    if args.base is not None:
        checked_model_path(args.base, "--base")
    cmd = [sys.executable, "-m", "trainer.export", str(weights_step_dir(args.run_dir, step)), str(output)]
    cmd += ["--merge"] * args.merge + (["--base", args.base] if args.base else [])
    return subprocess.call(cmd)
