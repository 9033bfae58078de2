"""A warm start: `prime-rl inference CONFIG` keeps the run's vLLM servers up, and runs attach
to them (loading their own weights) instead of paying vLLM's start-up.

The attach decision and every refusal are pure functions of hand-made state files and
configs; the state file's lifecycle runs against a stand-in HTTP server; one real test
starts `prime-rl inference` and two short runs against it (the second of another seed)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import psutil
import pytest

import prime_rl.cli
from helpers import (
    REPO, assert_no_ipc_socket_left, bound_sockets, free_port, free_port_pair, ipc_sockets_in_tmp, new_tag, tagged_processes, trio_toml,
)
from prime_rl.launch import warm
from prime_rl.cli import main
from prime_rl.config import RLConfig
from prime_rl.launch.deployment import Replica
from prime_rl.tokenizer import tokenizer_digest
from prime_rl.keys import identity_proof, nonce_bytes
from prime_rl.launch.launcher import tail
from prime_rl.rundir import config_path, log_path, metrics_path, read_jsonl
from prime_rl.settings import ConfigError, load_config

KEY = "sk-warm-test"


# --------------------------------------------------------------------------- hand-made states and configs


def rl_config(tmp_path: Path, model: Path, port: int, extra: str = "", name: str = "run") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(re.sub(r"\[inference\]\nport = \d+", f"[inference]\nport = {port}", trio_toml(model, tmp_path / name, extra=extra)))
    return path


def load(path: Path, *flags: str) -> RLConfig:
    return load_config(RLConfig, [str(path)], list(flags))


def a_state(model: Path, port: int = 18000, **changes) -> warm.ServerState:
    folder = warm.model_folder(str(model))
    state = warm.ServerState(
        url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, replica=0, replicas=1, pid=os.getpid(),
        started_unix=time.time(), model=str(model), served_model_name=str(model), architecture=warm.architecture(folder),
        tokenizer_sha256=tokenizer_digest(folder), dtype="float32", seq_len=96, max_lora_rank=None,
        tool_call_parser=None, api_key_set=False, config=["/somewhere/rl.toml"], log="/somewhere/inference.log",
    )
    return state.model_copy(update=changes)


def needs(model: Path, **changes) -> warm.RunNeeds:
    folder = warm.model_folder(str(model))
    need = warm.RunNeeds(model=str(model), architecture=warm.architecture(folder), tokenizer_sha256=tokenizer_digest(folder),
                         dtype="float32", seq_len=96, lora=False, tool_call_parser=None, tool_env=None, api_key_set=False)
    return warm.RunNeeds(**{**need.__dict__, **changes})


@pytest.fixture
def listening():
    """A socket listening on a free port of 127.0.0.1 (a server holding the port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.fixture(autouse=True)
def servers_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "servers"
    monkeypatch.setenv(warm.SERVERS_DIR_ENV, str(directory))
    return directory


# --------------------------------------------------------------------------- the decision


def live(port: int, state: warm.ServerState) -> warm.Found:
    return warm.Found(port, state)


def test_without_a_warm_server_a_run_starts_its_own_unless_it_asked_to_attach(tiny_model):
    none = [warm.Found(8000, None, "no state file /x/127.0.0.1-8000.json")]
    assert warm.attach_decision(None, none, "127.0.0.1") is False
    assert warm.attach_decision(False, none, "127.0.0.1") is False
    with pytest.raises(ConfigError, match=r"^inference.attach = true, but no warm server serves 127.0.0.1:8000 \(no state file"):
        warm.attach_decision(True, none, "127.0.0.1")
    stale = [warm.Found(8000, a_state(tiny_model, 8000), "its launcher (pid 1234) is gone: /x is stale")]
    assert warm.attach_decision(None, stale, "127.0.0.1") is False


def test_a_live_warm_server_is_attached_to_unless_attach_is_false(tiny_model):
    found = [live(8000, a_state(tiny_model, 8000, pid=4321))]
    assert warm.attach_decision(None, found, "127.0.0.1") is True
    assert warm.attach_decision(True, found, "127.0.0.1") is True
    with pytest.raises(ConfigError, match=r"^inference.attach = false, but a warm server \(`prime-rl inference`, pid 4321\) holds port 8000"):
        warm.attach_decision(False, found, "127.0.0.1")


def test_the_replica_count_must_match_deployment(tiny_model):
    two = a_state(tiny_model, 8000, replicas=2)
    with pytest.raises(ConfigError, match=r"asks for 1 inference replica\(s\), but the warm servers on port 8000 were started as 2"):
        warm.attach_decision(None, [live(8000, two)], "127.0.0.1")
    half = [live(8000, a_state(tiny_model, 8000, replicas=2)), warm.Found(8001, None, "no state file")]
    with pytest.raises(ConfigError, match=r"asks for 2 inference replica\(s\) on ports 8000-8001, but no warm server serves port 8001"):
        warm.attach_decision(None, half, "127.0.0.1")
    both = [live(8000, a_state(tiny_model, 8000, replicas=2)), live(8001, a_state(tiny_model, 8001, replica=1, replicas=2))]
    assert warm.attach_decision(None, both, "127.0.0.1") is True


# --------------------------------------------------------------------------- refusals


def test_same_architecture_other_weights_is_fine(tiny_model, other_tiny_model):
    assert (tiny_model / "model.safetensors").read_bytes() != (other_tiny_model / "model.safetensors").read_bytes()
    assert warm.refusals(needs(other_tiny_model), a_state(tiny_model)) == []


def test_another_architecture_or_tokenizer_is_refused(tiny_model, tmp_path):
    other = tmp_path / "wide"
    other.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    # where it was saved and by which transformers does not shape the model
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128, "transformers_version": "0.0", "_name_or_path": "x"}))
    (other / "tokenizer.json").write_text("{}")
    lines = warm.refusals(needs(other), a_state(tiny_model))
    assert len(lines) == 2, lines
    assert "is another architecture than" in lines[0] and "hidden_size 128 vs 64" in lines[0] and "transformers_version" not in lines[0]
    assert "has another tokenizer than" in lines[1]


@pytest.mark.parametrize(("need", "state", "expected"), [
    ({"seq_len": 128}, {"seq_len": 96}, "seq_len 128 exceeds the 96 tokens of the warm server"),
    ({"lora": True}, {}, "trainer.lora: a LoRA run cannot attach to the warm server"),
    ({"tool_call_parser": "hermes", "tool_env": "wiki-search"}, {},
     "environment 'wiki-search' calls tools with the 'hermes' parser, but the warm server at http://127.0.0.1:18000 runs no tool-call parser"),
    ({"tool_call_parser": "hermes"}, {"tool_call_parser": "pythonic"}, "runs pythonic"),
    ({}, {"api_key_set": True}, "requires an API key and this run has none"),
    ({"api_key_set": True}, {}, "runs without one: it cannot prove the key"),
    ({"dtype": "bfloat16"}, {}, "inference.dtype 'bfloat16' differs from the 'float32'"),
    ({"weight_transfer": "memory"}, {}, 'weight_transfer.mode = "memory": the warm server at http://127.0.0.1:18000 was started without'),
])
def test_each_mismatch_is_refused_in_one_line(tiny_model, need, state, expected):
    lines = warm.refusals(needs(tiny_model, **need), a_state(tiny_model, **state))
    assert len(lines) == 1 and expected in lines[0], lines
    assert "\n" not in lines[0]


def test_a_server_with_the_tool_parser_a_run_without_tools_does_not_need_is_fine(tiny_model):
    assert warm.refusals(needs(tiny_model, seq_len=64), a_state(tiny_model, tool_call_parser="hermes", max_lora_rank=8)) == []
    assert warm.refusals(needs(tiny_model), a_state(tiny_model, weight_transfer="memory")) == []  # folders still load


# --------------------------------------------------------------------------- state files


def test_a_state_file_round_trips_and_is_removed_only_by_its_server(tiny_model, servers_dir):
    state = a_state(tiny_model)
    path = warm.write_state(state)
    assert path == servers_dir / "127.0.0.1-18000.json" and warm.read_state(path) == state
    assert "sk-" not in path.read_text() and json.loads(path.read_text())["api_key_set"] is False
    warm.remove_state(state.model_copy(update={"pid": state.pid + 1}))  # another server's: stays
    assert path.is_file()
    warm.remove_state(state)
    assert not path.exists()
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a warm server's state file"):
        warm.read_state(path)


def test_only_a_live_launcher_holding_the_port_counts(tiny_model, listening):
    replica = Replica(0, 0, "127.0.0.1", f"http://127.0.0.1:{listening}", listening, ())
    assert "no state file" in warm.find_servers([replica])[0].why_not
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    warm.write_state(a_state(tiny_model, listening, pid=int(dead)))
    assert "is gone" in warm.find_servers([replica])[0].why_not
    warm.write_state(a_state(tiny_model, listening, started_unix=time.time() - 10**7))  # our pid, but started later: reused
    assert "is gone" in warm.find_servers([replica])[0].why_not
    warm.write_state(a_state(tiny_model, listening))
    assert warm.find_servers([replica])[0].live
    free = free_port()
    warm.write_state(a_state(tiny_model, free))
    found = warm.find_servers([Replica(0, 0, "127.0.0.1", f"http://127.0.0.1:{free}", free, ())])[0]
    assert not found.live and f"port {free} is free" in found.why_not


class StandIn(BaseHTTPRequestHandler):
    """/health (with the key, when one is set) and the identity route, as inference.auth answers."""

    key: str | None = None

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/prime-rl/identity" and self.key:
            nonce = nonce_bytes(parse_qs(url.query)["nonce"][0])
            self.answer(200, {"proof": identity_proof(self.key, nonce)})
        elif url.path == "/health" and (not self.key or self.headers.get("Authorization") == f"Bearer {self.key}"):
            self.answer(200, {})
        else:
            self.answer(401 if self.key else 404, {})

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    servers = []

    def start(key: str | None) -> int:
        handler = type("Handler", (StandIn,), {"key": key})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown() waits one poll
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_watch_writes_the_state_once_healthy_and_removes_it_at_stop(tiny_model, stand_in, servers_dir):
    port = stand_in(KEY)
    state = a_state(tiny_model, port, api_key_set=True)
    ready = []
    watch = warm.ServerWatch([state], KEY, on_ready=lambda s, path: ready.append(path), poll_s=0.05)
    watch.start()
    deadline = time.monotonic() + 10
    while not ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready == [servers_dir / f"127.0.0.1-{port}.json"] and warm.read_state(ready[0]) == state
    watch.stop()
    assert not ready[0].exists()


def test_a_server_that_cannot_prove_the_key_is_never_ready_nor_attached(tiny_model, stand_in):
    port = stand_in("another-key")
    assert "its identity proof is wrong" in warm.key_not_proven(f"http://127.0.0.1:{port}", KEY, 5)
    assert warm.key_not_proven(f"http://127.0.0.1:{port}", "another-key", 5) is None
    assert not warm.healthy(a_state(tiny_model, port), KEY)


# --------------------------------------------------------------------------- a run attaching (dry run)


def test_a_run_attaches_in_its_resolved_configs(tmp_path, tiny_model, other_tiny_model, stand_in, capsys):
    """A live warm server of the tiny model on the run's port: the run starts no vLLM, does not
    refuse the port, and its orchestrator loads the run's own model (another seed) first."""
    port = stand_in(None)
    warm.write_state(a_state(tiny_model, port))
    config = rl_config(tmp_path, other_tiny_model, port)
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--dry-run"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    assert f"attaching to the warm inference server at http://127.0.0.1:{port}" in out and "warning" not in err, (out, err)
    run_dir = tmp_path / "run"
    orchestrator = json.loads(config_path(run_dir, "orchestrator").read_text())
    assert orchestrator["initial_weights"] == str(other_tiny_model.resolve())
    assert orchestrator["model"] == str(tiny_model) and orchestrator["tokenizer"] == str(other_tiny_model)
    assert not config_path(run_dir, "inference").exists()


def test_a_resumed_run_loads_its_checkpoints_weights(tmp_path, tiny_model, other_tiny_model):
    config = load(rl_config(tmp_path, other_tiny_model, 18000))
    attached, weights = warm.attach(config, [a_state(tiny_model)], tmp_path / "run", resume_step=4)
    assert config.orchestrator.initial_weights is None, "the config given is not changed"
    config = attached
    assert weights == config.orchestrator.initial_weights == tmp_path / "run" / "weights" / "step_4"
    assert config.orchestrator.model == str(tiny_model)  # the name the server serves under


def test_a_lora_run_or_a_keyless_one_is_refused_before_anything_starts(tmp_path, tiny_model, stand_in, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr("prime_rl.commands.rl.run", lambda *args, **kwargs: launched.append(args) or 0)
    port = stand_in(KEY)
    warm.write_state(a_state(tiny_model, port, api_key_set=True))
    config = rl_config(tmp_path, tiny_model, port, extra="\n[trainer.lora]\nrank = 8\n")
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--no-tmux"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and launched == []
    assert len(lines) == 2 and "a LoRA run cannot attach" in lines[0] and "requires an API key" in lines[1], lines
    with pytest.raises(SystemExit):
        main([str(rl_config(tmp_path, tiny_model, port, extra='api_key = "wrong"\n', name="wrong")), "--no-tmux"])
    err = capsys.readouterr().err.strip()
    assert "its identity proof is wrong" in err and launched == [], err


def test_a_second_run_is_refused_while_another_holds_the_lease(tmp_path, tiny_model, stand_in, capsys):
    port = stand_in(None)
    state = a_state(tiny_model, port)
    warm.write_state(state)
    with warm.take_leases([state], tmp_path / "first"):
        with pytest.raises(SystemExit):
            main([str(rl_config(tmp_path, tiny_model, port)), "--dry-run"])
        assert "is in use by the run in" in capsys.readouterr().err
    assert not warm.lease_path("127.0.0.1", port).exists()


# --------------------------------------------------------------------------- leases


def test_of_runs_attaching_at_the_same_moment_exactly_one_gets_the_lease(tiny_model, tmp_path):
    state, racers = a_state(tiny_model), 6
    start, won, refused = threading.Barrier(racers), [], []

    def attach(i: int) -> None:
        start.wait(timeout=10)
        try:
            won.append((i, warm.take_leases([state], tmp_path / f"run{i}")))
        except ConfigError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(won) == 1 and len(refused) == racers - 1, (won, refused)
    (winner, leases), = won
    assert all(line.startswith(f"the warm server at {state.url} is in use by the run in ") and "\n" not in line for line in refused)
    assert warm.read_lease(state)["run_dir"] == str((tmp_path / f"run{winner}").resolve())
    leases.release()
    assert warm.read_lease(state) is None


def test_a_run_ending_removes_only_its_own_lease(tiny_model, tmp_path):
    """The first run's lease lapsed (its launcher looked gone) and a second run took the server
    over: the first run's exit, even twice, leaves the second one's lease in place."""
    state = a_state(tiny_model)
    first = warm.take_leases([state], tmp_path / "first")
    lease = warm.read_lease(state)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    warm.lease_path(state.host, state.port).write_text(json.dumps({**lease, "pid": int(dead)}))
    second = warm.take_leases([state], tmp_path / "second")
    first.release()
    first.release()
    assert warm.read_lease(state)["run_dir"] == str((tmp_path / "second").resolve())
    with pytest.raises(ConfigError, match="is in use by the run in .*second"):
        warm.take_leases([state], tmp_path / "third")
    second.release()
    assert warm.read_lease(state) is None


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", "[" * 100_000, '{"pid": "1", "started_unix": 0, "run_dir": "x"}'])
def test_a_damaged_lease_is_taken_over(tiny_model, tmp_path, damage):
    state = a_state(tiny_model)
    path = warm.lease_path(state.host, state.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(damage)
    with warm.take_leases([state], tmp_path / "run"):
        assert warm.read_lease(state)["run_dir"] == str((tmp_path / "run").resolve())
    assert not path.exists()


def test_a_refused_lease_gives_back_the_ones_already_taken(tiny_model, tmp_path):
    first, second = a_state(tiny_model, 18000), a_state(tiny_model, 18001, replica=1)
    with warm.take_leases([second], tmp_path / "other"):
        with pytest.raises(ConfigError, match="18001 is in use by the run in"):
            warm.take_leases([first, second], tmp_path / "run")
        assert warm.read_lease(first) is None and warm.read_lease(second) is not None


# --------------------------------------------------------------------------- the key


def test_a_drawn_key_is_readable_by_its_user_only_and_attaching_runs_use_it(tmp_path, tiny_model, stand_in, capsys):
    key, key_file = warm.draw_key(tmp_path)
    assert len(key) >= 40 and key_file.stat().st_mode & 0o777 == 0o600 and warm.read_key(key_file) == key
    port = stand_in(key)
    warm.write_state(a_state(tiny_model, port, api_key_set=True, key_file=str(key_file)))
    config = rl_config(tmp_path, tiny_model, port)  # no api_key of its own
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--dry-run"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    assert "attaching to the warm inference server" in out and key not in out + err
    written = config_path(tmp_path / "run", "orchestrator")
    assert json.loads(written.read_text())["client"]["api_key"] == key and written.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("spoil", ["group-readable", "link", "empty", "missing"])
def test_a_key_file_anyone_else_could_have_written_or_read_is_refused(tmp_path, spoil):
    key, key_file = warm.draw_key(tmp_path)
    if spoil == "group-readable":
        key_file.chmod(0o640)
    elif spoil == "link":
        key_file.rename(tmp_path / "elsewhere")
        key_file.symlink_to(tmp_path / "elsewhere")
    elif spoil == "empty":
        key_file.write_text("\n")
    else:
        key_file.unlink()
    with pytest.raises(ConfigError) as e:
        warm.read_key(key_file)
    assert str(e.value).startswith(f"{key_file}: ") and "\n" not in str(e.value) and key not in str(e.value)


@pytest.mark.parametrize("extra", ['host = "0.0.0.0"\n', 'host = "::"\n', 'host = "gpu-node-3"\n', 'extra_args = ["--host", "0.0.0.0"]\n'])
def test_prime_rl_inference_beyond_loopback_needs_a_key(tmp_path, tiny_model, capsys, extra):
    config = rl_config(tmp_path, tiny_model, free_port_pair(), extra=extra)
    with pytest.raises(SystemExit) as exit_info:
        main(["inference", str(config), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("prime-rl: inference.host: a warm server on ") and "needs inference.api_key" in err, err
    with pytest.raises(SystemExit) as exit_info:  # with a key of its own it may (where the address is this machine's)
        main(["inference", str(config), "--dry-run", "--inference.api-key", "sk-given"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 0 or "cannot resolve the host 'gpu-node-3'" in err, err


def test_prime_rl_inference_resolves_the_runs_servers_and_refuses_what_no_run_would_use(tmp_path, tiny_model, stand_in, servers_dir, capsys):
    port = free_port_pair()
    config = rl_config(tmp_path, tiny_model, port, extra='tool_call_parser = "hermes"\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["inference", str(config), "--dry-run", "--clean", "--resume-step", "3", "--seq-len", "128"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    command = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[prime-rl]   $ ")]
    assert len(command) == 1 and f"--port {port} " in command[0] and "--tool-call-parser hermes" in command[0]
    written_path = config_path(servers_dir / f"127.0.0.1-{port}", "inference")
    written = json.loads(written_path.read_text())
    assert (written["port"], written["seq_len"], written["tool_call_parser"]) == (port, 128, "hermes")
    # no key given: the servers require a drawn one on every route, in a config only its user reads
    assert len(written["api_key"]) >= 40 and written_path.stat().st_mode & 0o777 == 0o600
    assert "--middleware inference.auth.RequireApiKey" in command[0] and written["api_key"] not in command[0]
    assert not (tmp_path / "run").exists() and not warm.state_path("127.0.0.1", port).exists()
    with pytest.raises(SystemExit):
        main(["inference", str(rl_config(tmp_path, tiny_model, port, extra="\n[trainer.lora]\nrank = 8\n", name="lora"))])
    assert "trainer.lora: a LoRA run never attaches" in capsys.readouterr().err
    held = stand_in(None)
    warm.write_state(a_state(tiny_model, held))
    with pytest.raises(SystemExit):
        main(["inference", str(rl_config(tmp_path, tiny_model, held, name="again"))])
    assert f"serves http://127.0.0.1:{held} already" in capsys.readouterr().err


def test_the_help_lists_the_inference_command():
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", "inference", "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and "--no-tmux" in proc.stdout and "attach" in proc.stdout
    assert "prime-rl inference CONFIG.toml" in prime_rl.cli.__doc__


# --------------------------------------------------------------------------- the real thing

ATTACHED_FIRST_STEP_S = 40.0
"""Most seconds from an attached run's command to its first trained step. Measured on this
2-core machine under load (docs/machine_facts.md, 2026-12-01): cold 69 s (vLLM healthy at
60 s), attached 18-22 s; the limit sits well below cold and leaves room for a loaded machine."""


def start_server(config: Path, tag: str):
    cmd = [sys.executable, "-m", "prime_rl.cli", "inference", str(config), "--no-tmux"]
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_ready(proc, timeout_s: float = 300) -> str:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "inference ready:" in line:
            return "".join(lines)
    raise AssertionError("the warm server never became ready:\n" + "".join(lines))


def attached_run(config: Path, run_dir: Path, tag: str) -> tuple[float, dict]:
    """A run against the warm server: seconds from its command to its first trained step, and that step's trainer row."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(config), "--no-tmux"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PRIME_RL_TEST_TAG": tag})
    logs = "".join(f"\n--- {p} ---\n{tail(log_path(run_dir, p), 30)}" for p in ("orchestrator", "trainer"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "attaching to the warm inference server" in proc.stdout, proc.stdout
    rows = read_jsonl(metrics_path(run_dir))
    first = next(r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r)
    return first["wall"] - t0, first


def test_two_runs_attach_to_one_warm_server_and_each_samples_its_own_weights(tmp_path, tiny_model, other_tiny_model, servers_dir):
    port, tag = free_port_pair(), new_tag()
    first_config = rl_config(tmp_path, tiny_model, port, name="first")
    second_config = rl_config(tmp_path, other_tiny_model, port, name="second")  # same architecture, other weights
    tmp_before = ipc_sockets_in_tmp()
    server = start_server(first_config, tag)
    state = servers_dir / f"127.0.0.1-{port}.json"
    try:
        out = wait_ready(server)
        sockets = bound_sockets(server.pid)  # vLLM's, bound by now
        assert state.is_file() and warm.read_state(state).pid == server.pid
        # vLLM's worker, forked from its API server (inference.cpu_fork), keeps to the cores vLLM
        # bound it to, as a spawned one does (unbound, it ran on every core beside the trainer)
        (log,) = [p for p in tmp_path.rglob("*.log") if "core ids=" in p.read_text(errors="replace")]
        cores = {int(c) for c in re.findall(r"core ids=\[([\d, ]+)\]", log.read_text())[-1].split(",")}
        # by its title (vLLM's setproctitle overwrites the environment tagged_processes reads)
        (worker,) = [p for p in psutil.Process(server.pid).children(recursive=True) if p.name().startswith("VLLM::Worker")]
        assert worker.cpu_affinity() == sorted(cores), (worker.cpu_affinity(), cores)
        if len(cores) == 1:
            # and the engine core, with every thread of it, joins the worker on its one core
            # (inference.cpu_share_core): their spin-waits yield to each other there
            engine = worker.parent()
            assert engine.name() == "VLLM::EngineCore", engine
            assert {t.id: os.sched_getaffinity(t.id) for t in engine.threads()} == {t.id: cores for t in engine.threads()}
        # no key was given: the server drew one, which only this user can read, and every route wants it
        key_file = Path(warm.read_state(state).key_file)
        assert "the servers require a drawn one" in out and key_file.stat().st_mode & 0o777 == 0o600
        url = f"http://127.0.0.1:{port}"
        for method, path in (("POST", "/pause"), ("POST", "/collective_rpc"), ("GET", "/server_info"), ("POST", "/resume")):
            request = urllib.request.Request(url + path, method=method, data=b"{}" if method == "POST" else None)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401, path
        for config, name in ((first_config, "first"), (second_config, "second")):
            seconds, row = attached_run(config, tmp_path / name, tag)
            print(f"[warm start] {name} run: first trained step {seconds:.1f} s after its command "
                  f"(mismatch KL {row['loss/mismatch_kl']:.2e})")
            assert seconds < ATTACHED_FIRST_STEP_S, seconds
            # the trainer scores with the run's own weights: vLLM served those, not the previous run's
            assert row["loss/mismatch_kl"] < 1e-3, row
        assert server.poll() is None, "the warm server keeps running after the runs"
        private = {path.parent for path in sockets if path.parent.name.startswith("prime-rl-inference-")}
        assert private and all(d.is_dir() for d in private), "its socket directory lives as long as it does"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        out, _ = server.communicate(timeout=120)
    assert server.returncode == 130, out
    assert not state.exists() and not key_file.exists(), "the state file and the drawn key go with their server"
    # the server's IPC sockets, in a directory of its own that went with it (not the short-lived runs')
    assert_no_ipc_socket_left(sockets, tmp_before)
    assert tagged_processes(tag) == [], "no process of the server or the runs may survive"
