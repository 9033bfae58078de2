"""The recipe's knobs, one at a time against the shipped config, over seeds (issue 36, row 4).

    uv run --group bench python -m benchmarks.ablations [--quick] [--repeats N]
        [--only quickstart,alphabet-sort] [--variants shipped,lr=2e-3,...] [--resummarize]

Each setting runs its shipped config (`shipped`) and one variant per knob, each changing one
setting by a flag: `async_level` 0 and 2, the loss denominator (`all`: every loss token,
against `informative`: those of samples with a nonzero advantage), advantages divided by
their group's standard deviation, the importance correction (each of `token_mask`,
`sequence_mask`, `truncated` and `none` but the shipped one), the learning rate (half,
1.5x and double), the lr's decay (`none` or `cosine`, whichever is not shipped), where vLLM's
engine core runs on CPU (`inference.cpu_share_core`), whether the trainer and the
orchestrator leave vLLM a core while it starts (`deployment.cpu_vllm_first`), the
trainer's threads (`trainer.num_threads` 1 against 2), and what sequences frozen by an
in-flight reload do with their KV (`orchestrator.client.inflight_kv`, whichever is not
shipped). Repeat i of
every variant runs with seed i (data order, the trainer's and vLLM's sampling), the
variants alternating within each repeat so drift in the machine's speed hits all alike; all
start from the same SFT'd model (``benchmarks.run.prepare_model``). Settings:

- `quickstart`: `configs/reverse-text/rl.toml` (60 steps), the quickstart's model;
- `alphabet-sort`: `configs/alphabet-sort/rl.toml` (multi-turn; 60 steps), on its SFT
  warm-up (``benchmarks.batching``'s recipe).

Per run, from the command's start (``benchmarks.run.figures``): the time and the steps to
each target reward (first 5-step mean at or above it), the reward at wall-clock budgets, the
reward of the first and last 5 steps and their gain, seconds per step, start-up. Each
figure is the median over repeats with its range; ratios are each variant's median over
the shipped one's. Writes `benchmarks/results/ablations-<setting>.json` (with `--label L`,
`ablations-<setting>-L.json`, for a follow-up of a few variants; a quick run:
`outputs/bench/results/`), a plot of every run's reward against wall-clock time, and
regenerates RESULTS.md. What the shipped defaults are, and why, is docs/benchmarks.md's
"The recipe".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import tomllib
from dataclasses import asdict, dataclass

from prime_rl.config import ClientConfig, LossConfig, OptimConfig

from benchmarks.batching import SETTINGS as BATCHING_SETTINGS
from benchmarks.run import (
    QUICKSTART, REPO, RESULTS, WORK, Curve, Mode, alternating, cell, figures, machine, plot_rewards, prepare_model, run_prime_rl,
    spread, write_results_md,
)

VARIANTS: dict[str, tuple[str, ...]] = {
    "shipped": (),
    "async_level=0": ("--async-level", "0"),
    "async_level=2": ("--async-level", "2"),
    "denominator=all": ("--trainer.loss.denominator", "all"),
    "normalize_std": ("--orchestrator.advantage.normalize-std", "true"),
    "importance=token_mask": ("--trainer.loss.importance", "token_mask"),
    "importance=none": ("--trainer.loss.importance", "none"),
    "importance=truncated": ("--trainer.loss.importance", "truncated"),
    "importance=sequence_mask": ("--trainer.loss.importance", "sequence_mask"),
    "cpu_share_core=false": ("--inference.cpu-share-core", "false"),
    "cpu_vllm_first=false": ("--deployment.cpu-vllm-first", "false"),
    "num_threads=1": ("--trainer.num-threads", "1"),
    "lr/2": (),  # filled per setting from its shipped lr (``lr_flags``)
    "lr*1.5": (),
    "lr*2": (),
    "decay=none": ("--trainer.optim.decay", "none"),
    "decay=cosine": ("--trainer.optim.decay", "cosine"),
    "inflight_kv=keep": ("--orchestrator.client.inflight-kv", "keep"),
    "inflight_kv=recompute": ("--orchestrator.client.inflight-kv", "recompute"),
}
"""Each variant's flags over the shipped config."""


@dataclass(frozen=True)
class Setting:
    name: str
    config: str
    full: Mode
    quick: Mode
    """Each mode names the recipe of the model it starts from (``Mode.recipe``)."""
    flags: tuple[str, ...] = ()
    """Flags every variant of the setting runs with."""

    def shipped(self, section: str) -> dict:
        """A table of the shipped config (`trainer`, `orchestrator`), as written."""
        with open(REPO / self.config, "rb") as f:
            return tomllib.load(f).get(section, {})

    @property
    def lr(self) -> float:
        """The shipped config's `trainer.optim.lr` (the lr variants halve and double it)."""
        return float(self.shipped("trainer")["optim"]["lr"])

    @property
    def variants(self) -> list[str]:
        """Every variant but the importance correction, the lr decay and the in-flight KV the
        shipped config already uses (each would rerun `shipped`)."""
        trainer, orchestrator = self.shipped("trainer"), self.shipped("orchestrator")
        importance = trainer.get("loss", {}).get("importance", LossConfig().importance)
        decay = trainer.get("optim", {}).get("decay", OptimConfig().decay)
        inflight_kv = orchestrator.get("client", {}).get("inflight_kv", ClientConfig().inflight_kv)
        shipped = (f"importance={importance}", f"decay={decay}", f"inflight_kv={inflight_kv}")
        return [v for v in VARIANTS if v not in shipped]


FIGURES = ("reward_first5", "reward_last5", "gain", "startup_s", "s_per_step")
SETTINGS = {
    s.name: s
    for s in (
        Setting("quickstart", QUICKSTART.config,
                # from the plateau warm-up RL starts at ~0.74 and passes 0.95 by step ~20 (docs/benchmarks.md)
                full=Mode(steps=60, repeats=3, targets=(0.8, 0.85, 0.9, 0.95), budgets_s=(20.0, 30.0, 60.0),
                          recipe=QUICKSTART.full.recipe),
                quick=Mode(steps=8, repeats=1, targets=(0.65,), budgets_s=(30.0,), recipe=QUICKSTART.quick.recipe)),
        Setting("alphabet-sort", "configs/alphabet-sort/rl.toml",
                full=Mode(steps=60, repeats=3, targets=(0.3, 0.35, 0.4), budgets_s=(120.0, 240.0),
                          recipe=BATCHING_SETTINGS["multi-turn"].recipe),
                quick=Mode(steps=4, repeats=1, targets=(0.3,), budgets_s=(60.0,), recipe=BATCHING_SETTINGS["multi-turn"].recipe),
                flags=("--eval.interval", "0")),  # its evaluations would take a tenth of each run
    )
}


LR_FACTORS = {"lr/2": 0.5, "lr*1.5": 1.5, "lr*2": 2.0}
"""The lr variants: the shipped config's lr times these."""


def variant_flags(setting: Setting, variant: str) -> list[str]:
    lr = ["--trainer.optim.lr", f"{setting.lr * LR_FACTORS[variant]:g}"] if variant in LR_FACTORS else []
    return [*lr, *VARIANTS[variant]]


def run_figures(curve: Curve, mode: Mode) -> dict[str, float | None]:
    f = figures(curve, mode)
    return {**f, "gain": f["reward_last5"] - f["reward_first5"]}


def measure(setting: Setting, mode: Mode, variants: list[str], repeats: int, started: float,
            first_seed: int = 0) -> dict[str, list[Curve]]:
    """Every variant ``repeats`` times (seeds from ``first_seed``), the variants alternating within a repeat."""
    model = prepare_model(mode.recipe)
    print(f"[ablations] {setting.name}: model ready ({time.time() - started:.0f} s)", flush=True)

    def one(variant: str, seed: int) -> Curve:
        out = WORK / "ablations" / setting.name / f"{variant.replace('/', '_').replace('*', 'x')}-{seed}"
        flags = ["--max-steps", str(mode.steps), "--seed", str(seed), *setting.flags, *variant_flags(setting, variant)]
        curve = run_prime_rl(setting.config, model, out, flags, system=variant)
        print(f"[ablations] {setting.name} {variant} seed {seed}: last5 {statistics.fmean(curve.rewards[-5:]):.3f} "
              f"({time.time() - started:.0f} s)", flush=True)
        return curve

    return alternating(variants, repeats, one, first_seed)


def summarize(curves: dict[str, list[Curve]], mode: Mode) -> dict:
    per_variant = {v: {key: spread([run_figures(c, mode)[key] for c in runs]) for key in run_figures(runs[0], mode)}
                   for v, runs in curves.items()}
    shipped = per_variant["shipped"]
    keys = [k for k in shipped if k.startswith(("time_to_", "steps_to_", "reward_at_"))] + ["gain", "s_per_step"]
    ratios = {v: {k: (per_variant[v][k]["median"] / shipped[k]["median"]
                      if per_variant[v][k]["median"] is not None and shipped[k]["median"] else None) for k in keys}
              for v in per_variant if v != "shipped"}
    return {"figures": per_variant, "ratios_to_shipped": ratios}


def section(setting: Setting, mode: Mode, summary: dict, seeds: str, stem: str) -> list[str]:
    """RESULTS.md lines: one row a variant, the figures as median [range]."""
    keys = [*(f"time_to_{t:g}_s" for t in mode.targets), *(f"steps_to_{t:g}" for t in mode.targets),
            *(f"reward_at_{b:g}_s" for b in mode.budgets_s), *FIGURES]
    lines = [f"`benchmarks/ablations.py`, {setting.name} (`{setting.config}`): {mode.steps} steps, {seeds} a "
             "variant, each variant one flag over the shipped config; median [min, max] over seeds, `n of m` where "
             "some seeds never reached a level.", "",
             "| variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for variant, figs in summary["figures"].items():
        lines.append(f"| {variant} | " + " | ".join(cell(figs[k], "-") for k in keys) + " |")
    lines += ["", f"![{setting.name}: reward against wall-clock time, every seed of every variant]"
                  f"(results/{stem}.png)", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ablations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, 1 seed, two variants")
    parser.add_argument("--repeats", type=int, default=None, help="seeds per variant (default: the setting's)")
    parser.add_argument("--only", default=",".join(SETTINGS), help=f"comma-separated settings (of {', '.join(SETTINGS)})")
    parser.add_argument("--variants", default=None, help=f"comma-separated variants (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--first-seed", type=int, default=0, help="the first repeat's seed (a follow-up adds seeds)")
    parser.add_argument("--label", default="", help="a name for a follow-up run (results/ablations-SETTING-LABEL.json), "
                        "which leaves the setting's main results as they are")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default: the setting's)")
    parser.add_argument("--resummarize", action="store_true", help="recompute the figures, plots and RESULTS.md from stored curves")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    chosen = [v.strip() for v in args.variants.split(",")] if args.variants else (["shipped", "lr*2"] if args.quick else None)
    for what, given, known in (("--only", names, SETTINGS), ("--variants", chosen or [], VARIANTS)):
        if unknown := [x for x in given if x not in known]:
            parser.error(f"{what}: unknown {unknown}; expected some of {list(known)}")
    if chosen is not None and "shipped" not in chosen:
        parser.error("--variants: `shipped` is needed (every ratio is over it)")
    results = WORK / "results" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    started = time.time()
    for name in names:
        setting = SETTINGS[name]
        mode = setting.quick if args.quick else setting.full
        if args.steps:
            mode = dataclasses.replace(mode, steps=args.steps)
        stem = f"ablations-{name}" + (f"-{args.label}" if args.label else "")
        path = results / f"{stem}.json"
        if args.resummarize:
            stored = json.loads(path.read_text())
            curves = {v: [Curve(**c) for c in runs] for v, runs in stored["curves"].items()}
            date, first = stored["date"], stored.get("first_seed", 0)
        else:
            curves = measure(setting, mode, chosen or setting.variants, args.repeats or mode.repeats, started, args.first_seed)
            date, first = time.strftime("%Y-%m-%d %H:%M"), args.first_seed
        repeats = len(curves["shipped"])
        seeds = f"seed {first}" if repeats == 1 else f"seeds {first}-{first + repeats - 1}"
        summary = summarize(curves, mode)
        data = {"date": date, "mode": f"{'quick' if args.quick else 'full'}: {mode.steps} steps, {seeds} a variant",
                "machine": machine(), "first_seed": first, "lines": section(setting, mode, summary, seeds, stem), **summary,
                "curves": {v: [asdict(c) for c in runs] for v, runs in curves.items()}}
        path.write_text(json.dumps(data, indent=1))
        plot_rewards({v: [(c.times, c.rewards) for c in runs] for v, runs in curves.items()},
                     results / f"{stem}.png", mode.targets, title=f"{name}: one flag over the shipped config")
        print("\n".join(data["lines"]), flush=True)
    print(f"[ablations] {write_results_md(results)} ({time.time() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
