"""A user's environment module, installed into the venv, runs by its dashed id.

`examples/my-env` is installed editable (`uv pip install -e`), as the README tells users;
`id = "my-env"` then passes the launcher's validation and the orchestrator plays it
against a stand-in vLLM (this test plays the trainer). An unknown id lists the known ones.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from prime_rl.config import KNOWN_ENVIRONMENTS
from prime_rl.wire import sample_arrays

from fake_inference import IM_END, FakeInferenceServer

from helpers import REPO, free_port, orchestrator_process

MY_ENV = REPO / "examples" / "my-env"


@pytest.fixture(scope="module")
def my_env_installed():
    uv = shutil.which("uv")
    assert uv, "uv is needed to install the example environment (scripts/env.sh installs it)"
    install = [uv, "pip", "install", "--quiet", "--python", sys.executable, "--no-deps", "-e", str(MY_ENV)]
    subprocess.run(install, check=True, capture_output=True, text=True)
    try:
        yield
    finally:
        subprocess.run([uv, "pip", "uninstall", "--quiet", "--python", sys.executable, "my-env"], capture_output=True)


def cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the venv has installed
    return subprocess.run([sys.executable, "-m", "prime_rl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_installed_module_passes_validation_by_its_dashed_id(my_env_installed, tmp_path, tiny_model):
    config = tmp_path / "rl.toml"
    config.write_text(f'model = "{tiny_model}"\noutput_dir = "{tmp_path / "run"}"\n[[env]]\nid = "my-env"\nargs = {{ high = 10 }}\n')
    done = cli(str(config), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    orchestrator = json.loads((tmp_path / "run" / "configs" / "orchestrator.json").read_text())
    assert orchestrator["env"][0]["id"] == "my-env"


def test_unknown_id_lists_the_known_ones_and_how_to_install(tmp_path, tiny_model):
    config = tmp_path / "rl.toml"
    config.write_text(f'model = "{tiny_model}"\noutput_dir = "{tmp_path / "run"}"\n[[env]]\nid = "my-envv"\n')
    done = cli(str(config), "--dry-run", cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "unknown environment id 'my-envv'" in line and all(k in line for k in KNOWN_ENVIRONMENTS)
    assert "'my_envv'" in line and "uv pip install -e" in line
    assert not (tmp_path / "run").exists(), "a refused config must not touch the run directory"


def guess_fifty(messages, index):
    return "<guess>50</guess>"


def test_the_orchestrator_plays_the_installed_module(my_env_installed, tmp_path, tiny_model):
    port = free_port()
    config = {
        "model": str(tiny_model),
        "env": [{"id": "my-env", "args": {"high": 10, "max_turns": 3, "num_examples": 20}}],
        "sampling": {"max_tokens": 32},
        "transport": {"port": port, "timeout_s": 60},
        "preflight": {"enabled": False},
        "batch_size": 4,
        "rollouts_per_example": 2,
        "max_steps": 1,
        "seq_len": 512,
        "output_dir": str(tmp_path),
    }
    with FakeInferenceServer(responder=guess_fifty) as server:
        config["client"] = {"base_url": server.url, "timeout_s": 10}
        installed_only = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with orchestrator_process(config, tmp_path, env=installed_only) as receive:
            batch = receive(0)
    samples = [s for m in batch.micro_batches for s in m.samples]
    assert len(samples) == 4
    for sample in samples:  # never 50 out of 1..10: three guesses, each its own span of sampled tokens
        ids, mask, _ = sample_arrays(sample)
        spans = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        assert len(spans) == 3 and ids[mask].tolist().count(IM_END) == 3
    assert bytes(t for t in ids if t < 256).decode().count("Lower.") == 2
