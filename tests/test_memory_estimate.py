"""The memory estimate `--dry-run` prints (``prime_rl.launch.memory``), against measured CPU training steps.

- the committed table of ``python -m benchmarks.memory --write`` (three model sizes, two
  sequence lengths, with and without activation checkpointing, float32 and bf16 compute):
  today's estimate is within 25% of every measured step peak;
- the smallest size measured again here, in fresh processes (real trainer steps): within 25%
  too, and activation checkpointing lowers the peak;
- hand-computed parameter and KV-cache counts of Qwen3-4B;
- `configs/wiki-search.toml`: its trainer rank and vLLM replicas fit 80 and 141 GB GPUs;
  on a machine whose GPUs are too small the run is refused, one line per process.
"""

import json

import pytest
from helpers import REPO

from benchmarks import memory as bench
from prime_rl.config import RLConfig
from prime_rl.launch.memory import (
    GIB, KNOWN_SHAPES, ModelShape, estimate_run, lora_params, model_shape, trainer_memory, trainer_setting, vllm_memory,
)
from prime_rl.launch.resolve import resolve
from prime_rl.settings import ConfigError, load_config

WIKI_SEARCH = REPO / "configs" / "wiki-search.toml"


def test_the_committed_measurements_are_within_25_percent_of_todays_estimate():
    table = json.loads(bench.RESULTS.read_text())
    points = {(r["size"], r["seq_len"], r["checkpointing"], r.get("dtype", "float32")) for r in table["rows"]}
    assert {name for name, *_ in points} == set(bench.SIZES) and len(points) == len(table["rows"]) >= 14
    assert {dtype for *_, dtype in points} == {"float32", "bfloat16"}
    for row in table["rows"]:
        estimate = bench.estimate(table["sizes"][row["size"]], row["seq_len"], row["checkpointing"], row.get("dtype", "float32"))
        ratio = estimate / row["step_peak_mib"]
        assert 0.75 <= ratio <= 1.25, (row, estimate)


@pytest.fixture(scope="module")
def measured_here() -> dict[tuple[int, bool], dict]:
    """The smallest size's four points, measured now (a fresh process each)."""
    points = [(seq_len, ac) for seq_len in bench.SEQ_LENS["4M"] for ac in (False, True)]
    return dict(zip(points, bench.measure([bench.spec(bench.SIZES["4M"], *point) for point in points])))


def test_trainer_steps_measured_here_match_the_estimate(measured_here):
    for (seq_len, checkpointing), row in measured_here.items():
        estimate = bench.estimate(bench.SIZES["4M"], seq_len, checkpointing)
        per_token = row["step_peak_mib"] * 2**20 / row["tokens"]
        print(f"4M seq_len {seq_len} checkpointing {checkpointing}: {row['step_peak_mib']:.0f} MiB "
              f"({per_token:.0f} B/token), estimate {estimate:.0f} MiB")
        assert row["tokens"] == seq_len and row["loss_tokens"] == 3 * seq_len // 4
        assert 0.75 <= estimate / row["step_peak_mib"] <= 1.25, (seq_len, checkpointing, row, estimate)


def test_activation_checkpointing_lowers_the_measured_peak(measured_here):
    for seq_len in bench.SEQ_LENS["4M"]:
        plain, checkpointed = measured_here[(seq_len, False)], measured_here[(seq_len, True)]
        assert checkpointed["step_peak_mib"] < 0.7 * plain["step_peak_mib"], (seq_len, plain, checkpointed)
    long = bench.SEQ_LENS["4M"][-1]  # where activations dominate: each layer keeps one hidden state, not ~30
    assert measured_here[(long, True)]["step_peak_mib"] < 0.5 * measured_here[(long, False)]["step_peak_mib"]


def test_qwen3_4b_counts_by_hand():
    shape = ModelShape.from_config(KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"])
    # per layer: q, k, v, o (2560 x 4096, 2 x 2560 x 1024, 4096 x 2560) + q/k norms (2 x 128),
    # MLP 3 x 2560 x 9728, two norms; the tied embedding 151936 x 2560 and the final norm
    layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 2 * 128 + 3 * 2560 * 9728 + 2 * 2560
    assert shape.params == 36 * layer + 151936 * 2560 + 2560 == 4_022_468_096  # the model card's count
    replica = vllm_memory(shape, dtype="bfloat16", tensor_parallel=1, gpu_bytes=80 * GIB, utilization=0.9)
    assert replica.weights == 2 * 4_022_468_096
    assert replica.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2  # k and v, 36 layers, 8 KV heads of 128, bf16
    assert replica.kv_cache == int(0.9 * 80 * GIB) - 2 * 4_022_468_096 - 2 * GIB
    split = vllm_memory(shape, dtype="bfloat16", tensor_parallel=2, gpu_bytes=80 * GIB, utilization=0.9)
    assert (split.weights, split.kv_bytes_per_token) == (4_022_468_096, 36 * 8 * 128 * 2)
    # LoRA rank 16 on q and v: 36 layers x 16 x ((2560 + 4096) + (2560 + 1024))
    assert lora_params(shape, 16, ["q_proj", "v_proj"]) == 36 * 16 * (2560 + 4096 + 2560 + 1024)


def test_a_models_shape_comes_from_its_folder_the_hf_cache_or_the_published_table(tmp_path, monkeypatch):
    config = {**KNOWN_SHAPES["Qwen/Qwen3-0.6B"], "vocab_size": 1000}
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps(config))
    shape, source = model_shape(str(tmp_path / "local"))
    assert shape.vocab == 1000 and source.endswith("local/config.json")
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_shape("org/cached")[0] == shape
    assert model_shape("Qwen/Qwen3-4B-Instruct-2507")[1] == "Qwen/Qwen3-4B-Instruct-2507's published config.json"
    shape, why = model_shape("org/unknown")
    assert shape is None and "no config.json for 'org/unknown'" in why
    (snapshot / "config.json").write_text("{}")
    shape, why = model_shape("org/cached")
    assert shape is None and "KeyError" in why


def wiki_search(*flags: str) -> RLConfig:
    return resolve(load_config(RLConfig, [WIKI_SEARCH], list(flags)))


def test_wiki_search_fits_80_and_141_gb_gpus():
    estimate = estimate_run(wiki_search(), "cuda", gpu_bytes=None)
    text = "\n".join(estimate.lines)
    print(text)
    assert not estimate.problems
    assert "trainer rank (1 of 4; bfloat16 compute, float32 masters, activation checkpointing, micro-batches of 8,192 tokens)" in text
    for gpu in ("80 GB (A100/H100)", "141 GB (H200)"):
        (line,) = [x for x in estimate.lines if x.startswith(f"  on {gpu}")]
        assert "trainer rank fits" in line and "sequences of 8,192" in line
    # without activation checkpointing a rank keeps all of its 36 layers' activations, ~30 hidden
    # states' worth a token each instead of one: ~50 GiB at 8,192 tokens, and over 3x the total
    shape = model_shape("Qwen/Qwen3-4B-Instruct-2507")[0]
    checkpointed = trainer_memory(shape, trainer_setting(wiki_search(), "cuda", shape))
    plain = trainer_memory(shape, trainer_setting(wiki_search("--trainer.model.activation-checkpointing", "false"), "cuda", shape))
    assert plain.activations > 25 * checkpointed.activations and plain.total > 3 * checkpointed.total


def test_a_teacher_in_the_trainer_adds_its_weights_in_the_compute_dtype_to_every_rank():
    """`[teacher] placement = "trainer"`: Qwen3-4B beside the 4B student, whole on each of the
    4 ranks in bf16 (2 bytes a parameter); a served teacher adds nothing to the trainer."""
    teacher = ["--teacher.model", "Qwen/Qwen3-4B", "--trainer.loss.distill.kl-weight", "1"]
    alone = estimate_run(wiki_search(), "cuda", gpu_bytes=None)
    beside = estimate_run(wiki_search(*teacher, "--teacher.placement", "trainer"), "cuda", gpu_bytes=None)
    served = estimate_run(wiki_search(*teacher), "cuda", gpu_bytes=None)
    params = model_shape("Qwen/Qwen3-4B")[0].params
    assert beside.lines[1].endswith(f"+ the teacher {params * 2 / GIB:.1f} GiB ({params / 1e9:.2f}B, bfloat16)"), beside.lines[1]
    assert served.lines == alone.lines
    total = lambda est: float(est.lines[1].split("): ")[1].split(" GiB")[0])  # noqa: E731
    assert total(beside) == pytest.approx(total(alone) + params * 2 / GIB, abs=0.11)


def test_a_run_that_cannot_fit_its_gpus_is_refused_one_line_per_process(tmp_path, monkeypatch, capsys):
    import prime_rl.commands.rl as rl

    monkeypatch.setattr(rl, "count_gpus", lambda: 8)
    monkeypatch.setattr(rl, "gpu_memory_bytes", lambda: 10 * GIB)  # 10 GiB GPUs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        rl.main([str(WIKI_SEARCH), "--dry-run", "--output-dir", str(tmp_path / "run")])
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert not (tmp_path / "run").exists()  # refused before anything is written
    assert lines[0].startswith("memory: a trainer rank needs ~20.5 GiB but a GPU has 10.0 GiB: lower trainer.micro_batch_tokens")
    assert "activation_checkpointing" not in lines[0]  # on already (CUDA's default)
    assert lines[1].startswith("memory: a vLLM replica has room for 0 KV-cache tokens")
    assert "gpu_memory_utilization" in lines[1]
    # a 141 GB machine takes the run, and prints what it holds
    monkeypatch.setattr(rl, "gpu_memory_bytes", lambda: 143771 * 2**20)
    assert rl.main([str(WIKI_SEARCH), "--dry-run", "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "on this machine's GPUs (140.4 GiB): trainer rank fits" in out
