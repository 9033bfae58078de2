"""Verifiers v1 tasksets (verifiers 0.4.0), unchanged, in their own virtual environment.

The fixture tasksets (tests/fixtures/verifiers_envs/v1-*) are installed with
verifiers==0.4.0 into a cached throwaway venv. The worker runs them with v1's own `null`
harness on the `subprocess` runtime; v1's training client renders each prompt to token ids
itself and posts it to a route the worker serves, which hands it to the orchestrator's
exact-token client (here against the fake vLLM; this test plays the trainer). Each trace's
branch is one training sample: checked token by token against what the fake server was
sent and returned.
"""

from __future__ import annotations

import difflib

import pytest
from prime_rl.wire import sample_arrays

from fake_inference import FakeInferenceServer

from helpers import mask_spans
from verifiers_helpers import (
    check_reversals, check_three_turns, completion_prompts, eval_results, metrics_row, one_batch, orchestrator_config, reverse,
)
from verifiers_venvs import V1, verifiers_venv


@pytest.fixture(scope="session")
def vf04_python():
    return verifiers_venv("0.4.0", V1)


def test_v1_single_turn_taskset_is_played_with_exact_tokens(vf04_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=reverse) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "v1-reverse", "python": str(vf04_python)}, server.url)
        samples = one_batch(config, tmp_path)
        prompts = completion_prompts(server)
    assert len(samples) == 4 and len(prompts) == 4
    check_reversals(samples, prompts)  # the prompts v1 rendered, exactly as sent to vLLM
    row = metrics_row(tmp_path)
    assert {"reward/v1-reverse/mean", "metrics/v1-reverse/reversed_match", "metrics/v1-reverse/reply_len"} <= row.keys()
    assert row["errors/v1-reverse/reversed_match"] == 0 and row["reward/v1-reverse/mean"] > 0
    log = (tmp_path / "logs" / "env-v1-reverse.log").read_text()
    assert "loaded a verifiers v1 taskset" in log and "verifiers 0.4.0" in log


def word_reply(messages, index):
    return f"ping pong tick tock {index}"


def test_v1_multi_turn_taskset_trains_each_branch_as_one_exact_sequence(vf04_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=word_reply) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "v1-again", "python": str(vf04_python)}, server.url)
        samples = one_batch(config, tmp_path)
        prompts = completion_prompts(server)
    assert len(samples) == 4 and len(prompts) == 12  # 4 episodes x 3 model turns
    for sample in samples:
        check_three_turns(sample, prompts, reply_start="ping pong tick tock", env_text="again")
        assert sample.reward == pytest.approx(1.0)  # the task's word said in every turn: all four are in the reply
    row = metrics_row(tmp_path)
    assert row["metrics/v1-again/model_turns"] == pytest.approx(3.0) and row["seq/turns_mean"] == pytest.approx(3.0)


def test_eval_of_a_v1_taskset_writes_results_with_rewards(vf04_python, tmp_path):
    _, rows = eval_results("v1-reverse", vf04_python, tmp_path, reverse, n=2, r=2)
    assert len(rows) == 4
    for row in rows:
        reply = row["completion"][-1]["content"].strip()
        question = row["prompt"][-1]["content"]
        expected = 1.0 if reply == question[::-1] else difflib.SequenceMatcher(None, reply, question[::-1]).ratio()
        assert row["reward"] == pytest.approx(expected) and "reply_len" in row["metrics"]
    assert any(r["reward"] == 1.0 for r in rows)


def cut_mid_character(messages, index):
    return "é" * 40  # 2 bytes each: max_tokens 7 cuts the last one in half, which no text re-tokenizes to


def test_a_v1_client_that_rerenders_the_conversation_trains_exact_parts(vf04_python, tmp_path, tiny_model):
    """v1's default renderer re-renders earlier turns from their text; a reply cut in the
    middle of a character does not re-tokenize to what was sampled. Each turn's prompt is
    still exactly what vLLM saw: the rollout trains as one sample per turn that restarts."""
    with FakeInferenceServer(responder=cut_mid_character) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "v1-again", "python": str(vf04_python)}, server.url,
                                     sampling={"max_tokens": 7}, batch_size=2)
        samples = one_batch(config, tmp_path)
        prompts = completion_prompts(server)
    assert len(samples) > 2, "re-rendered turns start samples of their own"
    for sample in samples:
        ids, mask, _ = sample_arrays(sample)
        for start, _ in mask_spans(mask):
            assert ids[:start].tolist() in prompts  # every turn's prompt as vLLM saw it
    row = metrics_row(tmp_path)
    assert row["seq/restarted_frac"] == pytest.approx(1.0) and row["seq/turns_mean"] == pytest.approx(3.0)
