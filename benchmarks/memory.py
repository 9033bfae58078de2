"""Peak trainer memory per token on CPU, measured, against the estimate `--dry-run` prints.

    python -m benchmarks.memory [--quick] [--write]

For three model sizes (Qwen3 architecture, random weights, no download: ~4M, ~30M and
~130M parameters) at two sequence lengths, with and without activation checkpointing, one
fresh process (forked from one that imported torch and the trainer, so each point does not
pay ~5 s of imports) runs one real trainer step (``trainer.rl.train_step``: the token-budget
micro-batches, the ``TokenHead``, the policy loss, backward, AdamW) on a micro-batch of
4 packed samples that fill the sequence length, after a warm-up step that gives AdamW its
state. Measured: the process's peak resident memory during that step (``VmHWM`` after
resetting it, Linux) above its resident memory just before, i.e. what the step adds to the
loaded weights and optimizer state: gradients, activations, the head's chunks, AdamW's
temporaries. The process runs with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor above
64 KiB is its own mapping, returned to the system when freed: the resident set then
follows the live tensors instead of glibc's heap high-water mark.

Estimated: ``prime_rl.launch.memory.trainer_memory`` for the same shape, tokens and setting, its
step part (gradients + activations + transients), which `--dry-run` adds to the weights and
optimizer state it prints. Per point: measured and estimated MiB and bytes per token, and
their ratio (issue 33 asks for 0.75-1.25). ``--quick`` runs the smallest size only (what
``tests/test_memory_estimate.py`` runs); ``--write`` stores the full table in
``benchmarks/results/memory.json``, which that test checks the estimate against.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "memory.json"

SIZES = {  # Qwen3Config fields; vocab above the byte tokenizer's so the head's chunks show
    "4M": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 1024, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048},
    "30M": {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 2048, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 8192},
    "130M": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "num_attention_heads": 12,
             "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000},
}
SEQ_LENS = {"4M": (512, 2048), "30M": (512, 2048), "130M": (512, 1024)}
BF16 = {"30M": 2048}
"""Also measured with bfloat16 compute (FSDP2 mixed precision on one rank, float32 masters) at this length."""
SAMPLES = 4
"""Samples per micro-batch: each a quarter of the sequence length, a 1:3 prompt:completion split."""


def spec(size: dict, seq_len: int, checkpointing: bool, dtype: str = "float32", threads: int = 2) -> dict:
    """One measurement's point, as ``measure`` and ``run_one`` take it."""
    return {"size": size, "seq_len": seq_len, "checkpointing": checkpointing, "dtype": dtype, "threads": threads}


def measure(specs: list[dict]) -> list[dict]:
    """Run each point in a fresh process of its own (``--measure``: a child that imports once
    and forks one process per point; see ``run_forked``); returns their JSON rows in order."""
    threads = {s["threads"] for s in specs}
    if len(threads) != 1:
        raise ValueError(f"one thread count per call, got {sorted(threads)}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(threads.pop()),
           "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--measure", json.dumps(specs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800 * len(specs))
    if done.returncode != 0:
        raise RuntimeError(f"measurement failed: {done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(specs):]]


def run_forked(specs: list[dict]) -> None:
    """In this process: import what ``run_one`` needs, then fork one child per point, which
    measures it and writes its row to a pipe (JSON); prints the rows in order. The parent
    never runs a torch operation, so no thread pool exists at a fork, and each child starts
    with only the imported modules, as a new interpreter would once it imported them."""
    import torch  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: F401

    import trainer.model, trainer.optim, trainer.rl  # noqa: E401, F401

    for point in specs:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one measurement, then out without the parent's teardown
            os.close(read)
            code = 1
            try:
                os.write(write, json.dumps(run_one(point)).encode())
                code = 0
            except Exception:  # noqa: BLE001 - a forked child reports any failure, then leaves at once
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            row = pipe.read()
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not row:
            raise RuntimeError(f"the measurement of {point} failed (exit status {os.waitstatus_to_exitcode(status)})")
        print(row.decode(), flush=True)


def resident_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts over from the current one


def batch(seq_len: int, samples: int, vocab: int, step: int):
    """``samples`` samples of seq_len / samples tokens, the first quarter of each a prompt."""
    import numpy as np

    from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, make_sample

    rng = np.random.default_rng(step)
    n = seq_len // samples
    prompt = n // 4
    out = [make_sample(rng.integers(0, vocab, n).tolist(), [0] * prompt + [1] * (n - prompt), [-3.0] * n,
                       advantage=float(rng.choice([-1.0, 1.0])), reward=0.0, policy_version=0, example_id=i)
           for i in range(samples)]
    return TrainBatch(SCHEMA_VERSION, step=step, rank=0, temperature=1.0, micro_batches=[MicroBatch(out)])


def run_one(spec: dict) -> dict:
    """In this process: build, warm up, then measure one step (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from prime_rl.config import LossConfig, ModelConfig, OptimConfig, TrainerConfig
    from trainer.model import World, prepare_model
    from trainer.optim import build_optimizer
    from trainer.rl import train_step

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    size, seq_len = spec["size"], spec["seq_len"]
    config = Qwen3Config(**size, tie_word_embeddings=False, max_position_embeddings=max(4096, seq_len), pad_token_id=0)
    model_cfg = ModelConfig(name="random", dtype=spec["dtype"], activation_checkpointing=spec["checkpointing"])
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = prepare_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"),
                          model_cfg, world)
    # importance "none": the made-up sampling logprobs must not mask tokens out of the loss
    cfg = TrainerConfig(model=model_cfg, seq_len=seq_len, micro_batch_tokens=seq_len, optim=OptimConfig(lr=1e-6),
                        loss=LossConfig(importance="none"))
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    train_step(model, optimizer, scheduler, batch(64, 2, size["vocab_size"], 0), cfg, world)  # AdamW's state exists
    gc.collect()
    before = resident_kib("VmRSS")
    reset_peak()
    stats = train_step(model, optimizer, scheduler, batch(seq_len, SAMPLES, size["vocab_size"], 1), cfg, world)
    peak = resident_kib("VmHWM")
    params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
    return {"params": params, "seq_len": seq_len, "checkpointing": spec["checkpointing"], "dtype": spec["dtype"],
            "tokens": int(stats["tokens"]),
            "loss_tokens": int(stats["loss_tokens"]), "step_peak_mib": (peak - before) / 1024}


def estimate(size: dict, seq_len: int, checkpointing: bool, dtype: str = "float32") -> float:
    """The estimate's step part (MiB) for one measured point."""
    from prime_rl.launch.memory import ModelShape, TrainerSetting, trainer_memory

    shape = ModelShape.from_config({**size, "tie_word_embeddings": False})
    setting = TrainerSetting(ranks=1, compute_dtype=dtype, micro_batch_tokens=seq_len, checkpointing=checkpointing,
                             attention="sdpa", row_tokens=seq_len // SAMPLES, loss_fraction=0.75, device="cpu")
    return trainer_memory(shape, setting).step_bytes / 2**20


def points(names: list[str]) -> list[tuple[str, int, bool, str]]:
    """(size, seq_len, checkpointing, compute dtype) of each measurement."""
    out = [(n, L, ac, "float32") for n in names for L in SEQ_LENS[n] for ac in (False, True)]
    return out + [(n, BF16[n], ac, "bfloat16") for n in names if n in BF16 for ac in (False, True)]


def table(names: list[str]) -> list[dict]:
    rows = []
    todo = points(names)
    measured = measure([spec(SIZES[name], seq_len, checkpointing, dtype) for name, seq_len, checkpointing, dtype in todo])
    for (name, seq_len, checkpointing, dtype), one in zip(todo, measured):
        row = {"size": name, **one}
        row["estimate_mib"] = estimate(SIZES[name], seq_len, checkpointing, dtype)
        row["ratio"] = row["estimate_mib"] / row["step_peak_mib"]
        rows.append(row)
        print(f"[memory] {name} {dtype} seq_len {seq_len} checkpointing {checkpointing}: measured "
              f"{row['step_peak_mib']:.0f} MiB ({row['step_peak_mib'] * 2**20 / row['tokens']:.0f} B/token), "
              f"estimate {row['estimate_mib']:.0f} MiB, ratio {row['ratio']:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest size only")
    parser.add_argument("--write", action="store_true", help=f"store the table in {RESULTS.relative_to(REPO)}")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # points, each in a fork of this process (a child of table())
    args = parser.parse_args(argv)
    if args.measure:
        run_forked(json.loads(args.measure))
        return 0
    rows = table(["4M"] if args.quick else list(SIZES))
    if args.write:
        write(rows)
    return 0


def markdown(rows: list[dict]) -> list[str]:
    """The RESULTS.md section: one line per measured point."""
    lines = ["Peak memory of one trainer step above the loaded weights and AdamW state, measured on CPU (peak resident "
             "set, `benchmarks/memory.py`), against the estimate `--dry-run` prints (`prime_rl.launch.memory`); micro-batches "
             "of 4 samples filling the sequence length.", "",
             "| model | params | compute | tokens | checkpointing | measured MiB | bytes/token | estimate MiB | estimate/measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['params']:,} | {r.get('dtype', 'float32')} | {r['tokens']:,} | "
                     f"{'on' if r['checkpointing'] else 'off'} | {r['step_peak_mib']:.0f} | "
                     f"{r['step_peak_mib'] * 2**20 / r['tokens']:,.0f} | {r['estimate_mib']:.0f} | {r['ratio']:.2f} |")
    return lines


def write(rows: list[dict]) -> None:
    """results/memory.json (what tests/test_memory_estimate.py checks today's estimate against) and RESULTS.md."""
    import platform
    import time

    from benchmarks import run as bench

    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 2}
    data = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": "one fresh process per point", "machine": machine,
            "sizes": SIZES, "rows": rows, "lines": markdown(rows)}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    bench.write_results_md(RESULTS.parent)


if __name__ == "__main__":
    raise SystemExit(main())
