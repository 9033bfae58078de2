"""Every port a local run binds is checked free before launch; a taken one is named in one
line with the process that holds it."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, free_port_pair
from prime_rl.cli import main, resolve_eval
from prime_rl.config import RLConfig
from prime_rl.launch.deployment import plan_single_node
from prime_rl.launch.deployment import rl_bindings
from prime_rl.launch.ports import Binding, port_problems
from prime_rl.settings import ConfigError

HOLD = "\n".join([
    "import socket, sys, time",
    "s = socket.socket()",
    "s.bind(('127.0.0.1', 0))",
    "s.listen()",
    "print(s.getsockname()[1], flush=True)",
    "time.sleep(120)",
])


@pytest.fixture
def held_port(tmp_path):
    """(port, pid) of another process, `python port_holder.py`, listening on 127.0.0.1."""
    script = tmp_path / "port_holder.py"
    script.write_text(HOLD)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline()), proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_listening_port_is_named_with_the_pid_and_command_that_hold_it(held_port, tmp_path):
    port, pid = held_port
    (line,) = port_problems([Binding("127.0.0.1", port, "inference.port")])
    assert line.startswith(f"port {port} on 127.0.0.1 (inference.port) is in use by pid {pid} ("), line
    assert f"({Path(sys.executable).name} {tmp_path / 'port_holder.py'})" in line, "the holder's command line"
    assert line.endswith(": stop it or choose another port")
    # a wildcard bind collides with the loopback listener too
    assert f"pid {pid}" in port_problems([Binding("0.0.0.0", port, "inference.port")])[0]


def test_free_ports_pass_and_a_port_chosen_twice_is_named():
    port = free_port()
    assert port_problems([Binding("127.0.0.1", port, "inference.port")]) == []
    (line,) = port_problems([Binding("127.0.0.1", port, "inference.port"), Binding("127.0.0.1", port, "transport.port")])
    assert line == f"port {port} is chosen twice, by inference.port and transport.port: choose another port for one of them"


def test_an_address_of_another_machine_cannot_be_bound():
    (line,) = port_problems([Binding("192.0.2.1", free_port(), "inference.host")])  # TEST-NET-1: never local
    assert "cannot be bound" in line


def test_every_replica_and_trainer_rank_port_is_listed():
    config = RLConfig.model_validate({
        "model": "m", "inference": {"port": 9000}, "transport": {"port": 7000},
        "deployment": {"inference_gpus": 2, "trainer_gpus": 2}, "batch_size": 8, "rollouts_per_example": 4,
    })
    bindings = rl_bindings(config, plan_single_node(config, 0))
    assert [(b.host, b.port, b.setting) for b in bindings] == [
        ("127.0.0.1", 9000, "inference.port"),
        ("127.0.0.1", 9001, "inference.port + 1"),
        ("127.0.0.1", 7000, "transport.port"),
        ("127.0.0.1", 7001, "transport.port + 1 (trainer rank 1)"),
    ]


def rl_config(tmp_path, tiny_model, inference_port: int):
    config = tmp_path / "rl.toml"
    config.write_text(
        f'model = "{tiny_model}"\noutput_dir = "{tmp_path / "run"}"\n'
        f"[transport]\nport = {free_port_pair()}\n[inference]\nport = {inference_port}\n"
    )
    return config


def test_a_run_stops_before_launch_and_a_dry_run_warns(tmp_path, tiny_model, held_port, capsys, monkeypatch):
    port, pid = held_port
    launched = []
    monkeypatch.setattr("prime_rl.commands.rl.run", lambda *args, **kwargs: launched.append(args) or 0)
    config = rl_config(tmp_path, tiny_model, port)
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--no-tmux"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and launched == []
    assert err.startswith(f"prime-rl: port {port} on 127.0.0.1 (inference.port) is in use by pid {pid}"), err
    assert len(err.splitlines()) == 1, err

    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--no-tmux", "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 0, "the port may be free by the time the run starts"
    assert f"[prime-rl] warning: port {port} on 127.0.0.1 (inference.port) is in use by pid {pid}" in err, err


def test_a_slurm_submission_does_not_check_this_machines_ports(tmp_path, tiny_model, held_port, capsys):
    port, _ = held_port
    config = rl_config(tmp_path, tiny_model, port)
    config.write_text(config.read_text() + "[slurm]\nnodes = 1\ngpus_per_node = 2\n")
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--slurm", "--dry-run"])
    assert exit_info.value.code == 0, capsys.readouterr().err


def test_eval_checks_a_port_the_user_chose(tmp_path, tiny_model, held_port):
    from prime_rl.cli import load_eval_config

    port, pid = held_port
    config = load_eval_config(["reverse-text", "-m", str(tiny_model), "--endpoints-path", str(tmp_path / "none.toml"),
                               "--inference.port", str(port)])
    with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 \\(inference.port\\) is in use by pid {pid}"):
        resolve_eval(config)
