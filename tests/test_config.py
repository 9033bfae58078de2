"""Config schema: layering, shared fields, the flat hosted form, and one-line errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from prime_rl.config import KNOWN_ENVIRONMENTS, EvalRunConfig, GepaRunConfig, RLConfig, SFTConfig
from prime_rl.endpoints import load_endpoints
from prime_rl.launch.resolve import resolve
from prime_rl.settings import ConfigError, load_config, parse_flags

ISSUE_BLOCK = """model = "Qwen/Qwen3-30B-A3B-Instruct-2507"
max_steps = 500
batch_size = 256
rollouts_per_example = 8

[sampling]
max_tokens = 512

[[env]]
id = "primeintellect/alphabet-sort"
args = { min_turns = 3, max_turns = 5, power_per_turn = false }

[wandb]
project = "alphabet-sort"
name = "qwen3-30b-i-alphabet-sort"
"""
"""The documentation's hosted-training block (configs/rl/alphabet-sort.toml holds it verbatim)."""

FLAT_FORM = ISSUE_BLOCK.replace("Qwen3-30B-A3B-Instruct-2507", "Qwen3-0.6B")


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_shipped_toml_parses():
    configs = sorted((REPO / "configs").rglob("*.toml"))
    assert configs, "no configs shipped"
    for path in configs:
        if path.name == "endpoints.toml":  # the endpoint registry of `prime-rl eval`, not a run config
            load_endpoints(path)
            continue
        if path.stem == "lora":  # an overlay, layered on the rl.toml beside it
            cfg = resolve(load_config(RLConfig, [path.parent / "rl.toml", path], []))
            assert cfg.trainer.lora is not None and cfg.inference.max_lora_rank is not None
            continue
        if path.stem in ("distill", "context-distill"):  # overlays too
            cfg = load_config(RLConfig, [path.parent / "rl.toml", path], [])
            assert cfg.teacher is not None and cfg.trainer.loss.distill is not None
            continue
        cls = {"eval": EvalRunConfig, "gepa": GepaRunConfig}.get(path.parent.name) or (SFTConfig if path.stem.startswith("sft") else RLConfig)
        load_config(cls, [path], [])


def test_flat_hosted_form_is_accepted_and_fills_sections(tmp_path):
    cfg = load_config(RLConfig, [write(tmp_path, FLAT_FORM)], [])
    assert cfg.orchestrator.batch_size == 256 and cfg.orchestrator.rollouts_per_example == 8
    assert cfg.orchestrator.sampling.max_tokens == 512
    assert cfg.orchestrator.env[0].args["max_turns"] == 5
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 500
    assert cfg.trainer.model.name == cfg.orchestrator.model == cfg.inference.model == "Qwen/Qwen3-0.6B"
    assert cfg.trainer.wandb.project == cfg.orchestrator.wandb.project == "alphabet-sort"


def test_unknown_environment_names_known_ids(tmp_path):
    text = FLAT_FORM.replace("primeintellect/alphabet-sort", "primeintellect/alphabet-sorter")
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, [write(tmp_path, text)], [])
    msg = str(e.value)
    assert "alphabet-sorter" in msg and all(k in msg for k in KNOWN_ENVIRONMENTS) and "uv pip install -e" in msg
    assert len(msg.splitlines()) == 1


def test_cli_flags_override_toml_and_use_kebab_dotted_names(tmp_path):
    path = write(tmp_path, FLAT_FORM)
    cfg = load_config(RLConfig, [path], ["--max-steps", "10", "--trainer.optim.lr", "1e-5", "--output-dir", "x/y"])
    assert cfg.trainer.max_steps == 10 and cfg.orchestrator.max_steps == 10
    assert cfg.trainer.optim.lr == 1e-5
    assert str(cfg.trainer.output_dir) == "x/y" == str(cfg.orchestrator.output_dir)


def test_parse_flags_shapes():
    assert parse_flags(["--a.b-c", "1", "--flag", "--no-other", "--x=2"]) == {
        "a": {"b_c": "1"},
        "flag": True,
        "other": False,
        "x": "2",
    }


def test_typo_exits_nonzero_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    path = write(tmp_path, f'output_dir = "{run_dir}"\n[trainer]\nlrr = 1\n')
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(path), "--no-tmux"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown key `lrr` in [trainer]" in proc.stderr
    assert not run_dir.exists(), "a rejected config must not touch the run directory"


def test_missing_model_path_is_rejected(tmp_path):
    path = write(tmp_path, f'model = "{tmp_path}/nope/model"\noutput_dir = "{tmp_path}/run"\n')
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(path), "--dry-run"], capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "trainer.model.name" in proc.stderr


def test_dry_run_writes_each_process_config(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    path = write(tmp_path, f'model = "{tiny_model}"\noutput_dir = "{run_dir}"\nmax_steps = 7\n')
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(path), "--dry-run"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    from prime_rl.config import InferenceConfig, OrchestratorConfig, TrainerConfig

    for name, cls in [("trainer", TrainerConfig), ("orchestrator", OrchestratorConfig), ("inference", InferenceConfig)]:
        resolved = cls.model_validate_json((run_dir / "configs" / f"{name}.json").read_text())
        assert getattr(resolved, "max_steps", 7) == 7
    assert not (run_dir / "weights").exists()


def test_help_lists_documented_flags():
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "--trainer.optim.lr" in proc.stdout and "AdamW learning rate" in proc.stdout


def test_contracts_do_not_import_torch_or_vllm():
    code = "import sys, prime_rl.cli, prime_rl.wire, prime_rl.metrics, prime_rl.envs; print(sorted(m for m in ('torch','vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ["reverse-text", "alphabet-sort", "gsm8k", "wordle", "wiki-search", "math-python"])
def test_documented_hosted_configs_pass_dry_run_as_written(tmp_path, name):
    """configs/rl/*.toml, copied as users copy them, validate offline (no hub access): the
    command is run from an empty folder, where their default output_dir lands."""
    path = REPO / "configs" / "rl" / f"{name}.toml"
    if name == "alphabet-sort":
        assert path.read_text() == ISSUE_BLOCK  # the documentation's block, exactly
    done = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(path), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    orchestrator = json.loads((tmp_path / "outputs" / "run" / "configs" / "orchestrator.json").read_text())
    assert orchestrator["env"][0]["id"] == f"primeintellect/{name}"


def test_tool_call_parser_reaches_vllm_and_the_orchestrator():
    """`[inference] tool_call_parser` starts vLLM with its parser and the derender route, and
    the orchestrator learns which parser reads its tool calls."""
    from prime_rl.vllm_command import vllm_command
    from prime_rl.config import RLConfig

    cfg = resolve(RLConfig.model_validate({"env": [{"id": "wiki-search"}], "inference": {"tool_call_parser": "hermes"}}))
    assert cfg.orchestrator.tool_call_parser == "hermes"
    cmd = vllm_command(cfg.inference, cpu=True)
    i = cmd.index("--tool-call-parser")
    assert cmd[i + 1] == "hermes" and "--enable-auto-tool-choice" in cmd and "--enable-scale-out" in cmd
    assert "--tool-call-parser" not in vllm_command(RLConfig().inference, cpu=True)


def test_trainer_lora_turns_on_adapters_in_inference_and_the_orchestrator():
    """`[trainer.lora]` alone is the whole switch: vLLM serves adapters of a rank it accepts
    (the next of its fixed ranks), with runtime loading, and the orchestrator loads each
    step's adapter under one name; inconsistent settings are refused in one line."""
    from prime_rl.vllm_command import vllm_command, vllm_env
    from prime_rl.config import RLConfig

    cfg = resolve(RLConfig.model_validate({"trainer": {"lora": {"rank": 12}}}))
    assert cfg.inference.max_lora_rank == 16 and cfg.orchestrator.lora_adapter == "policy-lora"
    cmd = vllm_command(cfg.inference, cpu=True)
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert vllm_env(cfg.inference, cpu=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    full = RLConfig()
    assert full.inference.max_lora_rank is None and full.orchestrator.lora_adapter is None
    assert "--enable-lora" not in vllm_command(full.inference, cpu=True)

    for data, message in [
        ({"trainer": {"lora": {"rank": 16}}, "inference": {"max_lora_rank": 8}}, "max_lora_rank (8) is below trainer.lora.rank (16)"),
        ({"trainer": {"lora": {"rank": 8}}, "inference": {"max_lora_rank": 24}}, "vLLM accepts one of"),
        ({"orchestrator": {"lora_adapter": "x"}}, "`[trainer.lora]` is not"),
        ({"trainer": {"lora": {"target_modules": []}}}, "expected at least one module name"),
        ({"trainer": {"lora": {"rank": 1024}}}, "less than or equal to 512"),
        ({"trainer": {"lora": {"rnak": 8}}}, "rnak"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            RLConfig.model_validate(data)


def test_the_runs_seed_seeds_vllms_sampling_too():
    """`seed` reaches every process: data order, the trainer and vLLM's sampling (`--seed`);
    without one, vLLM keeps its own default."""
    from prime_rl.vllm_command import vllm_command
    from prime_rl.config import RLConfig

    cfg = resolve(RLConfig.model_validate({"seed": 3}))
    assert (cfg.trainer.seed, cfg.orchestrator.seed, cfg.inference.seed) == (3, 3, 3)
    cmd = vllm_command(cfg.inference, cpu=True)
    assert cmd[cmd.index("--seed") + 1] == "3"
    assert "--seed" not in vllm_command(RLConfig().inference, cpu=True)


def test_vllm_ignores_the_models_generation_defaults():
    """A model's generation_config.json (Qwen3: top_k 20, top_p 0.8) must not reshape what
    vLLM samples: the server starts with vLLM's own defaults, the full softmax."""
    from prime_rl.vllm_command import vllm_command
    from prime_rl.config import RLConfig

    cmd = vllm_command(RLConfig().inference, cpu=True)
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"


def test_process_config_reads_config_flags_in_every_form(tmp_path):
    """A process's `--config PATH` and `--config=PATH` both load the file (flags still win);
    `--config` without a path is a one-line error, not an IndexError."""
    from prime_rl.config import SFTConfig
    from prime_rl.settings import ConfigError, process_config

    path = tmp_path / "sft.toml"
    path.write_text("max_steps = 7\nseq_len = 64\n")
    assert process_config(SFTConfig, ["--config", str(path)]).max_steps == 7
    assert process_config(SFTConfig, [f"--config={path}", "--max-steps", "9"]).max_steps == 9
    assert process_config(SFTConfig, ["--max-steps", "9", "--config", str(path)]).seq_len == 64
    for argv in (["--config"], ["--max-steps", "3", "--config"], ["--config", "--max-steps", "3"], ["--config="]):
        with pytest.raises(ConfigError, match="--config: expected the path of a config file"):
            process_config(SFTConfig, argv)


def prompt_file_error(tmp_path, prompt) -> str | None:
    """The one-line error of an `[[env]]` entry with this `system_prompt_file` (None: accepted)."""
    config = tmp_path / "prompt.toml"
    config.write_text(f'[[env]]\nid = "reverse-text"\nsystem_prompt_file = "{prompt}"\n')
    try:
        load_config(RLConfig, [config], [])
    except ConfigError as e:
        assert len(str(e).splitlines()) == 1, str(e)
        return str(e)
    return None


def test_system_prompt_file_must_be_a_plain_text_file(tmp_path):
    """A directory is named as one (not "does not exist"); kernel views (/proc, /sys, /dev, also
    through a symlink) and other non-regular files are refused: their text would become every
    example's system prompt."""
    (tmp_path / "environ").symlink_to("/proc/self/environ")
    os.mkfifo(tmp_path / "fifo")
    expected = {
        tmp_path: "is a directory, expected a text file",
        "/proc/self/environ": "lies under /proc, a view of the system",
        tmp_path / "environ": "lies under /proc, a view of the system",
        "/sys/kernel/notes": "lies under /sys",
        "/dev/null": "lies under /dev",
        tmp_path / "fifo": "is not a regular file",
        tmp_path / "missing.txt": "does not exist",
    }
    for prompt, text in expected.items():
        error = prompt_file_error(tmp_path, prompt)
        assert error is not None and f"system_prompt_file: '{prompt}' {text}" in error, (prompt, error)
    (tmp_path / "prompt.txt").write_text("Be brief.")
    assert prompt_file_error(tmp_path, tmp_path / "prompt.txt") is None


@pytest.mark.parametrize("euid", [0, 1000])
def test_a_root_only_prompt_file_is_refused_when_running_as_root(tmp_path, monkeypatch, euid):
    """Root reads every file, so a file others may not read (/etc/shadow's mode) would leak into
    the prompts; it is refused when running as root, and read as before otherwise."""
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    secret.chmod(0o640)
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setattr(os, "access", lambda path, mode: True)  # the owner may read it
    error = prompt_file_error(tmp_path, secret)
    if euid == 0:
        assert error is not None and "is readable only with root's privileges; make it world-readable (chmod a+r)" in error
        secret.chmod(0o644)
        assert prompt_file_error(tmp_path, secret) is None
    else:
        assert error is None
