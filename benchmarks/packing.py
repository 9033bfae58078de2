"""Trainer time of one micro-batch in each row layout (`trainer.packing`), side by side.

    python -m benchmarks.packing [--repeats 7] [--write]

Micro-batches of 16 samples, two groups of 8 rollouts (the generation-heavy regime's group
size, `benchmarks/configs/generation-heavy.toml`) after ~30-token prompts:

- `generation-heavy`: completions of 100-170 tokens, uneven (that regime's lengths);
- `uneven`: completions of 10-170 tokens (short and long answers in one micro-batch).

Each layout runs the trainer's forward, loss and backward (`trainer.rl.micro_step`'s calls,
float32, `trainer.num_threads` threads on CPU) on two models built by
`scripts/build_tiny_model.py`: the tests' tiny model (its defaults) and the regime's
16M-parameter one (hidden 512, 4 layers, head dim 128). Layouts:

- `rows`: one row per sample or shared-prefix group, right-padded (`trainer.pack = false`,
  the layout before packing);
- `packed`: rows filled up to the longest block (`trainer.pack = true`, the default);
- `packed_to_seq_len`: rows filled up to seq_len (384, the regime's), the budget not taken;
- `varlen`: the one unpadded row flash-attention's variable-length kernel takes (CUDA only:
  its shape is reported, its time is not measured here).

Per layout: rows, tokens computed (padding included), real tokens, attention area (query-key
pairs computed) and the median seconds of ``--repeats`` passes, the layouts taking turns
so that load from elsewhere on the machine falls on all of them. ``--write`` stores the
table in `benchmarks/results/packing.json` and regenerates `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from prime_rl.config import LossConfig, TrainerConfig
from prime_rl.wire import MicroBatch, make_sample, sample_arrays
from trainer.data import MicroTensors, collate, model_mask
from trainer.loss import policy_loss
from trainer.head import install_token_head
from trainer.model import forward_logits
from trainer.packing import lay_out, plan_blocks, plan_rows

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 384
MODELS = {"tiny": (), "16M": ("--hidden-size", "512", "--num-layers", "4", "--head-dim", "128")}
REGIMES = {"generation-heavy": (100, 170), "uneven": (10, 170)}
"""Completion lengths, uniform in [low, high]."""


def micro_batch(completions: tuple[int, int], seed: int = 0, groups: int = 2, group_size: int = 8) -> MicroBatch:
    """``groups`` groups of ``group_size`` rollouts after a 26-34-token prompt each."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(3, 250, int(rng.integers(26, 35))).tolist()
        for _ in range(group_size):
            n = int(rng.integers(completions[0], completions[1] + 1))
            ids = prompt + rng.integers(3, 250, n).tolist()
            samples.append(make_sample(ids, [0] * len(prompt) + [1] * n, rng.normal(-2, 0.5, len(ids)).tolist(),
                                       advantage=float(rng.normal()), reward=0.0, policy_version=0, example_id=g))
    return MicroBatch(samples=samples)


def packed_to(micro: MicroBatch, budget: int, share: bool) -> MicroTensors:
    """``collate``'s packed layout with another row budget (the rest unchanged)."""
    mt = collate(micro, SEQ_LEN, 0, torch.device("cpu"), share, pack=True)
    ids, masks = zip(*((a[0][:SEQ_LEN], a[1][:SEQ_LEN]) for a in map(sample_arrays, micro.samples)))
    blocks = plan_blocks(list(ids), list(masks), share)
    layout = lay_out(list(ids), blocks, plan_rows([b.length([len(x) for x in ids]) for b in blocks], budget), 0)
    return replace(mt, model_ids=torch.from_numpy(layout.ids), model_positions=torch.from_numpy(layout.positions),
                   model_mask=model_mask(layout, torch.device("cpu")), source=torch.from_numpy(layout.source))


def layouts(micro: MicroBatch, share: bool) -> dict[str, MicroTensors]:
    cpu = torch.device("cpu")
    return {
        "rows": collate(micro, SEQ_LEN, 0, cpu, share, pack=False),
        "packed": collate(micro, SEQ_LEN, 0, cpu, share, pack=True),
        "packed_to_seq_len": packed_to(micro, SEQ_LEN, share),
        "varlen": collate(micro, SEQ_LEN, 0, cpu, share, pack=True, varlen=True),
    }
TIMED = ("rows", "packed", "packed_to_seq_len")
"""Layouts this CPU machine can run (the varlen kernel needs flash-attention on CUDA)."""


def loss_pass(model, mt: MicroTensors) -> float:
    """Seconds of one forward + loss + backward, as ``trainer.rl.micro_step`` runs them."""
    t0 = time.perf_counter()
    scores = forward_logits(model, mt.model_ids, mt.model_mask, mt.model_positions, mt.cu_seqlens, mt.max_seqlen,
                            query=mt.head_query(1.0))
    loss_mask = mt.loss_mask[:, 1:]
    lp = torch.zeros(loss_mask.shape).masked_scatter(loss_mask, scores["logprobs"])
    loss, _ = policy_loss(lp, mt.inference_logprobs[:, 1:], mt.advantages, loss_mask, LossConfig(), int(loss_mask.sum()))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def attention_area(mt: MicroTensors) -> int:
    """Query-key pairs the attention computes: every row's length squared with a mask (masked
    pairs are computed too), each sequence's length squared with the varlen kernel."""
    if mt.cu_seqlens is not None:
        return int((mt.cu_seqlens.diff().long() ** 2).sum())
    return mt.model_ids.shape[0] * mt.model_ids.shape[1] ** 2


def measure(model, micro: MicroBatch, repeats: int) -> dict[str, dict]:
    """Per layout: its shape and the median seconds over ``repeats`` turns (after a warm-up)."""
    shapes = layouts(micro, share=True)
    seconds: dict[str, list[float]] = {name: [] for name in shapes}
    for i in range(repeats + 1):
        for name in TIMED:
            s = loss_pass(model, shapes[name])
            if i > 0:
                seconds[name].append(s)
    return {name: {
        "rows": mt.model_ids.shape[0],
        "tokens_computed": mt.model_ids.numel(),
        "real_tokens": mt.num_model_tokens,
        "attention_area": attention_area(mt),
        "seconds": statistics.median(seconds[name]) if seconds[name] else None,
    } for name, mt in shapes.items()}


def build_models(root: Path) -> dict[str, Path]:
    for name, args in MODELS.items():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(root / name), *args],
                       check=True, capture_output=True)
    return {name: root / name for name in MODELS}


def run(repeats: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(TrainerConfig().num_threads)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, path in build_models(Path(tmp)).items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            install_token_head(model)  # the trainer's output layer: scores of the loss tokens only
            model.train()
            for regime, completions in REGIMES.items():
                for layout, row in measure(model, micro_batch(completions), repeats).items():
                    table.append({"model": model_name, "regime": regime, "layout": layout, **row})
                    print(json.dumps(table[-1]), flush=True)
    return table


def markdown(table: list[dict], repeats: int) -> list[str]:
    """The RESULTS.md section: one line per model, regime and layout."""
    lines = [f"Trainer forward + loss + backward of one 16-sample micro-batch per row layout (`benchmarks/packing.py`, "
             f"`trainer.packing`): tokens computed include padding; seconds are medians of {repeats} passes, the "
             "layouts taking turns; `after/before` is seconds over those of `rows` (one row per sample or group); "
             "on a shared machine absolute seconds vary between runs, the ratios within one run compare.", "",
             "| model | regime | layout | rows | tokens computed | real tokens | attention area | seconds | after/before |",
             "|---|---|---|---|---|---|---|---|---|"]
    before = {(r["model"], r["regime"]): r["seconds"] for r in table if r["layout"] == "rows"}
    for r in table:
        ratio = "-" if r["seconds"] is None else f"{r['seconds'] / before[r['model'], r['regime']]:.2f}"
        secs = "CUDA only" if r["seconds"] is None else f"{r['seconds']:.3g}"
        lines.append(f"| {r['model']} | {r['regime']} | {r['layout']} | {r['rows']} | {r['tokens_computed']} | "
                     f"{r['real_tokens']} | {r['attention_area']} | {secs} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per layout (medians)")
    parser.add_argument("--write", action="store_true", help="store results/packing.json and regenerate RESULTS.md")
    args = parser.parse_args(argv)
    table = run(args.repeats)
    if args.write:
        from benchmarks import run as bench

        results = REPO / "benchmarks" / "results"
        machine = {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__}
        data = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": f"{args.repeats} repeats", "machine": machine,
                "packing": table}
        data["lines"] = markdown(table, args.repeats)
        (results / "packing.json").write_text(json.dumps(data, indent=1))
        bench.write_results_md(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
