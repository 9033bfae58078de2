"""The optional extras (pyproject.toml): a feature whose library is missing says, in one line,
which extra installs it; what the quickstart runs needs none; scripts/test.sh installs every
one the suite tests. A library's absence is simulated with ``sys.modules[name] = None``,
which makes its import fail as if it were not installed."""

import re
import subprocess
import sys
import tomllib

import pytest
from prime_rl.config import EnvConfig
from prime_rl.extras import EXTRAS, MissingExtra, import_extra
from prime_rl.settings import ConfigError

from helpers import REPO


def missing(extra: str, feature: str, distribution: str) -> str:
    """The exact line a missing extra gives."""
    return (f"{feature} needs {distribution}: uv sync --extra {extra} "
            f"(a CUDA machine: bash scripts/setup_cuda.sh --extra {extra})")


@pytest.fixture
def without(monkeypatch):
    """``without("bm25s")``: that library cannot be imported for the rest of the test."""

    def hide(module: str) -> None:
        for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, module, None)

    return hide


@pytest.fixture
def uncached_math_verify(monkeypatch):
    import orchestrator.envs.math_answers as math_answers

    monkeypatch.setattr(math_answers, "_math_verify", None)  # loaded once per process otherwise


@pytest.fixture
def uncached_common_words():
    from orchestrator.envs.wordle import common_words

    common_words.cache_clear()
    yield
    common_words.cache_clear()  # not the list-less answer of this test for the tests after it


@pytest.mark.parametrize(
    ("env_id", "args", "module"),
    [
        ("gsm8k", {"source": "generated", "num_train_examples": 2, "num_eval_examples": 0}, "math_verify"),
        ("math-python", {"source": "generated", "num_train_examples": 2, "num_eval_examples": 0}, "math_verify"),
        ("wordle", {"num_train_examples": 2, "num_eval_examples": 1}, "wordfreq"),
        ("wiki-search", {"source": "generated"}, "bm25s"),
    ],
)
def test_a_builtin_without_its_extra_names_it_in_one_line(env_id, args, module, without, uncached_math_verify,
                                                            uncached_common_words, tmp_path):
    from orchestrator.envs import load_env
    from orchestrator.main import load_envs

    without(module)
    distribution, extra = EXTRAS[module]
    expected = missing(extra, "wordle (without words_path)" if env_id == "wordle" else env_id, distribution)
    with pytest.raises(ValueError) as e:
        load_env(EnvConfig(id=env_id, args={**args, **({"cache_dir": str(tmp_path)} if env_id == "wiki-search" else {})}))
    assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:  # what the orchestrator prints, as it is, before exiting 2
        load_envs([EnvConfig(id=env_id, args=args)], tmp_path)
    assert str(e.value) == expected


def test_wordle_with_its_own_word_list_needs_no_extra(without, uncached_common_words, tmp_path):
    from orchestrator.envs.wordle import load_environment

    without("wordfreq")
    words = tmp_path / "words.txt"
    words.write_text("crane\nslate\nmoist\n")
    env = load_environment(words_path=str(words), num_train_examples=2, num_eval_examples=1)
    assert {e.answer for e in [*env.dataset, *env.eval_dataset]} <= {"crane", "slate", "moist"}


def test_lora_and_merging_an_adapter_without_peft(without, tmp_path):
    from torch import nn

    from prime_rl.config import LoraConfig
    from trainer.export import merged_model
    from trainer.lora import add_lora

    without("peft")
    with pytest.raises(MissingExtra) as e:
        add_lora(nn.Sequential(nn.Linear(2, 2)), LoraConfig())
    assert str(e.value) == missing("lora", "LoRA ([trainer.lora])", "peft")
    with pytest.raises(MissingExtra) as e:  # before the base model is read
        merged_model(tmp_path / "adapter", str(tmp_path / "no-such-base"))
    assert str(e.value) == missing("lora", "merging a LoRA adapter", "peft")


def test_prime_rl_gepa_without_gepa_is_one_line_before_anything_starts(without, capsys):
    from prime_rl import cli

    without("gepa")
    with pytest.raises(SystemExit) as e:
        cli.main(["gepa", "reverse-text", "-m", "no-such-model"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"prime-rl: {missing('gepa', 'prime-rl gepa', 'gepa')}\n"


def test_an_import_error_inside_an_installed_library_is_not_blamed_on_the_extra(monkeypatch, tmp_path):
    """A broken install (the library is there, one of its own imports fails) keeps its error:
    installing the extra again would not fix it."""
    (tmp_path / "half_installed_lib.py").write_text("import no_such_dependency_of_it\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXTRAS, "half_installed_lib", ("half-installed-lib", "half"))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_it"):
        import_extra("half_installed_lib", "a feature")


def test_every_extra_is_declared_and_installed_by_the_test_script():
    """EXTRAS names extras pyproject.toml declares with that library, and scripts/test.sh syncs
    each of them (the suite tests every feature), as scripts/env.sh's FEATURE_EXTRAS."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    listed = subprocess.run(["bash", "-c", 'source scripts/env.sh && echo "${FEATURE_EXTRAS[@]}"'], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True).stdout
    synced = set(re.findall(r"--extra ([\w-]+)", listed))
    sync_lines = [line for line in (REPO / "scripts" / "test.sh").read_text().splitlines() if line.startswith("uv sync")]
    assert sync_lines and all('"${FEATURE_EXTRAS[@]}"' in line for line in sync_lines), sync_lines
    for distribution, extra in EXTRAS.values():
        assert any(re.match(rf"{re.escape(distribution)}\b", r) for r in declared.get(extra, [])), (extra, declared)
        assert extra in synced, (extra, synced)


def test_the_quickstart_path_imports_no_extra():
    """The quickstart (`uv run prime-rl configs/reverse-text/rl.toml` after SFT) runs the CLI, the
    trainer, the orchestrator and reverse-text: none of them needs an extra, so a plain
    `uv sync` is enough for it. Checked in a fresh Python where every extra is missing."""
    hidden = ", ".join(repr(m) for m in EXTRAS)
    code = (
        f"import sys\nfor m in ({hidden},): sys.modules[m] = None\n"
        "import prime_rl.cli, orchestrator.main, trainer.rl, trainer.sft\n"
        "from orchestrator.envs import load_env\nfrom prime_rl.config import EnvConfig\n"
        "env = load_env(EnvConfig(id='reverse-text', args={'num_examples': 3}))\n"
        "print(len(env.dataset))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "3", proc.stderr[-3000:]
