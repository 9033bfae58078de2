"""Placement on one node: GPUs per process, replicas and ranks from `[deployment]`, and the
config errors that stop a bad split before anything starts."""

import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap

import pytest

from helpers import REPO
from prime_rl.config import RLConfig
from prime_rl.launch.resolve import placed
from prime_rl.launch.deployment import PlacementError, plan_single_node, process_specs, replica_inference, teacher_server
from prime_rl.launch.resolve import resolve
from prime_rl.settings import ConfigError, load_config
from prime_rl.vllm_command import shell_line, vllm_command, vllm_env



def specs_of(cfg, run_dir, placement, **kwargs):
    """What the launch writes for ``placement``: the config placed on it, then serialized."""
    return process_specs(placed(cfg, placement), run_dir, placement, **kwargs)

def config(**sections) -> RLConfig:
    return resolve(RLConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "batch_size": 64, **sections}))


def test_eight_gpus_split_four_and_four(tmp_path):
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 4}, inference={"port": 9000})
    placement = plan_single_node(cfg, gpus_available=8)
    assert [(r.port, r.gpus, r.url) for r in placement.replicas] == [
        (9000 + i, (i,), f"http://127.0.0.1:{9000 + i}") for i in range(4)
    ]
    assert placement.trainer.gpus == (4, 5, 6, 7) and placement.trainer.nproc_per_node == 4
    specs = {s.name: s for s in specs_of(cfg, tmp_path, placement)}
    assert specs["inference-2"].env["CUDA_VISIBLE_DEVICES"] == "2"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert specs["trainer"].argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert "CUDA_VISIBLE_DEVICES" not in specs["orchestrator"].env
    # each vLLM server's IPC sockets in a directory of its own the launcher removes after it
    # (and torchrun's log folder, which it leaves in TMPDIR)
    assert {n for n, s in specs.items() if s.tmp_dir_env == "TMPDIR"} == {*(f"inference-{i}" for i in range(4)), "trainer"}
    assert cfg.orchestrator.num_trainer_ranks == 4
    assert cfg.orchestrator.client.base_url == [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


def test_every_vllm_server_keeps_inductors_cache_and_skips_its_precompiled_headers(tmp_path, monkeypatch):
    """Each server's private TMPDIR would make inductor compile its C++ header again on every
    run (the header's folder follows TMPDIR, not the cache dir): the launcher turns headers
    off and keeps the cache, and a value in the launcher's own environment wins."""
    from prime_rl.vllm_command import server_env

    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    specs = {s.name: s for s in specs_of(config(inference={"port": 9000}), tmp_path, plan_single_node(config(), gpus_available=0))}
    assert specs["inference"].env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
    assert specs["inference"].env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")
    assert server_env()["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "1"


def test_memory_mode_gives_every_process_the_transfer_group_and_its_server_the_engine(tmp_path, monkeypatch):
    """`[weight_transfer] mode = "memory"`: the group counts every replica's workers, vLLM is
    started with this project's transfer engine (the teacher's is not: its weights never
    change), the trainer gets a private TMPDIR for the group's store; on GPUs the NCCL group's
    sockets stay on loopback (a user's own NCCL_SOCKET_IFNAME wins); without it nothing changes."""
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    cfg = with_teacher(inference={"tensor_parallel_size": 1}, weight_transfer={"mode": "memory"})
    assert cfg.trainer.weight_transfer.workers == cfg.orchestrator.weight_transfer.workers == 2
    placement = plan_single_node(cfg, gpus_available=6)
    # on GPUs the NCCL engine, on CPU the gloo one (the same protocol; inference.weight_transfer)
    replica = replica_inference(cfg, placement.replicas[1])
    assert flag(vllm_command(replica, cpu=False), "--weight-transfer-config") == '{"backend": "prime_rl_nccl"}'
    assert flag(vllm_command(replica, cpu=True), "--weight-transfer-config") == '{"backend": "prime_rl"}'
    assert "--weight-transfer-config" not in vllm_command(teacher_server(cfg, placement.teacher), cpu=False)
    on_gpus = {s.name: s.env for s in specs_of(cfg, tmp_path / "gpus", placement)}
    assert {n for n, env in on_gpus.items() if env.get("NCCL_SOCKET_IFNAME") == "lo"} == {"inference-0", "inference-1", "trainer"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert not any("NCCL_SOCKET_IFNAME" in s.env for s in specs_of(cfg, tmp_path / "own", placement))
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    one_rank = config(weight_transfer={"mode": "memory"})
    specs = {s.name: s for s in specs_of(one_rank, tmp_path, plan_single_node(one_rank, gpus_available=0))}
    assert specs["trainer"].tmp_dir_env == "TMPDIR"
    directory = config()
    assert "--weight-transfer-config" not in vllm_command(directory.inference, cpu=True)
    specs = {s.name: s for s in specs_of(directory, tmp_path / "d", plan_single_node(directory, gpus_available=0))}
    assert specs["trainer"].tmp_dir_env is None
    assert not any("NCCL_SOCKET_IFNAME" in s.env for s in specs_of(one_rank, tmp_path / "cpu", plan_single_node(one_rank, 0)))
    gpu_directory = with_teacher(inference={"tensor_parallel_size": 1})
    assert not any("NCCL_SOCKET_IFNAME" in s.env for s in specs_of(gpu_directory, tmp_path / "g", plan_single_node(gpu_directory, 6)))
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 2}, inference={"tensor_parallel_size": 2},
                 weight_transfer={"mode": "memory"})
    assert cfg.orchestrator.weight_transfer.workers == 4  # 2 replicas x 2 GPUs


def test_tensor_parallel_replicas_take_consecutive_gpus():
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 2}, inference={"tensor_parallel_size": 2})
    placement = plan_single_node(cfg, gpus_available=8)
    assert [r.gpus for r in placement.replicas] == [(0, 1), (2, 3)]
    assert placement.trainer.gpus == (4, 5)


def test_without_gpus_the_same_keys_start_cpu_processes(tmp_path):
    cfg = config(deployment={"inference_gpus": 2, "trainer_gpus": 2})
    placement = plan_single_node(cfg, gpus_available=0)
    assert placement.device == "cpu" and len(placement.replicas) == 2 and placement.trainer.world_size == 2
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs_of(cfg, tmp_path, placement))


def with_teacher(**sections) -> RLConfig:
    """2 inference GPUs, 2 trainer GPUs and a local distillation teacher on 2 more."""
    return config(deployment={"inference_gpus": 2, "trainer_gpus": 2, "teacher_gpus": 2}, teacher={"model": "teacher-model"},
                  trainer={"loss": {"distill": {"reward_weight": 0.5}}}, **sections)


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_each_replica_runs_vllm_tensor_parallel_over_its_gpus(tmp_path):
    """On GPUs every replica's vLLM gets `--tensor-parallel-size` = its share of GPUs (1
    included), and so does a local teacher, from its own GPU count; on CPU a replica is one
    vLLM-CPU process, without the flag. The written configs hold the same numbers."""
    for tp in (1, 2):
        cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 2}, inference={"tensor_parallel_size": tp})
        placement = plan_single_node(cfg, gpus_available=8)
        for replica in placement.replicas:
            assert len(replica.gpus) == tp
            assert flag(vllm_command(replica_inference(cfg, replica), cpu=False), "--tensor-parallel-size") == str(tp)
        assert "--tensor-parallel-size" not in vllm_command(replica_inference(cfg, placement.replicas[0]), cpu=True)

    cfg = with_teacher(inference={"extra_args": ["--seed", "7"]})
    placement = plan_single_node(cfg, gpus_available=6)
    teacher = teacher_server(cfg, placement.teacher)
    cmd = vllm_command(teacher, cpu=False)
    assert placement.teacher.gpus == (4, 5) and flag(cmd, "--tensor-parallel-size") == "2" and flag(cmd, "--model") == "teacher-model"
    assert cmd[-2:] == ["--seed", "7"]  # extra_args last, after the flags the placement decides
    specs_of(cfg, tmp_path, placement)
    assert json.loads((tmp_path / "configs" / "teacher.json").read_text())["tensor_parallel_size"] == 2
    assert flag(vllm_command(teacher_server(cfg, plan_single_node(cfg, 0).teacher), cpu=False), "--tensor-parallel-size") == "1"


def test_vllm_env_keeps_the_users_logging_setting_and_shows_no_secret():
    """What the server sets wins over the inherited environment, except VLLM_CONFIGURE_LOGGING;
    the displayed line is a shell line whose key is redacted."""
    cfg = config(inference={"api_key": "sekret-key", "cpu_threads_bind": "0-1"}).inference
    env = vllm_env(cfg, cpu=True, inherited={"VLLM_CONFIGURE_LOGGING": "0", "VLLM_SERVER_DEV_MODE": "0", "HOME": "/h"})
    assert (env["VLLM_CONFIGURE_LOGGING"], env["VLLM_SERVER_DEV_MODE"], env["HOME"]) == ("0", "1", "/h")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["PRIME_RL_INFERENCE_API_KEY"] == "sekret-key"
    assert "HOME" not in vllm_env(cfg, cpu=True)  # rendered alone: only what the server sets
    line = shell_line(cfg, cpu=True, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "sekret-key" not in line and line.startswith("CUDA_VISIBLE_DEVICES=0,1 ")
    words = shlex.split(line)
    assert "PRIME_RL_INFERENCE_API_KEY=<redacted>" in words and words[words.index("-m") + 1] == "inference.vllm_cpu"


def test_an_eager_cpu_server_runs_torch_compile_off_unless_the_user_says_otherwise():
    """An eager CPU server compiles only two sampler helpers, ~2-10 s at its first request: off,
    as the user's own value says; a compiled server (enforce_eager false) and GPUs keep it."""
    eager = config().inference
    assert vllm_env(eager, cpu=True)["TORCH_COMPILE_DISABLE"] == "1"
    assert vllm_env(eager, cpu=True, inherited={"TORCH_COMPILE_DISABLE": "0"})["TORCH_COMPILE_DISABLE"] == "0"
    assert "TORCH_COMPILE_DISABLE" not in vllm_env(config(inference={"enforce_eager": False}).inference, cpu=True)
    assert "TORCH_COMPILE_DISABLE" not in vllm_env(eager, cpu=False)
    assert "TORCH_COMPILE_DISABLE=1" in shlex.split(shell_line(eager, cpu=True))


def test_a_cpu_server_shares_its_workers_core_unless_told_not_to():
    """A CPU server is told to run its engine core on the worker's core where that is one
    (a forked worker reads the variable in inference.vllm_cpu, a spawned one in its vLLM
    plugin); not with `cpu_share_core = false`, not on GPUs."""
    share = "PRIME_RL_VLLM_SHARE_WORKER_CORE"
    assert vllm_env(config().inference, cpu=True)[share] == "1"
    assert vllm_env(config(inference={"cpu_fork": False}).inference, cpu=True)[share] == "1"
    assert share not in vllm_env(config(inference={"cpu_share_core": False}).inference, cpu=True)
    assert share not in vllm_env(config().inference, cpu=False)


def test_on_cpu_vllm_starts_through_the_module_that_forks_its_engine_unless_told_not_to():
    """CPU servers start as `python -m inference.vllm_cpu` (vLLM's server, its engine
    processes forked) by default, the local teacher's too; `cpu_fork = false` starts vLLM's
    module as it is, and GPU servers always do (fork is vLLM's own default there). The rest of
    the command line is the same either way."""
    module = lambda cmd: cmd[cmd.index("-m") + 1]  # noqa: E731
    cfg = config(teacher={"model": "/teacher"}, trainer={"loss": {"distill": {"kl_weight": 1.0}}})
    assert module(vllm_command(cfg.inference, cpu=True)) == "inference.vllm_cpu"
    assert module(vllm_command(teacher_server(cfg, plan_single_node(cfg, 0).teacher), cpu=True)) == "inference.vllm_cpu"
    assert module(vllm_command(cfg.inference, cpu=False)) == "vllm.entrypoints.openai.api_server"
    spawned = config(inference={"cpu_fork": False}).inference
    assert module(vllm_command(spawned, cpu=True)) == "vllm.entrypoints.openai.api_server"
    assert vllm_command(spawned, cpu=True)[3:] == vllm_command(cfg.inference, cpu=True)[3:]


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


def dry_run(*flags: str) -> subprocess.CompletedProcess:
    """`prime-rl configs/wiki-search.toml --dry-run` on this GPU-less machine, offline (its hub model need not exist here)."""
    return subprocess.run(
        [sys.executable, "-m", "prime_rl.cli", "configs/wiki-search.toml", "--dry-run", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def gpu_commands(stdout: str) -> list[str]:
    """The vLLM command lines of the 8-GPU placement (printed before this machine's CPU one)."""
    gpu_part = stdout.split("this machine shows no GPU")[0]
    return [line.split("$ ", 1)[1] for line in gpu_part.splitlines() if line.startswith("[prime-rl]     $ ")]


def test_wiki_search_config_dry_run_prints_its_eight_gpu_placement(tmp_path):
    out = dry_run("--output-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "placement on a node with 8 GPUs (inference 4, trainer 4):" in out.stdout
    for i in range(4):
        assert f"inference replica {i}: vLLM on GPU {i}, serving http://127.0.0.1:{8000 + i}" in out.stdout
    assert "trainer: torchrun, 4 rank(s) per node on GPU 4,5,6,7 (4 FSDP2 rank(s) in all)" in out.stdout
    commands = [shlex.split(line) for line in gpu_commands(out.stdout)]
    assert [(c[0], flag(c, "--port"), flag(c, "--tensor-parallel-size")) for c in commands] == [
        (f"CUDA_VISIBLE_DEVICES={i}", str(8000 + i), "1") for i in range(4)
    ]
    assert (tmp_path / "run" / "configs" / "inference-3.json").is_file()
    cores = sorted(os.sched_getaffinity(0))  # deployment.cpu_vllm_first: on two cores, the second until ready
    said = f"orchestrator and trainer start on core {cores[-1]} while vLLM starts"
    assert (said in out.stdout) == (len(cores) == 2), out.stdout[-1500:]


def test_wiki_search_dry_run_shows_each_replicas_tensor_parallel_vllm_command(tmp_path):
    """Issue 33's 8-GPU run: 4 inference GPUs at tensor parallel 2 are 2 replicas, each vLLM
    started over its 2 GPUs; the API key travels in the environment and is never printed."""
    key = "sekret-key-never-printed"
    out = dry_run("--output-dir", str(tmp_path / "run"), "--inference.tensor-parallel-size", "2", "--inference.api-key", key)
    assert out.returncode == 0, out.stderr
    assert key not in out.stdout + out.stderr
    commands = gpu_commands(out.stdout)
    assert len(commands) == 2
    for i, line in enumerate(commands):
        words = shlex.split(line)
        assert flag(words, "--tensor-parallel-size") == "2" and flag(words, "--port") == str(8000 + i)
        assert words[:2] == [f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1}", "VLLM_CONFIGURE_LOGGING=1"]
        assert "PRIME_RL_INFERENCE_API_KEY=<redacted>" in words and flag(words, "--tool-call-parser") == "hermes"
    assert "inference replica 1: vLLM on GPU 2,3, serving http://127.0.0.1:8001" in out.stdout
    assert "inference replica 2" not in out.stdout


def test_dry_run_on_cpu_shows_a_local_teachers_gpus_and_command(capsys):
    """The GPU view of the dry run counts the teacher's GPUs too (it used to ask for too few
    and stop with a traceback), and shows the teacher's vLLM over both of them."""
    from prime_rl.commands.rl import show_placement

    cfg = with_teacher()
    show_placement(cfg, plan_single_node(cfg, gpus_available=0), gpus=0)
    lines = capsys.readouterr().out.splitlines()
    assert "[prime-rl] placement on a node with 6 GPUs (inference 2, trainer 2, teacher 2):" in lines
    at = lines.index("[prime-rl]   teacher: vLLM on GPU 4,5, serving http://127.0.0.1:8100")
    words = shlex.split(lines[at + 1].split("$ ", 1)[1])
    assert words[0] == "CUDA_VISIBLE_DEVICES=4,5" and flag(words, "--tensor-parallel-size") == "2"
    assert flag(words, "--model") == "teacher-model" and flag(words, "--port") == "8100"


def test_configs_that_hold_the_api_key_are_private(tmp_path):
    import stat

    cfg = config(inference={"api_key": "secret"})
    specs_of(cfg, tmp_path, plan_single_node(cfg, gpus_available=0))
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
    specs_of(cfg, tmp_path, plan_single_node(cfg, gpus_available=0))
    assert stat.S_IMODE((tmp_path / "configs" / "inference.json").stat().st_mode) == 0o600


def test_gpus_index_the_ones_this_launcher_was_given(tmp_path, monkeypatch):
    """Under SLURM the job's GPUs are whatever it allocated: processes get those, split."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9,11,13,15,17")
    cfg = config(deployment={"inference_gpus": 4, "trainer_gpus": 4})
    specs = {s.name: s for s in specs_of(cfg, tmp_path, plan_single_node(cfg, gpus_available=8))}
    assert specs["inference-1"].env["CUDA_VISIBLE_DEVICES"] == "5"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "11,13,15,17"


def test_a_forked_vllm_worker_reads_the_binding_vllm_started_it_with():
    """inference.vllm_cpu applies in a forked worker what a spawned worker's OpenMP runtime
    reads from its environment: the thread count and the cores, in each of the three forms
    vLLM writes them (GNU OpenMP, plain OpenMP, Intel OpenMP); nothing when vLLM bound nothing."""
    from inference.vllm_cpu import omp_binding

    assert omp_binding({"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "4 5"}) == (2, {4, 5})
    assert omp_binding({"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}) == (1, {0})
    assert omp_binding({"OMP_NUM_THREADS": "3", "KMP_AFFINITY": "granularity=fine,explicit,proclist=[1,2,3]"}) == (3, {1, 2, 3})
    assert omp_binding({}) == (None, None)
    assert omp_binding({"OMP_NUM_THREADS": "x", "GOMP_CPU_AFFINITY": "0-3"}) == (None, None)  # not vLLM's forms: left alone


@pytest.mark.parametrize("cores", [[0, 1], [2, 5], [0, 1, 2, 3], [0]])
def test_on_two_cores_the_trainer_and_the_orchestrator_start_on_the_one_vllm_leaves(tmp_path, monkeypatch, cores):
    """`deployment.cpu_vllm_first`: with a vLLM server of the run's own on a CPU machine of two
    cores (the launcher's), the trainer and the orchestrator start on the second; vLLM, and
    every process on more cores or on one, start on all of them, as do runs attached to warm
    servers, GPU runs and runs that turned it off."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    cfg = config()
    start = lambda cfg, gpus=0, **kw: {s.name: s.start_cores for s in specs_of(cfg, tmp_path, plan_single_node(cfg, gpus), **kw)}  # noqa: E731
    expected = frozenset(cores[1:]) if len(cores) == 2 else None
    assert start(cfg) == {"inference": None, "orchestrator": expected, "trainer": expected}
    assert start(cfg, serve=False) == {"orchestrator": None, "trainer": None}
    assert start(cfg, gpus=2) == {"inference": None, "orchestrator": None, "trainer": None}
    off = config(deployment={"cpu_vllm_first": False})
    assert start(off) == {"inference": None, "orchestrator": None, "trainer": None}


def test_a_process_started_on_one_core_takes_back_the_runs_cores_with_its_threads_and_children(tmp_path):
    """The launcher starts a process on fewer cores (``start_child``) and tells it the run's
    (``RUN_CORES_ENV``); once ready (``take_back_cores``), every thread of it and every process
    it started meanwhile runs on all of them, and the processes it starts later do not see
    the variable."""
    run_cores = sorted(os.sched_getaffinity(0))
    if len(run_cores) < 2:
        pytest.skip("needs two cores")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import json, os, subprocess, sys, threading
        from prime_rl.cores import RUN_CORES_ENV, take_back_cores
        started = sorted(os.sched_getaffinity(0))
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait)
        thread.start()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        cores = take_back_cores("child")
        later = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({RUN_CORES_ENV!r}))"],
                               capture_output=True, text=True).stdout.strip()
        print(json.dumps({"started": started, "cores": sorted(cores), "later": later,
                          "thread": sorted(os.sched_getaffinity(thread.native_id)),
                          "main": sorted(os.sched_getaffinity(0)), "child": sorted(os.sched_getaffinity(child.pid))}))
        stop.set()
        child.kill()
    """))
    from prime_rl.cores import RUN_CORES_ENV, format_cores
    from prime_rl.launch.launcher import start_child

    env = {**os.environ, RUN_CORES_ENV: format_cores(set(run_cores))}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=REPO,
                         preexec_fn=functools.partial(start_child, frozenset(run_cores[-1:])), check=True).stdout
    line, result = out.splitlines()[-2:]
    assert line == (f"[child] ready: on cores {format_cores(set(run_cores))} from now (started on {run_cores[-1]} "
                    "while vLLM started: deployment.cpu_vllm_first)")
    assert json.loads(result) == {"started": run_cores[-1:], "cores": run_cores, "later": "None",
                                  "thread": run_cores, "main": run_cores, "child": run_cores}
    # without the variable (a process started on all cores) nothing moves and nothing is said
    plain = subprocess.run([sys.executable, "-c", "from prime_rl.cores import take_back_cores; print(take_back_cores('x'))"],
                           env={k: v for k, v in os.environ.items() if k != RUN_CORES_ENV}, capture_output=True, text=True,
                           cwd=REPO, check=True)
    assert plain.stdout == "None\n"


def test_a_cpu_server_inspects_the_models_class_in_its_own_process():
    """vLLM inspects a model class in a new interpreter (~10 s on a machine's first run, its
    cache empty); the forked CPU server does it in its own process, and vLLM still caches it.
    A vLLM whose registry no longer runs it through ``_run_in_subprocess`` fails here."""
    code = textwrap.dedent("""
        import os, subprocess
        from pathlib import Path
        from inference.vllm_cpu import inspect_models_in_process
        from vllm.model_executor.models import registry
        inspect_models_in_process()
        run = subprocess.run
        def refuse(cmd, *args, **kwargs):  # the registry's own interpreter (other commands run as usual)
            assert cmd != registry._SUBPROCESS_COMMAND, "a new interpreter"
            return run(cmd, *args, **kwargs)
        subprocess.run = refuse
        from vllm.model_executor.models.registry import ModelRegistry
        info = ModelRegistry._try_inspect_model_cls("Qwen3ForCausalLM")
        assert info is not None and info.is_text_generation_model, info
        print(sorted(p.name for p in (Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos").iterdir()))
    """)
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VLLM_CACHE_ROOT": cache}, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "['vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json']"
