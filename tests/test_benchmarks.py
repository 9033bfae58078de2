"""benchmarks.run's arithmetic on hand-made curves, its RESULTS.md, and (slow) a --quick run."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
from helpers import REPO

from benchmarks import run as bench


def curve(system, times, rewards, wall=100.0):
    return bench.Curve(system, times, rewards, wall)


MODE = bench.Mode(steps=6, repeats=1, targets=(0.5,), budgets_s=(25.0, 40.0))


def test_figures_of_one_curve_by_hand():
    c = curve("prime-rl", [20, 22, 24, 27, 29, 31], [0.1, 0.3, 0.5, 0.7, 0.9, 0.9])
    f = bench.figures(c, MODE)
    # trailing 5-step means: 0.1, 0.2, 0.3, 0.4, 0.5, 0.66 -> first >= 0.5 at step 4 (t = 29), 5 steps trained
    assert f["time_to_0.5_s"] == 29 and f["steps_to_0.5"] == 5
    assert f["startup_s"] == 20 and f["wall_s"] == 100.0
    assert f["s_per_step"] == 2.25  # after step 1: (31 - 22) / 4 steps
    assert f["reward_at_25_s"] == pytest.approx(0.3)  # the 5-step mean at t = 24, the last step <= 25 s
    assert f["reward_at_40_s"] == pytest.approx(0.66)  # every step within 40 s: the last one's
    assert f["reward_first5"] == pytest.approx(0.5) and f["reward_last5"] == pytest.approx(0.66)
    never = bench.figures(curve("trl", [30, 31, 32], [0.1, 0.1, 0.1]), MODE)
    assert never["time_to_0.5_s"] is None and never["steps_to_0.5"] is None and never["reward_at_25_s"] is None


def test_summary_takes_medians_over_repeats_and_ratios_of_medians():
    curves = {
        "prime-rl": [curve("prime-rl", [10, 11, 12, 13], [0.6] * 4, wall=40), curve("prime-rl", [12, 13, 14, 15], [0.6] * 4, wall=44)],
        "trl": [curve("trl", [5, 7, 9, 11], [0.4] * 4, wall=20), curve("trl", [5, 7, 9, 11], [0.4] * 4, wall=20)],
    }
    summary = bench.summarize(curves, MODE)
    wall = summary["figures"]["prime-rl"]["wall_s"]
    assert (wall["median"], wall["min"], wall["max"], wall["n"]) == (42, 40, 44, 2)
    assert summary["ratios"]["wall_s prime-rl/trl"] == pytest.approx(42 / 20)
    assert summary["ratios"]["s_per_step prime-rl/trl"] == pytest.approx(1 / 2)  # (13 - 11) / 2 vs (11 - 7) / 2
    assert summary["ratios"]["time_to_0.5_s prime-rl/trl"] is None  # the peer never reached it


def test_steps_to_a_reward_are_medians_over_seeds_with_their_range():
    # 5-step means first >= 0.5 after 1, 2 and 4 steps; the peer's after 5 in each run
    ours = [[0.5] * 5, [0.0, 1.0, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 2.0, 0.5]]
    curves = {"prime-rl": [curve("prime-rl", [10, 11, 12, 13, 14], r) for r in ours],
              "trl": [curve("trl", [5, 6, 7, 8, 9], [0.0, 0.0, 0.0, 0.0, 2.5]) for _ in range(3)]}
    summary = bench.summarize(curves, MODE)
    steps = summary["figures"]["prime-rl"]["steps_to_0.5"]
    assert (steps["median"], steps["min"], steps["max"], steps["n"]) == (2, 1, 4, 3)
    assert summary["figures"]["prime-rl"]["time_to_0.5_s"]["median"] == 11
    assert summary["ratios"]["steps_to_0.5 prime-rl/trl"] == pytest.approx(2 / 5)
    assert summary["ratios"]["time_to_0.5_s prime-rl/trl"] == pytest.approx(11 / 9)
    one_of_three = {"prime-rl": [curve("prime-rl", [1, 2], [0.9, 0.9]), *[curve("prime-rl", [1, 2], [0.1, 0.1])] * 2]}
    cell = bench.cell(bench.summarize({**one_of_three, "trl": curves["trl"]}, MODE)["figures"]["prime-rl"]["time_to_0.5_s"])
    assert cell == "1 (1 of 3 reached)"  # a median over the seeds that reached it says how many did


def test_both_systems_get_the_repeats_seed():
    """Repeat i's flags give prime-rl's data order, trainer and vLLM seed i, and the peer's
    reading of the same config (benchmarks.trl_grpo: the orchestrator's seed) too."""
    from prime_rl.config import RLConfig
    from prime_rl.launch.resolve import resolve
    from prime_rl.settings import load_config

    flags = bench.repeat_flags(steps=3, seed=2)
    cfg = resolve(load_config(RLConfig, [REPO / bench.QUICKSTART.config], flags))
    assert (cfg.orchestrator.seed, cfg.trainer.seed, cfg.inference.seed, cfg.orchestrator.max_steps) == (2, 2, 2, 3)


def test_results_md_lists_every_results_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    curves = {"prime-rl": [curve("prime-rl", [10, 11, 12, 13, 14], [0.6] * 5)], "trl": [curve("trl", [5, 6, 7, 8, 9], [0.4] * 5)]}
    data = {"date": "2026-11-30 12:00", "mode": "quick", "machine": {"cpus": 2}, **bench.summarize(curves, MODE)}
    (results / "quickstart.json").write_text(json.dumps(data))
    md = bench.write_results_md(results)
    assert md == tmp_path / "RESULTS.md"
    text = md.read_text()
    assert "## quickstart" in text and "| wall_s | 100 | 100 |" in text and "| time_to_0.5_s | 10 | not reached |" in text
    assert "| s_per_step prime-rl/trl | 1.00 |" in text and "results/quickstart.png" in text


def test_profile_of_hand_made_metrics_rows():
    from benchmarks.profile import cores_between, run_profile

    t0 = 1000.0
    trainer = [  # step 0 waited 40 s for its batch (start-up), then steps every 2 s
        {"process": "trainer", "step": 0, "wall": t0 + 50, "time/step": 45, "time/wait_batch": 40, "time/train": 4, "time/save_weights": 0.1},
        *({"process": "trainer", "step": i, "wall": t0 + 50 + 2 * i, "time/step": 2, "time/wait_batch": 0.5,
           "time/train": 1.4, "time/save_weights": 0.1} for i in (1, 2, 3)),
    ]
    orch = [{"process": "orchestrator", "step": i, "reward/mean": 0.5, "time/step": 2.0, "time/generate": 1.5,
             "time/wait_weights": 0.2, "time/reload": 0.1, "perf/tokens_per_s": 1000.0} for i in range(4)]
    orch[0]["startup/server_ready_unix"] = t0 + 35
    samples = [(50.0, {"trainer": 10.0, "vllm_worker": 20.0}), (52.0, {"trainer": 11.0, "vllm_worker": 22.0}),
               (56.0, {"trainer": 13.0, "vllm_worker": 26.0})]
    assert cores_between(samples, 52, 56) == {"trainer": 0.5, "vllm_worker": 1.0}
    p = run_profile(trainer + orch, t0, samples)
    assert p["startup/inference_ready_s"] == 35
    assert p["startup/trainer_ready_s"] == 5  # 50 - 45: it then waited 40 s
    assert p["startup/first_batch_s"] == 45 and p["startup/first_step_s"] == 50
    assert p["mean_s_per_step"] == 2  # walls 52 -> 56 over 2 steps
    assert p["trainer/train_s"] == 1.4 and p["trainer/wait_batch_s"] == 0.5
    assert p["orchestrator/rest_s"] == pytest.approx(0.2) and p["orchestrator/tokens_per_s"] == 1000
    assert p["handoff_share"] == pytest.approx((0.1 + 0.1) / 2)
    assert p["cores/trainer"] == 0.5 and p["cores/vllm_worker"] == 1.0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the peer is in the `bench` group: uv sync --group bench")
def test_quick_benchmark_runs_and_writes_well_formed_results():
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = REPO / "outputs" / "bench" / "results"  # a quick run leaves benchmarks/ as committed
    data = json.loads((results / "quickstart.json").read_text())
    assert set(data["figures"]) == {"prime-rl", "trl"}
    for system, runs in data["curves"].items():
        assert len(runs[0]["rewards"]) == bench.QUICKSTART.quick.steps, system
        assert runs[0]["times"] == sorted(runs[0]["times"]) and 0 < runs[0]["times"][0] < runs[0]["wall_s"]
    assert all(isinstance(v, float) for k, v in data["ratios"].items() if not k.startswith("time_to_"))  # a smoke run need not reach a target
    profile = data["profile"]
    assert {"cores/trainer", "cores/vllm_worker", "startup/inference_ready_s", "handoff_share"} <= set(profile)
    assert 0 < profile["startup/inference_ready_s"]["median"] < profile["startup/first_step_s"]["median"]
    overheads = data["overheads"]
    for key in ("transport share of step", "trainer step / bare loop step", "orchestrator tokens/s / vLLM alone"):
        assert isinstance(overheads[key], float) and overheads[key] > 0, key
    assert (results / "quickstart.png").stat().st_size > 0
    heavy = json.loads((results / "generation-heavy.json").read_text())
    assert len(heavy["curves"]["trl"][0]["rewards"]) == bench.GENERATION_HEAVY.quick.steps
    assert all(tokens > 16 for c in heavy["curves"].values() for tokens in c[0]["completion_tokens"])  # long replies
    (point,) = json.loads((results / "scaling.json").read_text())["scaling"].values()
    assert point["prime-rl/s_per_step"] > 0 and point["trl/s_per_step"] > 0 and point["prime-rl/completion_tokens"] > 8
    text = (results.parent / "RESULTS.md").read_text()
    assert all(f"## {name}" in text for name in ("quickstart", "generation-heavy", "scaling"))


def test_scaling_flags_are_a_valid_config_for_both_systems():
    from prime_rl.config import RLConfig
    from prime_rl.settings import load_config

    for group, tokens in bench.SCALING_FULL:
        cfg = load_config(RLConfig, [REPO / bench.QUICKSTART.config], bench.scaling_flags(group, tokens, steps=5))
        orch = cfg.orchestrator
        assert (orch.rollouts_per_example, orch.sampling.max_tokens, orch.max_steps) == (group, tokens, 5)
        assert orch.batch_size == bench.SCALING_PROMPTS * group
        assert orch.batch_size % orch.micro_batch_size == 0  # the peer's gradient accumulation needs it
        assert cfg.trainer.seq_len >= tokens + 64  # room for the prompt


def test_results_md_renders_the_scaling_sweep(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    point = {"group": 4, "max_tokens": 16, "completions_per_step": 64, "prime-rl/s_per_step": 0.5,
             "prime-rl/completion_tokens": 15.5, "trl/s_per_step": 0.25, "trl/completion_tokens": 16.0,
             "s_per_step prime-rl/trl": 2.0}
    data = {"date": "2026-12-01 12:00", "mode": "quick", "machine": {"cpus": 2}, "scaling": {"group_4_tokens_16": point}}
    (results / "scaling.json").write_text(json.dumps(data))
    text = bench.write_results_md(results).read_text()
    assert "## scaling" in text and "| 4 | 16 | 64 | 0.5 | 0.25 | 2 | 15.5, 16 |" in text


def test_targets_table_says_which_targets_hold(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    mode = bench.Mode(steps=6, repeats=1, targets=(0.85,), budgets_s=(25.0,))
    curves = {"prime-rl": [curve("prime-rl", [10, 11, 12, 13, 14, 15], [0.5, 0.5, 0.5, 0.5, 0.5, 2.3])],
              "trl": [curve("trl", [5, 7, 9, 11, 13, 15], [0.4, 0.4, 0.4, 0.4, 0.4, 3.0])],
              bench.WARM: [curve(bench.WARM, [4, 5, 6, 7, 8, 9], [0.5, 0.5, 0.5, 0.5, 0.5, 2.3])]}
    data = {"date": "d", "mode": "m", "machine": {}, **bench.summarize(curves, mode),
            "overheads": {"handoff share of step": 0.005, "transport share of step": 0.02,
                          "trainer step / bare loop step": 1.2, "orchestrator tokens/s / vLLM alone": 0.5,
                          "s_per_step / machine limit": 1.05}}
    (results / "quickstart.json").write_text(json.dumps(data))
    rows = {name: (value, holds) for name, value, holds in bench.targets(results)}
    find = lambda start: next(v for k, v in rows.items() if k.startswith(start))  # noqa: E731
    # 5-step means reach 0.85 at the last step: 15 s (prime-rl), 15 s (trl), 9 s (warm); 6 steps each
    assert find("quickstart: time to") == (pytest.approx(1.0), True)
    assert find("quickstart, warm inference server: time to") == (pytest.approx(9 / 15), True)
    assert find("quickstart: steps to") == (pytest.approx(1.0), True)
    assert find("quickstart: start-up") == (pytest.approx(2.0), True)  # 10 s vs 5 s
    assert find("quickstart, warm inference server: start-up") == (pytest.approx(4 / 5), True)
    assert find("quickstart: seconds per step") == (1.05, True)
    assert find("quickstart: reward gain") == (pytest.approx(0.36), True)  # 0.5 -> mean(0.5 x 4, 2.3)
    assert find("weight handoff") == (0.005, True) and find("transport") == (0.02, False)
    assert find("trainer step") == (1.2, True) and find("orchestrator >=") == (0.5, False)
    assert "| transport < 1% of a step | 0.02 | no |" in bench.write_results_md(results).read_text()
    del data["overheads"]
    (results / "quickstart.json").write_text(json.dumps(data))
    rows = {name: (value, holds) for name, value, holds in bench.targets(results)}
    assert find("quickstart: seconds per step") == (None, None)  # not measured: not judged


def test_the_warm_server_runs_get_ratios_of_their_own():
    curves = {"prime-rl": [curve("prime-rl", [10, 12, 14, 16], [0.5] * 4)],
              "trl": [curve("trl", [5, 7, 9, 11], [0.4] * 4)],
              bench.WARM: [curve(bench.WARM, [2, 3, 4, 5], [0.5] * 4)]}
    ratios = bench.summarize(curves, MODE)["ratios"]
    assert ratios["s_per_step prime-rl/trl"] == pytest.approx(1.0)
    assert ratios[f"startup_s {bench.WARM}/trl"] == pytest.approx(2 / 5)
    assert ratios[f"s_per_step {bench.WARM}/trl"] == pytest.approx(0.5)


def test_the_quoted_quickstart_figures_are_the_results_medians_and_nothing_else_changes(tmp_path):
    """README and docs quote results files (one source): each block between its markers is
    rewritten (the quickstart's medians, an ablation's table), the text around it kept;
    no markers, no change."""
    results = tmp_path / "results"
    results.mkdir()
    curves = {"prime-rl": [curve("prime-rl", [10, 11, 12, 13, 14, 15], [0.5, 0.5, 0.5, 0.5, 0.5, 0.9]),
                           curve("prime-rl", [12, 13, 14, 15, 16, 17], [0.4, 0.4, 0.4, 0.4, 0.4, 0.9])],
              "trl": [curve("trl", [5, 6, 7, 8, 9, 10], [0.4] * 6)] * 2}
    data = {"date": "2026-12-04 12:00", **bench.summarize(curves, MODE),
            "curves": {s: [bench.asdict(c) for c in runs] for s, runs in curves.items()}}
    (results / "quickstart.json").write_text(json.dumps(data))
    (results / "ablations-quickstart.json").write_text(json.dumps({"lines": ["| a | b |", "![plot](results/x.png)"]}))
    begin, end = bench.quote_markers("quickstart")
    ablation_begin, ablation_end = bench.quote_markers("ablations-quickstart")
    doc, untouched = tmp_path / "README.md", tmp_path / "other.md"
    doc.write_text(f"before\n{begin}\nold figures\n{end}\nbetween\n{ablation_begin}\nold\n{ablation_end}\nafter\n")
    untouched.write_text("no markers\n")
    bench.quote_results(results, doc, "../benchmarks/")
    bench.quote_results(results, untouched, "x")
    text = doc.read_text()
    assert text.startswith(f"before\n{begin}\nThe quickstart's RL over 2 seeds (6 steps, 2026-12-04;")
    assert "[RESULTS.md](../benchmarks/RESULTS.md#quickstart)" in text and "old figures" not in text
    assert text.endswith(f"{end}\nbetween\n{ablation_begin}\n| a | b |\n![plot](../benchmarks/results/x.png)\n{ablation_end}\nafter\n")
    # first 5: 0.5 and 0.4 (median 0.45); last 5: 0.58 and 0.5; startup 10 and 12
    assert "| reward, first 5 steps | 0.45 [0.4, 0.5] | 0.4 [0.4, 0.4] |" in text
    assert "| start-up: the command to the first trained step (s) | 11 [10, 12] | 5 [5, 5] |" in text
    assert "| gain, first 5 -> last 5 steps (median of the seeds') | +0.090 | +0.000 |" in text
    assert untouched.read_text() == "no markers\n"


def test_each_ablation_variant_changes_one_setting_of_the_shipped_config():
    from prime_rl.config import RLConfig
    from prime_rl.launch.resolve import resolve
    from prime_rl.settings import load_config

    from benchmarks import ablations

    setting = ablations.SETTINGS["quickstart"]
    shipped = resolve(load_config(RLConfig, [REPO / setting.config], [])).model_dump()

    def changed(variant):
        cfg = resolve(load_config(RLConfig, [REPO / setting.config], ablations.variant_flags(setting, variant))).model_dump()
        return {k for k in shipped if cfg[k] != shipped[k]}  # the processes' sections that differ

    assert changed("shipped") == set()
    assert changed("lr*2") == {"trainer"} and ablations.variant_flags(setting, "lr*2") == ["--trainer.optim.lr", "0.003"]
    assert ablations.variant_flags(setting, "lr/2") == ["--trainer.optim.lr", "0.00075"]
    assert changed("normalize_std") == {"orchestrator"}
    # the quickstart ships a cosine decay, alphabet-sort none: each runs the other
    assert changed("decay=none") == {"trainer"} and "decay=cosine" not in setting.variants
    assert "decay=cosine" in ablations.SETTINGS["alphabet-sort"].variants
    assert "decay=none" not in ablations.SETTINGS["alphabet-sort"].variants
    assert changed("importance=truncated") == {"trainer"} and changed("denominator=all") == {"trainer"}
    assert "orchestrator" in changed("async_level=0")
    assert changed("cpu_share_core=false") == {"inference"}
    assert changed("cpu_vllm_first=false") == {"deployment"}
    assert changed("num_threads=1") == {"trainer"}
    # both ship the default in-flight KV (recompute): each runs the other
    assert changed("inflight_kv=keep") == {"orchestrator"} and "inflight_kv=recompute" not in setting.variants
    # the quickstart ships sequence_mask, so its own variant would rerun `shipped`; alphabet-sort
    # ships the library default (token_mask)
    assert changed("importance=token_mask") == {"trainer"} and "importance=sequence_mask" not in setting.variants
    assert "importance=token_mask" not in ablations.SETTINGS["alphabet-sort"].variants
    assert "importance=sequence_mask" in ablations.SETTINGS["alphabet-sort"].variants


def test_each_ablation_setting_starts_from_its_own_environments_warm_up():
    """alphabet-sort's full run once started from the quickstart's reverse-text model (every
    reward 0): each mode names the recipe it starts from."""
    from benchmarks import ablations
    from benchmarks.batching import SETTINGS as BATCHING

    for mode in (ablations.SETTINGS["alphabet-sort"].full, ablations.SETTINGS["alphabet-sort"].quick):
        assert mode.recipe == BATCHING["multi-turn"].recipe and "alphabet-sort" in mode.recipe.data_args
    assert ablations.SETTINGS["quickstart"].full.recipe == bench.QUICKSTART.full.recipe


def test_ablation_ratios_are_over_the_shipped_variants_medians():
    from benchmarks import ablations

    mode = bench.Mode(steps=6, repeats=2, targets=(0.5,), budgets_s=(100.0,))
    slow = [curve("shipped", [10, 12, 14, 16, 18, 20], [0.0, 0.0, 0.0, 0.0, 2.5, 0.5])] * 2  # 5-step mean 0.5 at t = 18
    fast = [curve("lr*2", [10, 11, 12, 13, 14, 15], [2.5, 0.5, 0.5, 0.5, 0.5, 0.5])] * 2  # at t = 10
    summary = ablations.summarize({"shipped": slow, "lr*2": fast}, mode)
    assert summary["ratios_to_shipped"]["lr*2"]["time_to_0.5_s"] == pytest.approx(10 / 18)
    assert summary["figures"]["lr*2"]["gain"]["median"] == pytest.approx(0.5 - 0.9)


def test_alternating_runs_seed_i_of_every_name_before_seed_i_plus_1():
    calls = []
    out = bench.alternating(["a", "b"], 3, lambda name, seed: calls.append((name, seed)) or f"{name}{seed}")
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert out == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}


def test_batching_section_shows_each_figure_over_seeds_with_its_range():
    from benchmarks import batching

    spreads = {mode: {"rollouts_per_s": bench.spread([9.0, 10.0, 12.0])} for mode in batching.MODES}
    result = {"steps": 30, "repeats": 3, "medians": {m: {"rollouts_per_s": 10.0} for m in batching.MODES},
              "spreads": spreads, "ratios": {"rollouts_per_s continuous/step": 1.0}}
    lines = batching.section({"multi-turn": result})
    assert "**multi-turn** (30 steps, 3 seed(s), a run before 2026-12-05)" in lines
    assert "| rollouts_per_s | 10 [9, 12] | 10 [9, 12] |" in lines


def test_batching_section_shows_serving_alone_when_measured():
    from benchmarks import batching

    result = {"steps": 30, "repeats": 3, "medians": {m: {"rollouts_per_s": 10.0} for m in batching.MODES},
              "ratios": {"rollouts_per_s continuous/step": 0.9},
              "serving": [{"sequences": 8, "tokens_per_s": 1440.0, "tokens_per_s_per_sequence": 180.0}]}
    lines = batching.section({"long-tail-disjoint": result})
    assert "| 8 | 1.44e+03 | 180 |" in lines


def test_batching_figures_bound_rollouts_by_the_trainer_alone(tmp_path):
    """The trainer limit: the steady steps' rollouts over their training seconds (step 0 carries start-up)."""
    from benchmarks import batching

    rows = [{"process": "trainer", "step": s, "wall": 100.0 + 5 * s, "perf/samples": 64, "time/train": t,
             "time/wait_batch": w, "time/step": t + w, "loss/mismatch_kl": 0.0}
            for s, t, w in ((0, 9.0, 20.0), (1, 4.0, 1.0), (2, 4.0, 1.0))]
    rows += [{"process": "orchestrator", "step": s, "reward/mean": 0.5} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    f = batching.run_figures(tmp_path, curve("prime-rl", [10, 15, 20], [0.5] * 3))
    assert f["trainer_limit_rollouts_per_s"] == pytest.approx(128 / 8.0)  # 16/s
    assert f["rollouts_per_s"] == pytest.approx(128 / 10.0)  # 2 steady steps in 10 s of wall
    assert f["trainer_idle_share"] == pytest.approx(1 / 5)


def test_the_disjoint_long_tail_target_reads_its_own_regime_and_each_schedule_variant(tmp_path):
    (tmp_path / "batching.json").write_text(json.dumps({"batching": {
        "long-tail-disjoint": {"ratios": {"rollouts_per_s continuous/step": 0.9}, "medians": {"continuous": {}}},
        "long-tail-disjoint-off-policy-2": {"ratios": {"rollouts_per_s continuous/step": 1.4}, "medians": {"continuous": {}}}}}))
    rows = {name: (value, holds) for name, value, holds in bench.targets(tmp_path)}
    assert rows["disjoint cores, long-tailed multi-turn: continuous batching >= 1.3x the rollouts/s of the step barrier"] \
        == (0.9, False)
    assert rows["disjoint cores, long-tailed multi-turn (off-policy-2): continuous batching >= 1.3x the rollouts/s of "
                "the step barrier"] == (1.4, True)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two cores to pin to one of them")
def test_pin_tree_keeps_each_process_of_a_tree_to_its_roles_cores():
    """A process whose command line names a role lands on that role's cores, every thread of
    it; a process of no listed role is left alone."""
    from benchmarks.profile import pin_tree

    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    # the roles come from the environment: a subshell bash forks for `&` carries bash's command
    # line until it execs python, and with the role's name in it pin_tree could pin it (and
    # "other" after it) before the exec
    tree = subprocess.Popen(["bash", "-c", '"$PY" -c "$CODE" "$ROLE" & "$PY" -c "$CODE" other & wait'],
                            env={**os.environ, "PY": sys.executable, "CODE": code, "ROLE": "orchestrator"})
    stop = threading.Event()
    try:
        threading.Thread(target=pin_tree, args=(tree.pid, {"orchestrator": [1]}, stop), daemon=True).start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kids = {" ".join(p.cmdline()[-1:]): p for p in psutil.Process(tree.pid).children()}
            pinned = kids.get("orchestrator")
            if pinned and all(os.sched_getaffinity(t.id) == {1} for t in pinned.threads()) and pinned.num_threads() == 2:
                break
            time.sleep(0.1)
        assert pinned is not None and {os.sched_getaffinity(t.id) == {1} for t in pinned.threads()} == {True}
        assert os.sched_getaffinity(kids["other"].pid) == os.sched_getaffinity(0)
    finally:
        stop.set()
        for p in psutil.Process(tree.pid).children():
            p.kill()
        tree.kill()
        tree.wait()


def test_the_trace_cost_target_and_its_section_read_the_traces_results(tmp_path):
    """benchmarks.traces: the share is the traces' work (orchestrator + trainer) over the traced
    runs' seconds per step; the targets table judges it against 2%."""
    from benchmarks.traces import markdown

    result = {"orchestrator_ms": 3.0, "trainer_ms": 1.0, "s_per_step": {"on": 0.4, "off": 0.39},
              "runs": {"on": [0.4, 0.41], "off": [0.39, 0.38]}, "target": 0.02}
    result.update(share_of_step=(3.0 + 1.0) / 1e3 / 0.4, on_over_off=0.4 / 0.39)
    result["holds"] = result["share_of_step"] < 0.02
    lines = markdown(result)
    assert "| **trace work / s per step** | **1.00%** (holds) |" in lines
    assert "| quickstart s/step, traces on (runs: 0.400, 0.410) | 0.400 |" in lines
    (tmp_path / "traces.json").write_text(json.dumps({"traces": result}))
    rows = {name: (value, holds) for name, value, holds in bench.targets(tmp_path)}
    assert rows["rollout traces: their work < 2% of a quickstart step (issue 37)"] == (0.01, True)


def test_the_async_gain_section_names_both_placements_and_each_gain():
    """benchmarks.async_gain's own RESULTS.md section (it is no longer part of the quickstart's run)."""
    from benchmarks.async_gain import markdown

    gain = {"shared/level_0_s_per_step": 1.4, "shared/level_1_s_per_step": 1.0, "shared/gain_0_over_1": 1.4,
            "disjoint/level_0_s_per_step": 1.2, "disjoint/level_1_s_per_step": 0.8, "disjoint/gain_0_over_1": 1.5,
            "ideal/gain": None}
    lines = markdown(gain)
    assert "`disjoint`: all of vLLM on core 0, the trainer and the orchestrator on core 1" in lines[0]
    assert "| disjoint/gain_0_over_1 | 1.5 |" in lines and "| ideal/gain | - |" in lines


def test_the_soak_figures_read_each_roles_milestones_and_its_late_slope():
    """benchmarks.soak: a trainer whose RSS grows 1 MB a step from step 500 on has a slope of
    100 MB per 100 steps over the second half; an orchestrator that stays flat, 0."""
    from benchmarks.soak import figures, slope_per_100

    assert slope_per_100([0, 100, 200], [10.0, 20.0, 30.0]) == pytest.approx((10.0, 0.0))
    # the line through (0, 10.33), (200, 30.33): residuals -1/3, 2/3, -1/3, σ = sqrt(2/9)
    assert slope_per_100([0, 100, 200], [10.0, 21.0, 30.0]) == pytest.approx((10.0, (2 / 9) ** 0.5))
    assert slope_per_100([5], [1.0]) == (0.0, 0.0)
    samples = [(float(s), s, {"trainer": (1000.0 + max(0, s - 500), 10, 4), "orchestrator": (400.0, 60, 7)})
               for s in range(0, 1001, 50)]
    got = figures(samples, 1000)
    assert got["trainer"]["rss_mb@100"] == 1000.0 and got["trainer"]["rss_mb@500"] == 1000.0
    assert got["trainer"]["rss_mb@end"] == 1500.0 and got["trainer"]["fds@end"] == 10
    assert got["trainer"]["rss_slope_mb_per_100_steps"] == pytest.approx(100.0)
    assert got["trainer"]["rss_noise_mb"] == pytest.approx(0.0, abs=1e-6)  # on its line
    assert got["orchestrator"]["rss_slope_mb_per_100_steps"] == pytest.approx(0.0, abs=1e-9)
    assert got["orchestrator"]["rss_slope_share"] == pytest.approx(0.0, abs=1e-9)


def test_the_weights_section_gives_medians_ranges_and_the_ratio_of_medians():
    from benchmarks import weights

    rows = {"tiny": {"directory": [{"trainer_s": 0.01, "load_s": 0.03, "total_s": 0.04}, {"trainer_s": 0.02, "load_s": 0.05, "total_s": 0.07}],
                     "memory": [{"trainer_s": 0.001, "load_s": 0.05, "total_s": 0.051}, {"trainer_s": 0.003, "load_s": 0.06, "total_s": 0.063}]}}
    line = weights.sizes_lines(rows)[-1]
    # totals: directory median 55 ms, memory 57 ms -> 57 / 55 = 1.04
    assert line == "| tiny | memory | 2 [1, 3] | 55 [50, 60] | 57 [51, 63] | 1.04 |", line
    runs = {"quickstart": {"memory": [{"handoff_share": 0.1, "mean_s_per_step": 1.0, "trainer/save_weights_s": 0.008,
                                       "orchestrator/reload_s": None}]}}
    assert weights.handoff_lines(runs)[-1] == "| quickstart | memory | 10 [10, 10] % | 1 [1, 1] | 8 [8, 8] | - |"


def test_the_warmup_seeds_give_the_start_range_and_the_median_gain(tmp_path):
    """benchmarks.warmup: the warm-up's figures from its metrics, the start reward's range and
    the median gain over seeds, judged by the targets table (<= 0.03, >= +0.20)."""
    from benchmarks.warmup import markdown, summarize, warmup_figures

    rows = [{"step": i + 1, "loss/sft": 3.0 if i < 20 else 2.0, "time/step": 0.5} for i in range(60)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    # the last 50 steps: 40 at 2.0 and 10 at 3.0
    assert warmup_figures(tmp_path) == {"sft_steps": 60, "sft_s": 30.0, "sft_last_loss": pytest.approx(2.2)}
    seed = lambda first, last: {"reward_first5": first, "reward_last5": last, "gain": last - first, "steps_to_0.85": None}  # noqa: E731
    result = summarize([seed(0.64, 0.99), seed(0.66, 0.97), seed(0.62, 0.9)], 120)
    assert result["start_range"] == pytest.approx(0.04) and result["median_gain"] == pytest.approx(0.31)
    assert result["spread"]["reward_first5"] == {"median": 0.64, "min": 0.62, "max": 0.66, "n": 3, "of": 3}
    lines = markdown(result)
    assert "| 2 | 0.62 | 0.9 | 0.28 | - |" in lines and lines[-1].startswith("Start reward (first 5 steps) range 0.040")
    (tmp_path / "warmup.json").write_text(json.dumps({"warmup": result}))
    judged = {name: (value, holds) for name, value, holds in bench.targets(tmp_path)}
    assert judged["quickstart from scratch: start reward (first 5 steps) varies by <= 0.03 across seeds"] == (pytest.approx(0.04), False)
    assert judged["quickstart from scratch: median reward gain, first 5 -> last 5 steps >= +0.20"] == (pytest.approx(0.31), True)


def test_trl_schedule_maps_the_trainers_decay_and_refuses_what_transformers_cannot_match():
    from prime_rl.config import OptimConfig

    from benchmarks.trl_grpo import trl_schedule

    assert trl_schedule(OptimConfig(decay="none")) == {"lr_scheduler_type": "constant"}
    assert trl_schedule(OptimConfig(decay="cosine", min_lr_ratio=0.1)) == {
        "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    assert trl_schedule(OptimConfig(decay="linear")) == {"lr_scheduler_type": "linear"}
    with pytest.raises(SystemExit, match="warmup_steps = 5 has no matching transformers schedule"):
        trl_schedule(OptimConfig(decay="cosine", warmup_steps=5))
    with pytest.raises(SystemExit, match="linear decay to a floor above 0"):
        trl_schedule(OptimConfig(decay="linear", min_lr_ratio=0.1))
