"""Preflight: the documentation's advice on a task the model always fails, and on one it
always solves; strict turns advice into an error (exit code 2)."""

import asyncio

import pytest
from prime_rl.config import ClientConfig, PreflightConfig, SamplingConfig
from transformers import AutoTokenizer

from orchestrator.client import InferenceClient
from orchestrator.envs.reverse_text import load_environment
from fake_inference import FakeInferenceServer
from orchestrator.main import main
from orchestrator.preflight import PreflightFailed, preflight
from orchestrator.rollouts import pass_at_k, summarize
from orchestrator.sampler import TokenSampler

from helpers import free_port


def run_preflight(tiny_model, responder, **overrides):
    cfg = PreflightConfig(num_examples=6, rollouts_per_example=10, **overrides)
    lines = []

    async def go():
        with FakeInferenceServer(responder=responder) as server:
            client = InferenceClient(ClientConfig(base_url=server.url), "tiny")
            sampler = TokenSampler(client, AutoTokenizer.from_pretrained(tiny_model), SamplingConfig(max_tokens=16), 256)
            try:
                return await preflight({"reverse-text": load_environment(num_examples=50)}, sampler, cfg, 0, lines.append)
            finally:
                await client.close()

    return asyncio.run(go()), lines


def reversed_user_text(messages, index):
    return messages[-1]["content"][::-1]


def nothing(messages, index):
    return ""


def test_a_task_the_model_always_fails_gets_the_too_hard_advice(tiny_model):
    row, lines = run_preflight(tiny_model, nothing)
    assert row["preflight/reverse-text/reward/mean"] == 0.0 and row["preflight/reverse-text/all_zero_frac"] == 1.0
    advice = [line for line in lines if line.startswith("preflight advice")]
    assert any("100% of reverse-text's examples scored 0 on all 10 attempts: the task is too hard" in a for a in advice)
    assert not any("too easy" in a for a in advice)


def test_a_task_the_model_always_solves_gets_the_too_easy_advice(tiny_model):
    row, lines = run_preflight(tiny_model, reversed_user_text)
    assert row["preflight/reverse-text/reward/mean"] == 1.0 and row["preflight/reverse-text/easy_frac"] == 1.0
    advice = [line for line in lines if line.startswith("preflight advice")]
    assert any("mean reward of 0.8 or more: the task is too easy" in a for a in advice)
    assert any("same reward on all 10 attempts" in a for a in advice)  # no diversity either
    assert not any("too hard" in a for a in advice)
    assert "preflight reverse-text: mean reward 1.000 over 6 examples x 10" in lines[0]


def test_a_task_in_reach_gets_no_advice(tiny_model):
    row, lines = run_preflight(tiny_model, lambda messages, i: reversed_user_text(messages, i) if i % 2 else "")
    assert row["preflight/reverse-text/reward/mean"] == pytest.approx(0.5)
    assert not [line for line in lines if line.startswith("preflight advice")]


def test_strict_makes_advice_an_error(tiny_model):
    with pytest.raises(PreflightFailed, match="preflight \\(strict\\).*too hard.*preflight.strict = false"):
        run_preflight(tiny_model, nothing, strict=True)


def test_strict_preflight_stops_the_orchestrator_with_exit_code_2(tmp_path, capsys, tiny_model):
    with FakeInferenceServer(responder=nothing) as server:
        code = main([
            "--model", str(tiny_model), "--client.base-url", server.url, "--transport.port", str(free_port()),
            "--output-dir", str(tmp_path), "--batch-size", "4", "--rollouts-per-example", "2", "--max-steps", "1",
            "--preflight.strict", "true", "--preflight.num-examples", "2",
            "--env", '[{"id": "reverse-text", "args": {"num_examples": 8}}]',
        ])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("too hard") == 1 and "Traceback" not in err


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
