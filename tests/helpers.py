"""Test helpers: free ports, process discovery by tag, tiny run configs, launcher runs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from prime_rl.launch.launcher import tail
from prime_rl.rundir import (
    MARKER, append_jsonl, checkpoint_step_dir, log_path, metrics_path, rollouts_step_dir, weights_dir, weights_step_dir,
)

REPO = Path(__file__).resolve().parents[1]


def sigint_as_from_a_terminal() -> None:
    """``preexec_fn`` for a child a test Ctrl-Cs: SIGINT's default action restored, as a
    terminal's process has it, even when the suite itself runs with SIGINT ignored (a
    background job or nohup, whose children inherit the ignore and would never see it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def load_script(name: str):
    """``scripts/NAME.py`` as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tiny(out: Path, **options) -> Path:
    """scripts/build_tiny_model.py's model in this process: the script's `build_tiny_model`
    with the same keywords as its flags (``arch``, ``seed``, ``chat_template``, ...). The
    suite's process has torch and transformers imported already, so a model costs well under a
    second instead of a fresh interpreter's ~5 s of imports (the session's ``tiny_model`` still
    runs the script as a command). The global torch RNG is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return load_script("build_tiny_model").build_tiny_model(out, **options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose successor is free too (trainer rank r uses base port + r)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def new_tag() -> str:
    """A value for PRIME_RL_TEST_TAG; every descendant of the launcher inherits it."""
    return uuid.uuid4().hex


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose environment carries this tag."""
    found = []
    needle = f"PRIME_RL_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] == "Z":  # zombie: already dead
                    continue
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(entry.name), cmd))
        except OSError:
            continue
    return found


def trio_toml(
    model: Path,
    run_dir: Path,
    max_steps: int = 3,
    async_level: int = 1,
    *,
    lr: float = 1e-3,
    batch_size: int = 16,
    rollouts_per_example: int = 4,
    extra: str = "",
    env: str = 'id = "reverse-text"',
    seq_len: int = 96,
    max_tokens: int = 8,
    temperature: float = 1.0,
    preflight: str = "",
) -> str:
    """A tiny RL run: few short rollouts, free ports so tests never collide (two in a row:
    a second trainer rank or vLLM replica takes the next one), the `[preflight]` section
    ``preflight``."""
    return f"""
model = "{model}"
output_dir = "{run_dir}"
max_steps = {max_steps}
seq_len = {seq_len}
async_level = {async_level}
batch_size = {batch_size}
rollouts_per_example = {rollouts_per_example}

[sampling]
max_tokens = {max_tokens}
temperature = {temperature}

[[env]]
{env}

[transport]
port = {free_port_pair()}
timeout_s = 300

[trainer.optim]
lr = {lr}

[orchestrator]
micro_batch_size = 8

[preflight]
{preflight}

[inference]
port = {free_port_pair()}
{extra}"""


@contextmanager
def orchestrator_process(config: dict, run_dir, env: dict | None = None, receive_timeout_s: float = 20,
                         expect_code: int = 0, result: dict | None = None):
    """Run `python -m orchestrator.main` on ``config`` (environment ``env``, default ours with
    the repo's src on PYTHONPATH); yields ``receive(step)``, the test playing trainer rank 0,
    which waits ``receive_timeout_s`` for a batch. On exit, waits for the process and checks it
    exited ``expect_code``; ``result`` gets its output (`out`) and the seconds it took to
    exit after the block (`exit_s`)."""
    import zmq
    from prime_rl.wire import decode_batch

    env = {**os.environ, "PYTHONPATH": str(REPO / "src")} if env is None else env
    path = run_dir / "configs" / "orchestrator.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.main", "--config", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ctx = zmq.Context()
    trainer = ctx.socket(zmq.PULL)
    trainer.setsockopt(zmq.RCVTIMEO, int(receive_timeout_s * 1000))
    trainer.setsockopt(zmq.LINGER, 0)
    trainer.connect(f"tcp://127.0.0.1:{config['transport']['port']}")
    try:
        yield lambda step: decode_batch(trainer.recv(), expected_step=step, expected_rank=0)
        done = time.monotonic()
        out, _ = proc.communicate(timeout=20)
        if result is not None:
            result.update(out=out, exit_s=time.monotonic() - done)
    finally:
        trainer.close()
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == expect_code, out


def mask_spans(mask) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s (loss tokens) in a sample's mask."""
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def sandbox_unavailable() -> str | None:
    """Why the python sandbox (bubblewrap) cannot run here, or None when it can."""
    from prime_rl.envs.sandbox import Sandbox, SandboxUnavailable

    try:
        Sandbox.check_available()
    except SandboxUnavailable as e:
        return str(e)
    return None


# --------------------------------------------------------------------------- vLLM's IPC sockets

IPC_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""How vLLM names each ZeroMQ IPC socket it binds (a uuid4, vllm.utils.network_utils.get_open_zmq_ipc_path)."""


def ipc_sockets_in_tmp() -> set[str]:
    """The names of the sockets named like vLLM's directly in the temporary directory."""
    names = set()
    with os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            try:
                if IPC_NAME.fullmatch(entry.name) and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    names.add(entry.name)
            except OSError:  # removed meanwhile by whoever made it
                continue
    return names


def bound_sockets(pid: int) -> dict[Path, int]:
    """Each UNIX socket path ``pid`` and its descendants have bound, with its directory's mode
    (vLLM's engine processes are the server's descendants)."""
    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return {}
    found = {}
    for process in tree:
        try:
            paths = [Path(c.laddr) for c in process.net_connections(kind="unix") if c.laddr.startswith("/")]
        except psutil.Error:  # gone meanwhile
            continue
        for path in paths:
            try:
                found[path] = stat.S_IMODE(path.parent.stat().st_mode)
            except OSError:
                continue
    return found


@contextmanager
def polling(poll, poll_s: float):
    """``poll()`` every ``poll_s`` seconds in a thread while the block runs."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(poll_s):
            poll()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=30)


@contextmanager
def watched_sockets(pid: int, poll_s: float = 1.0):
    """Every socket ``pid``'s tree binds while the block runs (``bound_sockets``, polled in a thread)."""
    seen: dict[Path, int] = {}
    with polling(lambda: seen.update(bound_sockets(pid)), poll_s):
        yield seen


@contextmanager
def watched_cores(pid: int, modules: dict[str, str], poll_s: float = 0.1):
    """While the block runs, the cores of every thread of the processes of ``pid``'s tree that
    run one of ``modules`` (name -> `python -m` module): name -> each poll's set of the
    threads' affinities (a set of frozensets), in order."""
    import psutil

    seen: dict[str, list[set[frozenset[int]]]] = {name: [] for name in modules}

    def poll() -> None:
        try:
            procs = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return
        for proc in procs:
            try:
                cmdline = proc.cmdline()
                name = next((n for n, m in modules.items() if m in cmdline), None)
                if name is not None:
                    seen[name].append({frozenset(os.sched_getaffinity(t.id)) for t in proc.threads()})
            except (psutil.Error, OSError):  # gone, or a thread ended between the calls
                pass

    with polling(poll, poll_s):
        yield seen


@contextmanager
def server_tmp_env(**extra: str):
    """The environment of a vLLM server a test starts itself, outside the launcher, as the
    launcher gives it (``ProcessSpec.tmp_dir_env``): its temporary files (IPC sockets, init
    file) in a private directory removed afterwards, torch's compile cache where it was."""
    from prime_rl.launch.launcher import private_tmp_dir, remove_tmp_dir
    from prime_rl.vllm_command import TMP_DIR_ENV, server_env

    path = private_tmp_dir("test-inference")
    try:
        yield {**os.environ, **server_env(), TMP_DIR_ENV: path, **extra}
    finally:
        remove_tmp_dir("test-inference", path)


def assert_no_ipc_socket_left(seen: dict[Path, int], before: set[str]) -> None:
    """vLLM's IPC sockets that a run's processes bound (``seen``, ``bound_sockets``) each lay in
    a private directory (0700) the launcher made for their server directly under the temporary
    directory, each directory is gone, and none of them is in the temporary directory itself
    (``before``: vLLM-named sockets there before the run; other processes may add theirs meanwhile)."""
    ipc = {path: mode for path, mode in seen.items() if IPC_NAME.fullmatch(path.name)}
    assert ipc, f"no vLLM IPC socket seen among {sorted(seen)}"
    tmp = Path(tempfile.gettempdir())
    for path, mode in ipc.items():
        assert path.parent.parent == tmp and path.parent.name.startswith("prime-rl-inference"), path
        assert mode == 0o700, (path, oct(mode))
    left = sorted({path.parent for path in ipc if path.parent.exists()})
    assert not left, f"private directories left after the run: {left}"
    assert not (ipc_sockets_in_tmp() - before) & {path.name for path in ipc}


# --------------------------------------------------------------------------- launcher runs

def finish(proc, run_dir, timeout=900) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    logs = "".join(f"\n--- {p} ---\n{tail(log_path(run_dir, p), 40)}" for p in ("inference", "orchestrator", "trainer"))
    assert proc.returncode == 0, out + logs
    return out


LAUNCHED: list[subprocess.Popen] = []
"""Every launcher a test started (``start_launcher``); conftest's `stop_leftover_launchers`
stops those still running when the test ends, however it ended (pytest-timeout included)."""


def start_launcher(config, *flags):
    tag = new_tag()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.cli", str(config), "--no-tmux", *flags],
        env={**os.environ, "PRIME_RL_TEST_TAG": tag}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    LAUNCHED.append(proc)
    return proc, tag


def stop_launchers() -> None:
    """SIGTERM each launcher still running (it stops its processes and removes its private
    temporary folders), SIGKILL one that has not stopped a minute later."""
    running = [p for p in LAUNCHED if p.poll() is None]
    LAUNCHED.clear()
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.communicate(timeout=60)  # reading its output: a full pipe would block it
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def kill_mid_run(run_dir, config, marker, after_checkpoint: int) -> tuple[str, int, float]:
    """Start the trio, SIGKILL the process whose command line holds ``marker`` once checkpoint
    ``after_checkpoint`` is complete; returns the launcher's output, exit code and seconds it
    took to stop."""
    proc, tag = start_launcher(config)
    try:
        deadline = time.monotonic() + 600
        while not (checkpoint_step_dir(run_dir, after_checkpoint) / MARKER).is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
            time.sleep(0.1)
        (pid,) = [pid for pid, cmd in tagged_processes(tag) if marker in cmd and "torch.distributed" not in cmd]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        stopped_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert tagged_processes(tag) == [], "no process may survive a failed run"
    return out, proc.returncode, stopped_s


def resume(run_dir, config, *flags) -> tuple[int, float]:
    """Resume the run to its end; returns the checkpoint step it resumed from and its wall time."""
    started = time.monotonic()
    proc, tag = start_launcher(config, *flags)
    out = finish(proc, run_dir)
    assert tagged_processes(tag) == []
    (step,) = re.findall(r"resuming .* from checkpoint step (\d+)", out)
    return int(step), time.monotonic() - started


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGTERM vLLM's whole process group (the API server and its engine core), then SIGKILL."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # the engine core may outlive the API server by a moment
        except ProcessLookupError:
            return
        time.sleep(0.2)


def step_dir(folder, complete=True):
    folder.mkdir(parents=True)
    if complete:
        (folder / MARKER).write_text("\n")


def crashed_run(run, weights=range(1, 7), checkpoints=(2, 4), records=range(1, 6)):
    """What a run killed after its trainer's step 5 leaves behind (checkpoint every 2 steps)."""
    for step in weights:
        step_dir(weights_step_dir(run, step))
    step_dir(weights_dir(run) / "step_7.tmp", complete=False)
    for step in checkpoints:
        step_dir(checkpoint_step_dir(run, step))
    step_dir(checkpoint_step_dir(run, 6), complete=False)  # killed between rename and marker
    for step in records:
        step_dir(rollouts_step_dir(run, step))
    for step in range(6):
        for process in ("orchestrator", "trainer"):
            append_jsonl(metrics_path(run), {"process": process, "step": step})


ENDPOINTS = """
[[endpoint]]
endpoint_id = "fake"
model = "fake/model-1"
url = "{url}/v1"
key = "FAKE_EVAL_KEY"

[[endpoint]]
endpoint_id = "other"
model = "other-model"
url = "http://127.0.0.1:9/v1"
"""


def endpoints_file(tmp_path: Path, url: str = "http://127.0.0.1:9") -> Path:
    path = tmp_path / "endpoints.toml"
    path.write_text(ENDPOINTS.format(url=url))
    return path


def eval_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_rl.cli", "eval", *args],
        cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )


INSTRUCTION = "last character first"


def reverse_if_told(messages, index) -> str:
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    text = messages[-1]["content"]
    return text[::-1] if INSTRUCTION in system else text


def assert_traced(run_dir, steps: int, rollouts_per_example: int, groups: int = 2, mismatch_at_0: float = 0.05) -> list[dict]:
    """The run's traces (``prime_rl.traces``): each step's ``groups`` whole groups, each rollout
    once; the trainer's row of each traced sample once, of the step that trained it, a value per
    sampled token (none was cut here); at step 0 the trainer's logprobs match vLLM's within
    ``mismatch_at_0`` on average. Returns the train rows."""
    from prime_rl.traces import read_traces, rollout_traces_path, trainer_traces_path

    rollouts = [r for r in read_traces(rollout_traces_path(run_dir)).rows if r["kind"] == "train"]
    trainer = read_traces(trainer_traces_path(run_dir)).rows
    ids = [r["id"] for r in rollouts]
    assert len(ids) == len(set(ids)), "a rollout traced twice"
    for step in range(steps):
        mine = [r for r in rollouts if r["step"] == step]
        assert len(mine) == groups * rollouts_per_example, (step, len(mine))
        assert len({r["group"] for r in mine}) == groups and all(r["advantage"] is not None for r in mine)
    keys = [(r["id"], r["part"]) for r in trainer]
    assert len(keys) == len(set(keys)), "a sample's trainer row written twice"
    by_id = {r["id"]: r for r in trainer}
    assert set(by_id) == set(ids), "every traced rollout trained on, and only those"
    gaps = []
    for row in rollouts:
        seen = by_id[row["id"]]
        assert seen["step"] == row["step"]
        sampled = [lp for turn in row["turns"] for lp in turn["logprobs"]]
        assert len(seen["logprobs"]) == len(seen["entropy"]) == len(seen["masked"]) == len(sampled), row["id"]
        if row["step"] == 0:
            gaps += [abs(a - b) for a, b in zip(sampled, seen["logprobs"])]
    assert gaps and sum(gaps) / len(gaps) < mismatch_at_0, sum(gaps) / len(gaps)
    assert_no_secret_in_traces(run_dir)
    return rollouts


def assert_no_secret_in_traces(run_dir) -> None:
    """No key of the run (each process's resolved config holds the inference API key and the
    transport's CURVE keys the launcher drew for it) appears in its trace files."""
    from prime_rl.keys import secret_values
    from prime_rl.rundir import configs_dir
    from prime_rl.traces import trace_files

    secrets = {s for path in Path(configs_dir(run_dir)).glob("*.json") for s in secret_values(json.loads(path.read_text()))
               if len(s) >= 8}
    assert secrets, "the run's configs hold its keys"
    text = "".join(path.read_text() for path in trace_files(run_dir))
    assert text and not [s for s in secrets if s in text]


def remove_cgroup(cgroup: Path) -> None:
    """Kill what is left in it, then remove it (bounded)."""
    deadline = time.monotonic() + 10
    while cgroup.exists() and time.monotonic() < deadline:
        try:
            for pid in (cgroup / "cgroup.procs").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            cgroup.rmdir()
        except (OSError, ValueError):  # EBUSY while the last ones exit
            time.sleep(0.05)


@contextmanager
def standalone_server(root: Path, name: str, **settings):
    """A vLLM server (``inference.server``, as the launcher starts one) with ``settings`` (the
    inference config's keys; a free port is added), started by a test outside any launcher,
    its log in ``root/NAME.log``: yields its URL. Stopped after, with no process of it left."""
    port, tag = free_port(), new_tag()
    config = root / f"{name}.json"
    config.write_text(json.dumps({**settings, "port": port}))
    with server_tmp_env(PRIME_RL_TEST_TAG=tag) as env, (root / f"{name}.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "inference.server", "--config", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process_group(proc)
        assert tagged_processes(tag) == [], f"the {name} server's engine process must stop with it"


def served_prompt_logprobs(model: Path, root: Path, sequences: list[list[int]]) -> list:
    """Each sequence's prompt logprobs (raw, temperature 1) from a vLLM server of ``model``
    started here as the launcher starts a distillation teacher's (``inference.server``), asked
    as the orchestrator's teacher asks; the server is stopped after, nothing of it left."""
    import asyncio

    from prime_rl.config import ClientConfig

    from orchestrator.client import TeacherClient

    async def ask(url: str) -> list:
        client = TeacherClient(ClientConfig(base_url=url, timeout_s=120), str(model))
        try:
            await client.wait_healthy(300)
            return [a for i in range(0, len(sequences), 64) for a in await client.prompt_logprobs(sequences[i : i + 64])]
        finally:
            await client.close()

    with standalone_server(root, "teacher", model=str(model), seq_len=256, max_num_seqs=64) as url:
        return asyncio.run(ask(url))
