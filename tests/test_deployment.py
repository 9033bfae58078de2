"""Placement on one node: GPUs per process, replicas and ranks from `[deployment]`, and the
config errors that stop a bad split before anything starts."""

import json
import subprocess
import sys

import pytest

from helpers import REPO
from prime_rl.config import RLConfig
from prime_rl.deployment import PlacementError, plan_single_node, process_specs
from prime_rl.resolve import resolve
from prime_rl.settings import ConfigError, load_config


def config(**sections) -> RLConfig:
    return resolve(RLConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "batch_size": 64, **sections}))


def test_eight_gpus_split_four_and_four(tmp_path):
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 4}, inference={"port": 9000})
    placement = plan_single_node(cfg, gpus_available=8)
    assert [(r.port, r.gpus, r.url) for r in placement.replicas] == [
        (9000 + i, (i,), f"http://127.0.0.1:{9000 + i}") for i in range(4)
    ]
    assert placement.trainer.gpus == (4, 5, 6, 7) and placement.trainer.nproc_per_node == 4
    specs = {s.name: s for s in process_specs(cfg, tmp_path, placement)}
    assert specs["inference-2"].env["CUDA_VISIBLE_DEVICES"] == "2"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert specs["trainer"].argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert "CUDA_VISIBLE_DEVICES" not in specs["orchestrator"].env
    assert cfg.orchestrator.num_trainer_ranks == 4
    assert cfg.orchestrator.client.base_url == [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


def test_tensor_parallel_replicas_take_consecutive_gpus():
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 2}, inference={"tensor_parallel_size": 2})
    placement = plan_single_node(cfg, gpus_available=8)
    assert [r.gpus for r in placement.replicas] == [(0, 1), (2, 3)]
    assert placement.trainer.gpus == (4, 5)


def test_without_gpus_the_same_keys_start_cpu_processes(tmp_path):
    cfg = config(deployment={"inference_gpus": 2, "trainer_gpus": 2})
    placement = plan_single_node(cfg, gpus_available=0)
    assert placement.device == "cpu" and len(placement.replicas) == 2 and placement.trainer.world_size == 2
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in process_specs(cfg, tmp_path, placement))


def test_too_few_gpus_is_one_line():
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 4})
    with pytest.raises(PlacementError, match=r"^deployment: needs 8 GPUs \(inference_gpus 4 \+ trainer_gpus 4\), this machine shows 2$"):
        plan_single_node(cfg, gpus_available=2)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"deployment": {"inference_gpus": 3}, "inference": {"tensor_parallel_size": 2}}, "must be a multiple of inference.tensor_parallel_size"),
        ({"deployment": {"trainer_gpus": 2}, "orchestrator": {"num_trainer_ranks": 4}}, "conflicting values: `deployment.trainer_gpus` = 2"),
        ({"deployment": {"trainer_gpus": 128}}, "batch_size (64) must be at least the trainer's ranks (128)"),
        ({"deployment": {"inference_gpus": 6, "trainer_gpus": 4}, "slurm": {"gpus_per_node": 8}}, "slurm.gpus_per_node (8) is less than the 10 GPUs"),
        ({"slurm": {"nodes": 3}}, "inference_nodes: with nodes = 3, expected 1 to 2"),
        ({"slurm": {"nodes": 2, "inference_nodes": 2}}, "inference_nodes: with nodes = 2, expected 1 to 1"),
    ],
)
def test_bad_placements_fail_before_anything_starts(tmp_path, sections, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": "Qwen/Qwen3-0.6B", "batch_size": 64, **sections}))
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, [path], [])
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_wiki_search_config_dry_run_prints_its_eight_gpu_placement(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.cli", "configs/wiki-search.toml", "--dry-run", "--output-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "placement on a node with 8 GPUs (inference 4, trainer 4):" in out.stdout
    for i in range(4):
        assert f"inference replica {i}: vLLM on GPU {i}, serving http://127.0.0.1:{8000 + i}" in out.stdout
    assert "trainer: torchrun, 4 rank(s) per node on GPU 4,5,6,7 (4 FSDP2 rank(s) in all)" in out.stdout
    assert (tmp_path / "run" / "configs" / "inference-3.json").is_file()


def test_configs_that_hold_the_api_key_are_private(tmp_path):
    import stat

    cfg = config(inference={"api_key": "secret"})
    process_specs(cfg, tmp_path, plan_single_node(cfg, gpus_available=0))
    modes = {p.stem: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "configs").glob("*.json")}
    # the trainer's holds the transport's CURVE secret
    assert all(mode == 0o600 for mode in modes.values()), modes


def test_a_leftover_temporary_config_does_not_make_a_private_one_readable(tmp_path):
    import stat

    leftover = tmp_path / "configs" / "inference.json.tmp"  # a crash between write and rename
    leftover.parent.mkdir()
    leftover.write_text("{}")
    leftover.chmod(0o644)
    cfg = config(inference={"api_key": "secret"})
    process_specs(cfg, tmp_path, plan_single_node(cfg, gpus_available=0))
    assert stat.S_IMODE((tmp_path / "configs" / "inference.json").stat().st_mode) == 0o600


def test_gpus_index_the_ones_this_launcher_was_given(tmp_path, monkeypatch):
    """Under SLURM the job's GPUs are whatever it allocated: processes get those, split."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9,11,13,15,17")
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 4})
    specs = {s.name: s for s in process_specs(cfg, tmp_path, plan_single_node(cfg, gpus_available=8))}
    assert specs["inference-1"].env["CUDA_VISIBLE_DEVICES"] == "5"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "11,13,15,17"
