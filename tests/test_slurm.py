"""`prime-rl --slurm`: the rendered sbatch script and each node's processes, then real jobs on a
SLURM controller with two node daemons on this machine (scripts/slurm_local.sh)."""

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, new_tag, tagged_processes, trio_toml
from prime_rl.config import RLConfig
from prime_rl.launch.resolve import placed, resolve
from prime_rl.launch.deployment import plan_multi_node, process_specs
from prime_rl.launch.launcher import tail
from prime_rl.rundir import MARKER, log_path, metrics_path, read_jsonl, weights_step_dir
from prime_rl.launch.slurm import ADDRS_VAR, HOSTS_VAR, node_placement, prepare, render

FAKE_SCONTROL = """#!/bin/bash
# `scontrol show hostnames LIST` and `scontrol show node NAME` of a 4-node cluster a1..a4
if [ "$2" = hostnames ]; then printf 'a1\\na2\\na3\\na4\\n'; exit 0; fi
echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.${3#a} NodeHostName=$3 Version=22.05"
"""
FAKE_SRUN = """#!/bin/bash
# records each call's arguments and the node addresses it was given, then exits 0; the
# inference side (a1,a2) outlives the trainer side, as in a real job (else the script rightly
# reports that inference ended first, which made this flaky under load); the trainer side ends
# only once the inference side has logged its call, which the script's end would else kill
# before it ran under load
echo "$* | $PRIME_RL_SLURM_HOSTS | $PRIME_RL_SLURM_ADDRS" >> "$SRUN_LOG"
case "$*" in
  *--nodelist=a1,a2*) sleep 1 ;;
  *--nodelist=a3,a4*) for _ in $(seq 200); do grep -q -- "--nodelist=a1,a2" "$SRUN_LOG" && break; sleep 0.05; done ;;
esac
"""



def specs_of(cfg, run_dir, placement, **kwargs):
    """What the launch writes for ``placement``: the config placed on it, then serialized."""
    return process_specs(placed(cfg, placement), run_dir, placement, **kwargs)

def rendered_job(tmp_path, slurm: dict) -> tuple[RLConfig, str, list[str]]:
    """Render the script for ``slurm``, run it with fake scontrol/srun; returns the config,
    the script and the srun calls it made."""
    config = RLConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "output_dir": str(tmp_path / "run"), "batch_size": 64, "slurm": slurm})
    script = render(config, tmp_path / "run", tmp_path / "run" / "slurm" / "rl.json", python="/venv/python", workdir=tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "srun.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "a[1-4]", "SRUN_LOG": str(log), "SLURM_JOB_ID": "42"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return config, script, log.read_text().splitlines()


def test_one_node_job_runs_the_whole_trio_on_its_node(tmp_path):
    config, script, calls = rendered_job(tmp_path, {"nodes": 1, "gpus_per_node": 8, "partition": "gpu", "account": "rl", "time": "02:00:00"})
    for directive in ("--nodes=1", "--gpus-per-node=8", "--partition=gpu", "--account=rl", "--time=02:00:00", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}\n" in script
    assert len(calls) == 1 and calls[0].startswith("--nodes=1 --ntasks=1 /venv/python -m prime_rl.cli slurm-node "), calls
    # on the node: the single-node placement, everything on 127.0.0.1
    placement, index, _ = node_placement(config)
    specs = specs_of(config, tmp_path / "run", placement, node=index)
    assert [s.name for s in specs] == ["inference", "orchestrator", "trainer"]
    orchestrator = json.loads((tmp_path / "run/configs/orchestrator.json").read_text())
    assert orchestrator["client"]["base_url"] == f"http://127.0.0.1:{config.inference.port}"
    assert orchestrator["transport"]["host"] == "127.0.0.1" and orchestrator["transport"]["bind_host"] is None


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [
        ({"cpus_per_node": 16}, ["--cpus-per-task=16", "--exclusive", "--mem=0"]),
        ({"exclusive": False, "cpus_per_node": 16}, ["--cpus-per-task=16"]),
        ({"sbatch_args": ["--mem=200G"]}, ["--exclusive", "--mem=200G"]),
        ({"sbatch_args": ["--exclusive=user", "--mem-per-gpu 80G"]}, ["--exclusive=user", "--mem-per-gpu 80G"]),
    ],
)
def test_a_job_takes_whole_nodes_unless_told_otherwise(tmp_path, slurm, expected):
    """`exclusive` (the default) asks for whole nodes and all their memory; the user's own
    exclusivity or memory options replace ours, never sit beside them (sbatch refuses two
    memory options)."""
    config = RLConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "batch_size": 64, "slurm": {"gpus_per_node": 8, **slurm}})
    script = render(config, tmp_path / "run", tmp_path / "run" / "slurm" / "rl.json", python="/venv/python", workdir=tmp_path)
    ours = ("--cpus-per-task", "--exclusive", "--mem")
    assert [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith(tuple(f"#SBATCH {o}" for o in ours))] == expected


def test_four_node_job_splits_hosts_and_wires_addresses(tmp_path, monkeypatch):
    config, script, calls = rendered_job(tmp_path, {"nodes": 4, "inference_nodes": 2, "gpus_per_node": 8})
    # the script's host split: one srun for the inference nodes, one for the trainer nodes
    inference_call = next(c for c in calls if '--nodelist=a1,a2' in c)
    trainer_call = next(c for c in calls if '--nodelist=a3,a4' in c)
    assert inference_call.startswith("--nodes=2 --ntasks=2 ") and trainer_call.startswith("--nodes=2 --ntasks=2 ")
    assert "--kill-on-bad-exit=1" in inference_call and "--kill-on-bad-exit=1" in trainer_call
    assert all(c.endswith("| a1,a2,a3,a4 | 10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4") for c in calls), calls

    # each node's processes, as `prime-rl slurm-node` starts them there from RUN/slurm/rl.json
    monkeypatch.setenv(HOSTS_VAR, "a1,a2,a3,a4")
    monkeypatch.setenv(ADDRS_VAR, "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4")
    run_dir = tmp_path / "run"
    resolved, _ = prepare(config, run_dir, tmux=False)
    config = resolve(RLConfig.model_validate_json(resolved.read_text()))  # as node_main reads it
    port = config.inference.port
    by_node = {}
    for node in ("a1", "a2", "a3", "a4"):
        monkeypatch.setenv("SLURMD_NODENAME", node)
        placement, index, _ = node_placement(config)
        by_node[node] = {s.name: s for s in specs_of(config, run_dir, placement, node=index, job_id="42")}
    assert set(by_node["a1"]) == {f"inference-{i}" for i in range(8)}
    assert set(by_node["a2"]) == {f"inference-{i}" for i in range(8, 16)}
    assert sorted(by_node["a3"]) == ["orchestrator", "trainer"] and sorted(by_node["a4"]) == ["trainer-1"]
    # each replica binds its own node's address on its own port and sees one GPU
    replica = json.loads((run_dir / "configs/inference-9.json").read_text())
    assert (replica["host"], replica["port"]) == ("10.0.0.2", port + 1)
    assert by_node["a2"]["inference-9"].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert replica["api_key"] is None or isinstance(replica["api_key"], str)
    # the orchestrator reaches all 16 replicas and binds the batches' socket on its node
    orchestrator = json.loads((run_dir / "configs/orchestrator.json").read_text())
    expected = [f"http://10.0.0.{n}:{port + j}" for n in (1, 2) for j in range(8)]
    assert orchestrator["client"]["base_url"] == expected
    assert orchestrator["num_trainer_ranks"] == 16
    assert orchestrator["transport"]["host"] == "10.0.0.3"
    # torchrun: 2 nodes x 8 ranks, c10d rendezvous on the first trainer node
    for node, rank in (("a3", 0), ("a4", 1)):
        spec = by_node[node]["trainer" if rank == 0 else "trainer-1"]
        args = spec.argv[spec.argv.index("torch.distributed.run") + 1 :]
        assert args[:5] == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=10.0.0.3:29500", "--rdzv-id=42"], args
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    trainer = json.loads((run_dir / "configs/trainer-1.json").read_text())
    assert trainer["transport"]["host"] == "10.0.0.3"
    assert_transport_keys_pair(run_dir, ["trainer", "trainer-1"])


def assert_transport_keys_pair(run_dir: Path, trainers: list[str]) -> None:
    """Every trainer config holds the client secret and the orchestrator's public key, the
    orchestrator's its server secret and the trainer's public key, each only its own secret,
    in files only their owner reads; every node drew them from one rl.json, so they pair up."""
    import zmq

    orchestrator = json.loads((run_dir / "configs/orchestrator.json").read_text())["transport"]
    assert orchestrator["curve_client_secret"] is None and orchestrator["curve_server_public"] is None
    server_public = zmq.curve_public(orchestrator["curve_server_secret"].encode()).decode()
    for name in ["orchestrator", *trainers]:
        assert stat.S_IMODE((run_dir / f"configs/{name}.json").stat().st_mode) == 0o600, name
    for name in trainers:
        trainer = json.loads((run_dir / f"configs/{name}.json").read_text())["transport"]
        assert trainer["curve_server_secret"] is None and trainer["curve_client_public"] is None
        assert trainer["curve_server_public"] == server_public
        assert zmq.curve_public(trainer["curve_client_secret"].encode()).decode() == orchestrator["curve_client_public"]
        assert trainer["max_message_bytes"] == orchestrator["max_message_bytes"] >= 64 * 2**20


def test_a_multi_node_job_without_transport_keys_is_refused(tmp_path):
    """Keys drawn on each node would not pair up: only rl.json's (from `prepare`) may be used."""
    config = RLConfig.model_validate({"output_dir": str(tmp_path / "run"), "batch_size": 64,
                                      "slurm": {"nodes": 2, "inference_nodes": 1, "gpus_per_node": 0}})
    placement = plan_multi_node(config, ["10.0.0.1", "10.0.0.2"])
    with pytest.raises(ValueError, match="multi-node job needs the transport keys"):
        specs_of(config, tmp_path / "run", placement, node=1)


def test_memory_weight_transfer_in_a_multi_node_job_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r'weight_transfer.mode = "memory" runs on one node for now'):
        RLConfig.model_validate({"batch_size": 64, "weight_transfer": {"mode": "memory"},
                                 "slurm": {"nodes": 2, "inference_nodes": 1, "gpus_per_node": 0}})


FAILING_INFERENCE_SRUN = """#!/bin/bash
# the inference nodes' step fails after a moment; the trainer nodes' step would run on
case "$*" in *--nodelist=a1,a2*) sleep 0.5; exit 3 ;; esac
echo "trainer step started" >> "$SRUN_LOG"
exec sleep 60
"""


def test_a_failed_side_ends_the_whole_job(tmp_path):
    """Inference dies: the script stops the trainer side and exits 1 at once, holding no allocation."""
    rendered_job(tmp_path, {"nodes": 4, "inference_nodes": 2, "gpus_per_node": 8})  # writes the fakes
    (tmp_path / "bin" / "srun").write_text(FAILING_INFERENCE_SRUN)
    config = RLConfig.model_validate({"output_dir": str(tmp_path / "run"), "batch_size": 64,
                                      "slurm": {"nodes": 4, "inference_nodes": 2, "gpus_per_node": 8}})
    script = render(config, tmp_path / "run", tmp_path / "run" / "slurm" / "rl.json", python="/venv/python", workdir=tmp_path)
    log = tmp_path / "failing.log"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "a[1-4]", "SRUN_LOG": str(log), "SLURM_JOB_ID": "7"}
    start = time.monotonic()
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - start < 15
    assert "inference ended before the run finished; stopping the trainer nodes" in out.stderr
    assert log.read_text() == "trainer step started\n"


def test_placement_names_a_node_outside_the_job():
    config = RLConfig.model_validate({"slurm": {"nodes": 2, "inference_nodes": 1, "gpus_per_node": 0}})
    with pytest.raises(ValueError, match="slurm.nodes is 2 but the job has 3 nodes"):
        plan_multi_node(config, ["a", "b", "c"])


# --------------------------------------------------------------------------- a real controller


def slurm_cluster() -> str | None:
    """Why no local SLURM cluster can run here, or None once one is up (started if needed)."""
    if shutil.which("sinfo") and subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.strip():
        return None
    if os.geteuid() != 0:
        return "needs root to install and start SLURM (scripts/slurm_local.sh)"
    out = subprocess.run(["bash", str(REPO / "scripts/slurm_local.sh"), "start"], capture_output=True, text=True, timeout=300)
    return None if out.returncode == 0 else f"scripts/slurm_local.sh failed: {out.stderr[-500:]}"


@pytest.fixture(scope="module")
def cluster():
    reason = slurm_cluster()
    if reason:
        pytest.skip(reason)
    yield


def submit(tmp_path, tiny_model, name: str, max_steps: int, tag: str, nodes: int = 2) -> tuple[str, Path]:
    run_dir = tmp_path / name
    config = tmp_path / f"{name}.toml"
    slurm = f'\n[slurm]\nnodes = {nodes}\ninference_nodes = 1\ngpus_per_node = 0\nbind_host = "127.0.0.1"\ntime = "00:20:00"\n'
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=max_steps) + slurm)
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}  # sbatch exports it to every process of the job
    out = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(config), "--slurm"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = next(line.split()[3] for line in out.stdout.splitlines() if line.startswith("[prime-rl] submitted job"))
    return job, run_dir


def job_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def wait_job(job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while job_state(job):
        assert time.monotonic() < deadline, f"job {job} still {job_state(job)} after {timeout} s"
        time.sleep(2)


def job_logs(run_dir: Path, job: str) -> str:
    names = ("inference", "orchestrator", "trainer")
    return tail(run_dir / "slurm" / f"job-{job}.log", 40) + "".join(f"\n--- {p} ---\n{tail(log_path(run_dir, p), 30)}" for p in names)


@pytest.mark.slow
def test_two_node_job_runs_inference_on_one_node_and_trains_on_the_other(tmp_path, tiny_model, cluster):
    tag = new_tag()
    job, run_dir = submit(tmp_path, tiny_model, "slurm2", max_steps=3, tag=tag)
    wait_job(job, timeout=900)
    log = (run_dir / "slurm" / f"job-{job}.log").read_text()
    assert "trainer nodes exited with code 0" in log, job_logs(run_dir, job)
    assert (weights_step_dir(run_dir, 3) / MARKER).is_file(), job_logs(run_dir, job)
    rows = read_jsonl(metrics_path(run_dir))
    assert [r["step"] for r in rows if r["process"] == "trainer" and "loss/policy" in r] == [0, 1, 2]
    # inference ran on n1; the orchestrator and the trainer on n2
    assert "n1: node 0 (127.0.0.1): inference replica 0" in log, log
    assert "n2: node 1 (127.0.0.1): orchestrator" in log and "n2: node 1 (127.0.0.1): trainer" in log, log
    api_key = json.loads((run_dir / "configs" / "inference.json").read_text())["api_key"]
    assert api_key, "a multi-node job's vLLM requires a key on every route"
    for holds_key in (run_dir / "slurm" / "rl.json", run_dir / "configs" / "inference.json", run_dir / "configs" / "orchestrator.json"):
        assert stat.S_IMODE(holds_key.stat().st_mode) == 0o600, holds_key
    assert_transport_keys_pair(run_dir, ["trainer"])  # and the batches went through CURVE with them
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_three_node_job_trains_with_a_multi_node_torchrun(tmp_path, tiny_model, cluster):
    """Inference on n1; one trainer rank on each of n2 and n3, joined by torchrun's c10d
    rendezvous on n2 (gloo), fed by the orchestrator on n2."""
    tag = new_tag()
    job, run_dir = submit(tmp_path, tiny_model, "slurm3", max_steps=3, tag=tag, nodes=3)
    wait_job(job, timeout=900)
    log = (run_dir / "slurm" / f"job-{job}.log").read_text()
    assert "trainer nodes exited with code 0" in log, job_logs(run_dir, job)
    assert "n2: node 1 (127.0.0.1): trainer: torchrun, 1 rank(s) per node, trainer node 1 of 2" in log, log
    assert "n3: node 2 (127.0.0.1): trainer: torchrun, 1 rank(s) per node, trainer node 2 of 2" in log, log
    rows = [r for r in read_jsonl(metrics_path(run_dir)) if r["process"] == "trainer" and "loss/policy" in r]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["weights/writers"] == 1 for r in rows)
    # one rank on each node (which node gets rank 0 is the rendezvous's choice)
    ranks = {name: log_path(run_dir, name).read_text() for name in ("trainer", "trainer-1")}
    assert sorted("rank 0/2" in text for text in ranks.values()) == [False, True], ranks
    assert all("rank 0/2" in text or "rank 1/2" in text for text in ranks.values()), ranks
    assert (weights_step_dir(run_dir, 3) / MARKER).is_file()
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_scancel_leaves_no_process_on_either_node(tmp_path, tiny_model, cluster):
    tag = new_tag()
    job, run_dir = submit(tmp_path, tiny_model, "slurm-cancel", max_steps=200, tag=tag)
    deadline = time.monotonic() + 600
    while not any(r["process"] == "trainer" for r in read_jsonl(metrics_path(run_dir))):  # training has begun
        assert time.monotonic() < deadline and job_state(job), job_logs(run_dir, job)
        time.sleep(2)
    assert len({cmd.split()[2] for _, cmd in tagged_processes(tag) if " -m " in cmd}) >= 3  # vLLM, orchestrator, trainer
    subprocess.run(["scancel", job], check=True)
    wait_job(job, timeout=120)
    deadline = time.monotonic() + 60
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], left
