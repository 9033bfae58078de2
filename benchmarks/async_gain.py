"""The async gain: seconds per step at `async_level` 0 against 1 and 2, unpinned and pinned.

Each setting is a short quickstart run (``STEPS`` steps) of `prime-rl configs/reverse-text/rl.toml`.
Pinned: vLLM's worker on core 0 and every other process (trainer, orchestrator, vLLM's
API server and engine core) on core 1, set with ``cpu_affinity`` as each process
appears; unpinned: the OS places them (vLLM still binds its worker's OpenMP threads).

The ideal bounds come from the component times of the unpinned level-0 run, where
sampling and training take turns and so are measured without each other: a step there
costs generation + training + handoff (trainer write + inference reload); with overlap
(level >= 1) it could cost as little as the larger of generation + handoff and training,
so the ideal gain is their ratio. It assumes the two halves do not slow each other down
when they overlap, which two cores shared by five processes do not grant.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.profile import pin_tree, run_profile
from prime_rl.launch.launcher import die_with_parent

STEPS = 30
LEVELS = (0, 1, 2)
PIN = {"vllm_worker": [0], "vllm_api": [1], "vllm_engine": [1], "trainer": [1], "orchestrator": [1]}


def components(rows: list[dict]) -> tuple[float, dict[str, float]]:
    """(mean seconds per step after step 1, median seconds per step of generation, training
    and the handoff), from the run's profile (``benchmarks.profile.run_profile``)."""
    p = run_profile(rows, 0.0, [])
    return p["mean_s_per_step"], {"generate": p["orchestrator/generate_s"], "train": p["trainer/train_s"],
                                  "handoff": p["trainer/save_weights_s"] + p["orchestrator/reload_s"]}


def one_run(model: Path, out: Path, level: int, pinned: bool, ports: tuple[int, int]) -> tuple[float, dict[str, float]]:
    cmd = [sys.executable, "-m", "prime_rl.cli", "configs/reverse-text/rl.toml", "--model", str(model),
           "--output-dir", str(out), "--max-steps", str(STEPS), "--async-level", str(level), "--clean", "--no-tmux",
           "--inference.port", str(ports[0]), "--transport.port", str(ports[1])]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    stop = threading.Event()
    pinner = threading.Thread(target=pin_tree, args=(proc.pid, PIN, stop), daemon=True)
    if pinned:
        pinner.start()
    try:
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    finally:
        stop.set()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return components(rows)


def sweep(model: Path, work: Path, ports) -> dict[str, float | None]:
    """Seconds per step per (level, pinning), the gains against level 0 and the ideal gain.
    ``ports()`` gives a fresh (inference, transport) port pair."""
    out: dict[str, float | None] = {}
    serial: dict[str, float] = {}
    for pinned in (False, True):
        tag = "pinned" if pinned else "unpinned"
        for level in LEVELS:
            started = time.time()
            s_per_step, parts = one_run(model, work / f"async-{tag}-{level}", level, pinned, ports())
            out[f"{tag}/level_{level}_s_per_step"] = s_per_step
            if level == 0 and not pinned:
                serial = parts
            print(f"[bench] async_level {level} {tag}: {s_per_step:.3f} s/step ({time.time() - started:.0f} s)", flush=True)
        for level in LEVELS[1:]:
            out[f"{tag}/gain_0_over_{level}"] = out[f"{tag}/level_0_s_per_step"] / out[f"{tag}/level_{level}_s_per_step"]
    out.update({f"level_0/{k}_s": v for k, v in serial.items()})
    out["ideal/level_0_s_per_step"] = serial["generate"] + serial["train"] + serial["handoff"]
    out["ideal/async_s_per_step"] = max(serial["generate"] + serial["handoff"], serial["train"])
    out["ideal/gain"] = out["ideal/level_0_s_per_step"] / out["ideal/async_s_per_step"]
    return out
