"""Preflight: the documentation's advice on a task the model always fails, and on one it
always solves, read from the first step's groups; strict turns advice into an error (exit
code 2) before step 0 is sent."""

import pytest
from prime_rl.config import PreflightConfig
from prime_rl.envs import Rollout
from prime_rl.rundir import metrics_path, read_jsonl
from pydantic import ValidationError

from fake_inference import FakeInferenceServer
from orchestrator.main import main
from orchestrator.preflight import PreflightFailed, preflight
from orchestrator.rollouts import pass_at_k, summarize

from helpers import free_port


def run_preflight(rewards_of_group, groups=6, attempts=10, envs=("reverse-text",), **overrides):
    """The check on ``groups`` groups of ``attempts`` rollouts, rewards ``rewards_of_group(i)``."""
    checked = [(envs[0], [Rollout(i, [], float(r)) for r in rewards_of_group(i)]) for i in range(groups)]
    lines = []
    return preflight(checked, list(envs), PreflightConfig(**overrides), lines.append), lines


def test_a_task_the_model_always_fails_gets_the_too_hard_advice():
    row, lines = run_preflight(lambda i: [0] * 10)
    assert row["preflight/reverse-text/reward/mean"] == 0.0 and row["preflight/reverse-text/all_zero_frac"] == 1.0
    advice = [line for line in lines if line.startswith("preflight advice")]
    assert any("100% of reverse-text's examples scored 0 on all 10 attempts: the task is too hard" in a for a in advice)
    assert not any("too easy" in a for a in advice)


def test_a_task_the_model_always_solves_gets_the_too_easy_advice():
    row, lines = run_preflight(lambda i: [1] * 10)
    assert row["preflight/reverse-text/reward/mean"] == 1.0 and row["preflight/reverse-text/easy_frac"] == 1.0
    advice = [line for line in lines if line.startswith("preflight advice")]
    assert any("mean reward of 0.8 or more: the task is too easy" in a for a in advice)
    assert any("same reward on all 10 attempts" in a for a in advice)  # no diversity either
    assert not any("too hard" in a for a in advice)
    assert "preflight reverse-text: mean reward 1.000 over the first step's 6 examples x 10" in lines[0]
    assert row["preflight/reverse-text/examples"] == 6


def test_a_task_in_reach_gets_no_advice():
    row, lines = run_preflight(lambda i: [j % 2 for j in range(10)])
    assert row["preflight/reverse-text/reward/mean"] == pytest.approx(0.5)
    assert not [line for line in lines if line.startswith("preflight advice")]


def test_each_environment_is_checked_on_its_own_groups_and_one_without_any_is_named():
    checked = [("a", [Rollout(0, [], 0.0)] * 4), ("b", [Rollout(1, [], 1.0), Rollout(1, [], 0.0)] * 2), ("a", [Rollout(2, [], 0.0)] * 4)]
    lines = []
    row = preflight(checked, ["a", "b", "c"], PreflightConfig(), lines.append)
    assert row == {
        "preflight/a/reward/mean": 0.0, "preflight/a/examples": 2, "preflight/a/all_zero_frac": 1.0,
        "preflight/a/easy_frac": 0.0, "preflight/a/no_diversity_frac": 1.0,
        "preflight/b/reward/mean": 0.5, "preflight/b/examples": 1, "preflight/b/all_zero_frac": 0.0,
        "preflight/b/easy_frac": 0.0, "preflight/b/no_diversity_frac": 0.0,
    }
    assert "preflight c: no group of it in the first step, not checked" in lines
    assert any("a's examples scored 0 on all 4 attempts" in line for line in lines)


def test_strict_makes_advice_an_error():
    with pytest.raises(PreflightFailed, match="preflight \\(strict\\).*too hard.*preflight.strict = false"):
        run_preflight(lambda i: [0] * 10, strict=True)


@pytest.mark.parametrize("key", ["num_examples", "rollouts_per_example"])
def test_the_removed_sample_settings_are_named_with_what_replaced_them(key):
    with pytest.raises(ValidationError, match=f"{key} is gone: the preflight now checks the first step.s groups"):
        PreflightConfig.model_validate({key: 4})


def nothing(messages, index):
    return ""


def test_strict_preflight_stops_the_orchestrator_with_exit_code_2(tmp_path, capsys, tiny_model):
    with FakeInferenceServer(responder=nothing) as server:
        code = main([
            "--model", str(tiny_model), "--client.base-url", server.url, "--transport.port", str(free_port()),
            "--output-dir", str(tmp_path), "--batch-size", "4", "--rollouts-per-example", "2", "--max-steps", "1",
            "--preflight.strict", "true",
            "--env", '[{"id": "reverse-text", "args": {"num_examples": 8}}]',
        ])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("too hard") == 1 and "Traceback" not in err
    # it stopped before step 0 was sent: no step logged, nothing recorded for a resume
    assert [r for r in read_jsonl(metrics_path(tmp_path)) if "step" in r] == []
    assert not (tmp_path / "rollouts").exists()


def test_summary_figures_by_hand():
    from prime_rl.envs import Rollout

    def group(*rewards):
        return [Rollout(0, [], r, metrics={"m": r / 2}) for r in rewards]

    s = summarize([group(0, 0, 0, 0), group(1, 1, 1, 1), group(1, 0, 0, 0)])
    assert s["reward/mean"] == pytest.approx(5 / 12)
    assert (s["all_zero_frac"], s["easy_frac"], s["no_diversity_frac"]) == pytest.approx((1 / 3, 1 / 3, 2 / 3))
    assert s["metrics/m"] == pytest.approx(5 / 24)
    assert s["pass@1"] == pytest.approx((0 + 1 + 0.25) / 3)
    assert s["pass@4"] == pytest.approx((0 + 1 + 1) / 3)
    assert s["pass@2"] == pytest.approx((0 + 1 + pass_at_k(4, 1, 2)) / 3) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert "pass@1" not in summarize([group(0.5, 1)])  # not binary: no pass@k


def test_a_config_with_a_removed_key_gets_one_line_naming_the_section(tmp_path):
    from prime_rl.config import RLConfig
    from prime_rl.settings import ConfigError, load_config

    path = tmp_path / "run.toml"
    path.write_text('model = "m"\n[preflight]\nrollouts_per_example = 10\n')
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, [path], [])
    assert "preflight: rollouts_per_example is gone: the preflight now checks the first step's groups" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
