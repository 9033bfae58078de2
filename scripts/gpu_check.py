"""The trainer's CUDA path at the size the documented 8-GPU run trains, in one short run.

    bash scripts/gpu_check.sh [flags]                 on a GPU machine (then torchrun over all GPUs, if several)
    python scripts/gpu_check.py [flags]               one process (GPU 0, or --device cpu --size tiny)
    torchrun --nproc-per-node N scripts/gpu_check.py --fsdp-of REPORT [flags]   FSDP2 over N GPUs
    python scripts/gpu_check.py --summary             print the report in --out; exit 1 if a check failed

A Qwen3-4B-architecture model (``configs/wiki-search.toml``'s, shape from
``prime_rl.launch.memory.KNOWN_SHAPES``) is built with random weights on the GPU (no download) and
made ready by the trainer's own code (``trainer.model.prepare_model``): float32 masters, FSDP2
mixed precision with bf16 compute, activation checkpointing, the ``TokenHead``. Steps are the
trainer's own ``trainer.rl.train_step`` on packed micro-batches of ``--micro-batch-tokens``
(8,192: the config's seq_len) holding samples of 256 to 4,096 tokens. Checks, each ok /
failed / skipped with its figures:

- ``environment``: torch, CUDA, the GPU and its memory, bf16 support;
- ``build``: the model built and prepared (parameters, seconds);
- ``head_parity``: the head's logprobs of given tokens equal those of the model's full logits
  (bf16 compute both; a bf16-sized tolerance);
- ``steps``: one optimizer step, then ``--steps`` timed ones: seconds per step, tokens/s,
  MFU (6 x parameters x tokens/s over the GPU's dense bf16 peak; activation checkpointing's
  recompute and attention not counted), peak memory; every loss and gradient norm finite;
- ``weights_move``: at ``--lr`` (1e-6, the config's) the float32 masters of a decoder layer
  changed nearly everywhere (bf16 weights would not move: issue 33);
- ``memory_estimate``: the measured peak against the estimate `--dry-run` prints
  (``prime_rl.launch.memory``), within 25%;
- ``no_checkpointing``: one step without activation checkpointing at the same micro-batches:
  its peak against the estimate (an out-of-memory is reported, not fatal);
- ``weights_save``: ``trainer.weights.save_weights`` of the bf16 weights for vLLM (gather,
  cast, write): seconds and size;
- ``fsdp`` (torchrun over several GPUs): the first step's loss on the same global batch
  equals the one-process loss to bf16 tolerance;
- ``vllm_import``: the CUDA vLLM imports (skipped where it is not installed).

Exit 0 when nothing failed. Needs only torch, transformers, safetensors and numpy of the
machine plus pydantic, msgspec and pyzmq (``bash scripts/gpu_wheels.sh`` downloads them as
wheels for a GPU machine without a package index; gpu_check.sh installs them from ``.whl/``).
On CPU (``--device cpu --size tiny``, the test) the same path runs with a tiny shape; the
CUDA-only checks are skipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from prime_rl.config import LossConfig, ModelConfig, OptimConfig, TrainerConfig  # noqa: E402
from prime_rl.launch.memory import KNOWN_SHAPES, ModelShape, TrainerSetting, trainer_memory  # noqa: E402
from prime_rl.rundir import write_json_atomic  # noqa: E402
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, make_sample  # noqa: E402
from trainer.head import HeadQuery  # noqa: E402
from trainer.model import World, prepare_model, setup_world, teardown_world  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.rl import train_step  # noqa: E402
from trainer.weights import save_weights  # noqa: E402

SIZES = {
    "4b": KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"],
    "tiny": {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "tie_word_embeddings": True},
}
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak (FLOP/s) by a substring of the CUDA device name (SXM parts)."""
CHECKS = ("environment", "build", "head_parity", "steps", "weights_move", "memory_estimate", "no_checkpointing",
          "weights_save", "fsdp", "vllm_import")
GIB = 2**30


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="4b", help="model shape (tiny: the CPU test's)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="trainer.micro_batch_tokens (and seq_len)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches' worth of tokens a step")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (configs/wiki-search.toml's)")
    p.add_argument("--peak-flops", type=float, help="dense bf16 FLOP/s of the GPU, for one not in the table")
    p.add_argument("--save-dir", type=Path, default=ROOT / "outputs" / "gpu_check", help="where weights_save writes")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check.json", help="JSON report")
    p.add_argument("--fsdp-of", type=Path, help="under torchrun: add the fsdp check to this one-process report")
    p.add_argument("--summary", action="store_true", help="only print the report in --out; exit 1 if a check failed")
    p.add_argument("--record-failure", nargs=2, metavar=("CHECK", "REASON"), help="mark CHECK failed in --out (a crash)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.micro_batches < 1:
        p.error("--steps and --micro-batches must be at least 1")
    return args


def check(status: str, reason: str = "", **figures) -> dict:
    return {"status": status, "reason": reason, **figures}


# --------------------------------------------------------------------------- the run


def build(shape: dict, device: torch.device, world: World, checkpointing: bool):
    """The random model, made ready by the trainer's own code, and its optimizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**shape, max_position_embeddings=32768, pad_token_id=0)
    with device:  # weights created where they train: 16 GB of float32 never pass through the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model_cfg = ModelConfig(name="random", dtype="bfloat16", activation_checkpointing=checkpointing)
    return prepare_model(model, model_cfg, world)


def samples(total_tokens: int, longest: int, vocab: int, seed: int, rank: int = 0, ranks: int = 1) -> list:
    """Samples of 256-4,096 tokens (at most ``longest``; a quarter of each the prompt) adding up
    to ``total_tokens``; this rank's share of them."""
    rng = np.random.default_rng(seed)
    low, high = min(256, longest // 2), min(4096, longest)
    out, used = [], 0
    while used < total_tokens:
        n = int(min(rng.integers(low, high + 1), max(16, total_tokens - used)))
        prompt = n // 4
        out.append(make_sample(rng.integers(0, vocab, n).tolist(), [0] * prompt + [1] * (n - prompt), [-3.0] * n,
                               advantage=float(rng.choice([-1.0, 1.0])), reward=0.0, policy_version=0, example_id=len(out)))
        used += n
    return out[rank::ranks]


def step_batch(args, vocab: int, step: int, world: World) -> TrainBatch:
    total = args.micro_batches * args.micro_batch_tokens
    mine = samples(total, args.micro_batch_tokens, vocab, seed=step, rank=world.rank, ranks=world.world_size)
    return TrainBatch(SCHEMA_VERSION, step=step, rank=world.rank, temperature=1.0, micro_batches=[MicroBatch(mine)])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def head_parity(model, vocab: int, device: torch.device) -> dict:
    """Logprobs of 512 positions through the head's query against the model's own full logits."""
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, 256), device=device)
    positions = torch.arange(0, 511, device=device)
    targets = ids.flatten()[1:]
    with torch.no_grad():
        scores = model(input_ids=ids, query=HeadQuery(positions, targets, temperature=1.0))["logprobs"]
        logits = model(input_ids=ids).float().flatten(0, 1)[positions]
        expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    diff = float((scores - expected).abs().max())
    ok = diff < 2e-2  # the same bf16 logits, normalised in float32 by two routes
    return check("ok" if ok else "failed", "" if ok else f"max |logprob difference| {diff:.3g} >= 0.02", max_abs_diff=diff)


def timed_steps(model, args, shape: dict, world: World, device: torch.device, steps: int, first_step: int) -> dict:
    """``steps`` optimizer steps; their seconds, tokens, losses and the peak memory above the start."""
    cfg = TrainerConfig(model=ModelConfig(name="random", dtype="bfloat16"), seq_len=args.micro_batch_tokens,
                        micro_batch_tokens=args.micro_batch_tokens, optim=OptimConfig(lr=args.lr),
                        loss=LossConfig(importance="none"))
    rows = []
    for step in range(first_step, first_step + steps):
        batch = step_batch(args, shape["vocab_size"], step, world)
        synchronize(device)
        t0 = time.perf_counter()
        stats = train_step(model, args.optimizer, args.scheduler, batch, cfg, world)
        synchronize(device)
        rows.append({"seconds": time.perf_counter() - t0, "tokens": stats["tokens"], "loss": stats["loss_sum"],
                     "grad_norm": stats["grad_norm"], "micro_batches": stats["micro_batches"]})
    return {"rows": rows}


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def estimate(shape: dict, args, checkpointing: bool, ranks: int) -> int:
    setting = TrainerSetting(ranks=ranks, compute_dtype="bfloat16", micro_batch_tokens=args.micro_batch_tokens,
                             checkpointing=checkpointing, attention="sdpa", loss_fraction=0.75,
                             row_tokens=4096, device="cuda")
    return trainer_memory(ModelShape.from_config(shape), setting).total


def run(args) -> dict:
    world = setup_world(num_threads=int(os.environ.get("OMP_NUM_THREADS", "4")))
    device = world.device if args.device != "cpu" else torch.device("cpu")
    if args.device == "cuda" and device.type != "cuda":
        raise SystemExit("--device cuda: no CUDA device")
    world = World(world.rank, world.world_size, world.local_rank, device)
    shape, cuda = SIZES[args.size], device.type == "cuda"
    report = {"size": args.size, "device": str(device), "world_size": world.world_size, "checks": {"environment": environment()}}
    checks = report["checks"]
    try:
        t0 = time.perf_counter()
        model = build(shape, device, world, checkpointing=True)
        params = sum(p.numel() for p in model.parameters())
        checks["build"] = check("ok", params=params, seconds=time.perf_counter() - t0)
        args.optimizer, args.scheduler = build_optimizer(model, OptimConfig(lr=args.lr))
        checks["head_parity"] = head_parity(model, shape["vocab_size"], device)
        before = first_layer(model)
        checks.update(steps_checks(model, args, shape, world, device, params, before))
        if world.world_size == 1:
            checks["no_checkpointing"] = no_checkpointing(model, args, shape, world, device)
            checks["weights_save"] = weights_save(model, args, device)
    except Exception as e:  # noqa: BLE001 - the report records any failure, the table shows it
        traceback.print_exc()
        failed = next((c for c in CHECKS[1:] if c not in checks), "build")
        checks[failed] = check("failed", f"{type(e).__name__}: {e}"[:500])
    finally:
        teardown_world(world)
    checks.setdefault("vllm_import", vllm_import(cuda))
    return report


def first_layer(model) -> dict[str, torch.Tensor]:
    """The float32 masters of decoder layer 0, gathered (collective) and copied to the host."""
    out = {}
    for name, tensor in model.state_dict().items():
        if ".layers.0." in name:
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            out[name] = tensor.detach().cpu().clone()
    return out


def steps_checks(model, args, shape, world, device, params, before) -> dict:
    first = timed_steps(model, args, shape, world, device, 1, first_step=0)["rows"][0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = timed_steps(model, args, shape, world, device, args.steps, first_step=1)["rows"]
    peak = peak_bytes(device)
    rows = [first, *timed]
    finite = all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    tokens = sum(r["tokens"] for r in timed) / len(timed)  # the step's, all ranks (train_step reduces them)
    tokens_per_s = tokens / seconds
    flops = peak_flops(device, args.peak_flops)
    mfu = 6 * params * tokens_per_s / world.world_size / flops if flops else None
    out = {"steps": check("ok" if finite else "failed", "" if finite else "a non-finite loss or gradient norm",
                          first_step_seconds=first["seconds"], first_loss=first["loss"], seconds_per_step=seconds,
                          tokens_per_step=tokens, tokens_per_s=tokens_per_s, mfu=mfu, peak_bytes=peak,
                          micro_batches=timed[-1]["micro_batches"], losses=[r["loss"] for r in rows])}
    after = first_layer(model)
    if world.rank == 0:
        share = sum(int((after[n] != before[n]).sum()) for n in before) / sum(t.numel() for t in before.values())
        ok = share > 0.9 and all(t.dtype == torch.float32 for t in after.values())
        out["weights_move"] = check("ok" if ok else "failed", "" if ok else f"only {share:.1%} of layer 0's masters moved",
                                    share=share, lr=args.lr, steps=len(rows))
    if peak is None:
        out["memory_estimate"] = check("skipped", "no CUDA device (the CPU's are benchmarks/memory.py's)")
    else:
        expected = estimate(SIZES[args.size], args, True, world.world_size)
        ratio = expected / peak
        ok = 0.75 <= ratio <= 1.25
        out["memory_estimate"] = check("ok" if ok else "failed", "" if ok else f"estimate / measured {ratio:.2f} outside 0.75-1.25",
                                       measured_bytes=peak, estimated_bytes=expected, ratio=ratio)
    return out


def no_checkpointing(model, args, shape, world, device) -> dict:
    if device.type != "cuda":
        return check("skipped", "no CUDA device")
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.gradient_checkpointing_disable()
    torch.cuda.reset_peak_memory_stats(device)
    expected = estimate(SIZES[args.size], args, False, world.world_size)
    try:
        row = timed_steps(model, args, shape, world, device, 1, first_step=100)["rows"][0]
    except torch.OutOfMemoryError:
        return check("ok", f"out of memory without checkpointing (estimated {expected / GIB:.1f} GiB)", estimated_bytes=expected)
    finally:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peak = peak_bytes(device)
    ratio = expected / peak
    ok = 0.75 <= ratio <= 1.25
    return check("ok" if ok else "failed", "" if ok else f"estimate / measured {ratio:.2f} outside 0.75-1.25",
                 seconds=row["seconds"], measured_bytes=peak, estimated_bytes=expected, ratio=ratio)


def weights_save(model, args, device) -> dict:
    synchronize(device)
    t0 = time.perf_counter()
    folder = save_weights(model, args.save_dir, 1, keep_last=1, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    files = list(folder.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    from safetensors import safe_open

    with safe_open(files[0], "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    ok = dtypes == {"BF16"}
    return check("ok" if ok else "failed", "" if ok else f"weights written as {sorted(dtypes)}", seconds=seconds,
                 bytes=size, folder=str(folder))


# --------------------------------------------------------------------------- context


def environment() -> dict:
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else None
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else None
    return check("ok", torch=torch.__version__, cuda=torch.version.cuda, gpu=name, gpu_bytes=memory,
                 gpus=torch.cuda.device_count() if cuda else 0, bf16=bool(cuda and torch.cuda.is_bf16_supported()),
                 transformers=importlib.metadata.version("transformers"))


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def vllm_import(cuda: bool) -> dict:
    names = importlib.metadata.packages_distributions().get("vllm", [])
    if not cuda or not names or names[0] != "vllm":
        return check("skipped", "the CUDA vllm is not installed here" if cuda else "no CUDA device")
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300)
    if done.returncode:
        return check("failed", done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else "import vllm failed")
    return check("ok", version=done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the report


def gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.1f} GiB"


def detail(name: str, c: dict) -> str:
    if c["status"] != "ok" or name in ("vllm_import",):
        return c["reason"] or c.get("version", "")
    if name == "environment":
        return (f"torch {c['torch']}, CUDA {c['cuda'] or '-'}, transformers {c['transformers']}: "
                f"{c['gpu'] or 'no GPU'} ({gib(c['gpu_bytes'])}); bf16 {c['bf16']}")
    if name == "build":
        count = f"{c['params'] / 1e9:.2f}B" if c["params"] >= 1e9 else f"{c['params'] / 1e6:.2f}M"
        return f"{count} parameters, random, float32 masters + bf16 compute, checkpointing: {c['seconds']:.1f} s"
    if name == "head_parity":
        return f"max |logprob difference| {c['max_abs_diff']:.2e} over 511 positions (bf16 logits)"
    if name == "steps":
        mfu = f"{100 * c['mfu']:.1f}%" if c["mfu"] is not None else "-"
        return (f"{c['tokens_per_step']:,.0f} tokens/step in {c['micro_batches']:.0f} micro-batches: first step "
                f"{c['first_step_seconds']:.2f} s, then {c['seconds_per_step']:.2f} s/step, {c['tokens_per_s']:,.0f} tok/s, "
                f"MFU {mfu}, peak {gib(c['peak_bytes'])}")
    if name == "weights_move":
        return f"lr {c['lr']:g}, {c['steps']} steps: {c['share']:.1%} of layer 0's float32 masters moved"
    if name in ("memory_estimate", "no_checkpointing") and "measured_bytes" in c:
        extra = f", {c['seconds']:.2f} s/step" if "seconds" in c else ""
        return f"peak {gib(c['measured_bytes'])} measured, {gib(c['estimated_bytes'])} estimated (ratio {c['ratio']:.2f}){extra}"
    if name == "weights_save":
        return f"bf16 weights gathered and written in {c['seconds']:.1f} s ({c['bytes'] / 1e9:.2f} GB)"
    if name == "fsdp":
        return f"{c['world_size']} ranks: first loss {c['loss']:.6g} vs one process {c['reference']:.6g}, {c['tokens_per_s']:,.0f} tok/s"
    return c["reason"]


def print_summary(report: dict, path: Path) -> bool:
    checks = report["checks"]
    print(f"\n== gpu_check ({report.get('size')} on {report.get('device')}) -> {path}")
    print(f"{'check':<17} {'status':<8} detail")
    for name in CHECKS:
        if name in checks:
            print(f"{name:<17} {checks[name]['status']:<8} {detail(name, checks[name])}")
    failed = any(c["status"] == "failed" for c in checks.values())
    print("result: " + ("FAILED" if failed else "ok (every check that could run passed)"), flush=True)
    return not failed


def fsdp_check(report: dict, reference: dict | None) -> dict:
    """The torchrun run's first loss against the one-process one (the same global batch)."""
    steps = report["checks"].get("steps", {})
    if steps.get("status") != "ok" or reference is None or reference["checks"].get("steps", {}).get("status") != "ok":
        return check("failed", "the sharded or the one-process steps did not run")
    loss, ref = steps["first_loss"], reference["checks"]["steps"]["first_loss"]
    ok = abs(loss - ref) <= 2e-2 * abs(ref) + 1e-3
    return check("ok" if ok else "failed", "" if ok else f"first loss {loss:.6g} on {report['world_size']} ranks vs {ref:.6g}",
                 loss=loss, reference=ref, world_size=report["world_size"], tokens_per_s=steps["tokens_per_s"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summary:
        report = json.loads(args.out.read_text()) if args.out.is_file() else None
        return 0 if report is not None and print_summary(report, args.out) else 1
    if args.record_failure:
        report = json.loads(args.out.read_text()) if args.out.is_file() else {"checks": {}}
        report["checks"].setdefault(args.record_failure[0], check("failed", args.record_failure[1]))
        write_json_atomic(args.out, report)
        return 1
    report = run(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.fsdp_of is not None:  # torchrun: one line in the one-process report
        reference = json.loads(args.fsdp_of.read_text()) if args.fsdp_of.is_file() else None
        merged = reference or {"checks": {}}
        merged["checks"]["fsdp"] = fsdp_check(report, reference)
        report, args.out = merged, args.fsdp_of
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, report)
    return 0 if print_summary(report, args.out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
