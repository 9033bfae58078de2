"""The async gain: seconds per step at `async_level` 0 against 1 and 2, as the OS places the
processes and with generation and training on cores of their own (issue 36, row 5).

    uv run --group bench python -m benchmarks.async_gain [--write]

Each setting is a short quickstart run (``STEPS`` steps) of `prime-rl configs/reverse-text/rl.toml`
on the quickstart's model (``benchmarks.run.run_prime_rl``). `shared`: the OS places every
process on the two cores; `disjoint`: ``benchmarks.profile.DISJOINT``, all of vLLM on core 0
(its worker's OpenMP thread bound there) and the trainer (one thread) and the orchestrator
on core 1, as generation and training run on GPUs of their own.

The ideal bounds come from the component times of the shared level-0 run, where sampling
and training take turns and so are measured without each other: a step there costs
generation + training + handoff (trainer write + inference reload); with overlap (level
>= 1) it could cost as little as the larger of generation + handoff and training, so the
ideal gain is their ratio. It assumes the two halves do not slow each other down when they
overlap, which two shared cores do not grant. ``--write`` stores
`benchmarks/results/async-gain.json` and regenerates RESULTS.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.profile import DISJOINT, DISJOINT_FLAGS

STEPS = 30
LEVELS = (0, 1, 2)
PLACEMENTS = ("shared", "disjoint")


def one_run(model: Path, out: Path, level: int, placement: str) -> tuple[float, dict[str, float]]:
    """(mean seconds per step after step 1, median seconds per step of generation, training
    and the handoff) of one run."""
    from benchmarks.run import QUICKSTART, run_prime_rl  # benchmarks.run imports this module

    disjoint = placement == "disjoint"
    flags = ["--max-steps", str(STEPS), "--async-level", str(level), *(DISJOINT_FLAGS if disjoint else ())]
    p = run_prime_rl(QUICKSTART.config, model, out, flags, pin=DISJOINT if disjoint else None).profile
    return p["mean_s_per_step"], {"generate": p["orchestrator/generate_s"], "train": p["trainer/train_s"],
                                  "handoff": p["trainer/save_weights_s"] + p["orchestrator/reload_s"]}


def sweep(model: Path, work: Path) -> dict[str, float | None]:
    """Seconds per step per (placement, level), the gains of each level over level 0, and the
    ideal gain."""
    out: dict[str, float | None] = {}
    serial: dict[str, float] = {}
    for placement in PLACEMENTS:
        for level in LEVELS:
            started = time.time()
            s_per_step, parts = one_run(model, work / f"async-{placement}-{level}", level, placement)
            out[f"{placement}/level_{level}_s_per_step"] = s_per_step
            if level == 0 and placement == "shared":
                serial = parts
            print(f"[bench] async_level {level} {placement}: {s_per_step:.3f} s/step ({time.time() - started:.0f} s)", flush=True)
        for level in LEVELS[1:]:
            out[f"{placement}/gain_0_over_{level}"] = out[f"{placement}/level_0_s_per_step"] / out[f"{placement}/level_{level}_s_per_step"]
    out.update({f"level_0/{k}_s": v for k, v in serial.items()})
    out["ideal/level_0_s_per_step"] = serial["generate"] + serial["train"] + serial["handoff"]
    out["ideal/async_s_per_step"] = max(serial["generate"] + serial["handoff"], serial["train"])
    out["ideal/gain"] = out["ideal/level_0_s_per_step"] / out["ideal/async_s_per_step"]
    return out


def markdown(gain: dict[str, float | None]) -> list[str]:
    """The RESULTS.md section."""
    lines = [f"Async gain (`benchmarks/async_gain.py`, {STEPS}-step quickstart runs, one a setting): seconds per step "
             "at each `async_level`, the processes placed by the OS (`shared`) and generation and training on cores "
             "of their own (`disjoint`: all of vLLM on core 0, the trainer and the orchestrator on core 1), the gain "
             "of level 0 over 1 and 2, and the ideal gain from the component times of the shared level-0 run.", "",
             "| measure | value |", "|---|---|"]
    return lines + [f"| {k} | {'-' if v is None else f'{v:.3g}'} |" for k, v in gain.items()]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import QUICKSTART, RESULTS, WORK, prepare_model, write_part

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="store results/async-gain.json and regenerate RESULTS.md")
    args = parser.parse_args(argv)
    gain = sweep(prepare_model(QUICKSTART.full.recipe), WORK / "async-gain")
    if args.write:
        write_part(RESULTS, "async-gain", f"{STEPS} steps, one run a setting", markdown(gain), gain)
    else:
        print("\n".join(markdown(gain)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
