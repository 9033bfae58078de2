"""Classic verifiers environments (verifiers 0.3.1), unchanged, in their own virtual environment.

The fixture packages (tests/fixtures/verifiers_envs) are installed with verifiers==0.3.1
into a cached throwaway venv (tests/verifiers_venvs.py); `[[env]] python` names its
interpreter. The orchestrator runs each environment in a worker process there and answers
every model call itself, here against the fake vLLM (this test plays the trainer), and the
batches are checked token by token against what the fake server was sent and returned.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from prime_rl.wire import sample_arrays

from fake_inference import FakeInferenceServer

from helpers import REPO, mask_spans, new_tag, tagged_processes
from verifiers_venvs import verifiers_venv
from verifiers_helpers import (
    check_reversals, check_three_turns, completion_prompts, eval_results, metrics_row, one_batch, orchestrator_config, reverse, text,
)
from verifiers_venvs import CLASSIC


@pytest.fixture(scope="session")
def vf03_python():
    return verifiers_venv("0.3.1", CLASSIC)


# --------------------------------------------------------------------------- single turn


def test_classic_single_turn_env_is_played_with_exact_tokens(vf03_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=reverse) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "vf-single", "python": str(vf03_python)}, server.url)
        samples = one_batch(config, tmp_path)
        prompts = completion_prompts(server)
    assert len(samples) == 4
    check_reversals(samples, prompts)
    assert sorted(s.reward for s in samples)[-1] == pytest.approx(1.0)
    row = metrics_row(tmp_path)
    assert {"reward/vf-single/mean", "metrics/vf-single/lcs_reward", "metrics/vf-single/answer_len"} <= row.keys()
    assert row["errors/vf-single/lcs_reward"] == 0
    log = (tmp_path / "logs" / "env-vf-single.log").read_text()
    assert "loaded a classic verifiers environment (SingleTurnEnv) with verifiers 0.3.1" in log


# --------------------------------------------------------------------------- multi-turn


def chatter(messages, index):
    return f"reply {index} about the topic"


def test_classic_multi_turn_env_concatenates_the_sampled_turns(vf03_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=chatter) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "vf-multi", "python": str(vf03_python)}, server.url)
        samples = one_batch(config, tmp_path)
        prompts = completion_prompts(server)
    assert len(samples) == 4 and len(prompts) == 12  # 4 rollouts x 3 turns
    for sample in samples:
        check_three_turns(sample, prompts, reply_start="reply ", env_text="user\n")
    row = metrics_row(tmp_path)
    assert row["metrics/vf-multi/num_turns"] == pytest.approx(3.0)
    assert row["stop/enough_turns_frac"] == pytest.approx(1.0)
    assert row["seq/turns_mean"] == pytest.approx(3.0)


# --------------------------------------------------------------------------- tools


def call_then_answer(messages, index):
    """First turn: call the tool the question names; after its result (a user turn of the
    template, `<tool_response>` being a special token the fake's decoding drops): answer with it."""
    last = str(messages[-1]["content"])
    if "?" not in last:
        return "The answer is " + last.strip()
    if "add tool" in last:
        a, b = [int(w) for w in last.replace("?", " ").split() if w.isdigit()][:2]
        call = {"name": "add", "arguments": {"a": a, "b": b}}
    else:
        call = {"name": "lookup", "arguments": {"key": last.split("'")[1]}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def test_classic_tool_env_runs_verifiers_tools_on_calls_parsed_by_the_server(vf03_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=call_then_answer) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "vf-tools", "python": str(vf03_python)}, server.url,
                                     tool_call_parser="hermes", sampling={"max_tokens": 128})
        samples = one_batch(config, tmp_path)
        derendered = [p for _, p, _ in server.calls if p == "/v1/chat/completions/derender"]
    assert derendered, "tool calls are read by the server's parser"
    row = metrics_row(tmp_path)
    assert row["metrics/vf-tools/total_tool_calls"] == pytest.approx(1.0)
    assert row["reward/vf-tools/mean"] == pytest.approx(1.0), "the tool's result reached the model and the answer"
    from transformers import AutoTokenizer

    tool_response = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("<tool_response>")
    for sample in samples:
        ids, mask, _ = sample_arrays(sample)
        runs = mask_spans(mask)
        assert len(runs) == 2
        between = ids[runs[0][1] : runs[1][0]]
        assert tool_response in between.tolist() and not mask[runs[0][1] : runs[1][0]].any()  # the tool result: out of the loss
        assert text(between).strip().split("\n")[-3] in text(ids[runs[1][0] :])  # ... and what the model answered with


# --------------------------------------------------------------------------- group rewards, errors


def same_word(messages, index):
    return str(messages[-1]["content"]).split()[-1] if index % 2 == 0 else f"other{index}"


def test_group_reward_functions_and_rubric_groups_score_whole_groups(vf03_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=same_word) as server:
        config = orchestrator_config(tmp_path, tiny_model, {"id": "vf-group", "python": str(vf03_python)}, server.url,
                                     batch_size=8, rollouts_per_example=4)
        samples = one_batch(config, tmp_path)
    row = metrics_row(tmp_path)
    for name in ("exact_match", "diversity", "brevity", "num_chars"):
        assert f"metrics/vf-group/{name}" in row and row[f"errors/vf-group/{name}"] == 0
    # diversity is a group function: 1 for a completion unique within its group, 0 for a repeat
    assert 0.0 < row["metrics/vf-group/diversity"] < 1.0
    assert len({round(s.advantage, 6) for s in samples}) > 1


def test_a_raising_reward_function_scores_zero_and_is_counted(vf03_python, tmp_path, tiny_model):
    with FakeInferenceServer(responder=reverse) as server:
        env = {"id": "vf-broken", "python": str(vf03_python), "args": {"mode": "reward"}}
        samples = one_batch(orchestrator_config(tmp_path, tiny_model, env, server.url), tmp_path)
    row = metrics_row(tmp_path)
    assert row["errors/vf-broken/explode"] == 4 and row["metrics/vf-broken/explode"] == 0.0
    assert row["errors/vf-broken/always_one"] == 0 and row["metrics/vf-broken/always_one"] == 1.0
    assert all(s.reward == pytest.approx(1.0) for s in samples)
    log = (tmp_path / "logs" / "env-vf-broken.log").read_text()
    assert log.count("reward function explode raised") == 1 and "ZeroDivisionError" in log


# --------------------------------------------------------------------------- bad input


def dry_run(tmp_path, model, entry: str, env: dict | None = None) -> subprocess.CompletedProcess:
    config = tmp_path / "rl.toml"
    config.write_text(f'model = "{model}"\noutput_dir = "{tmp_path / "run"}"\n[[env]]\n{entry}\n')
    return subprocess.run([sys.executable, "-m", "prime_rl.cli", str(config), "--dry-run"], capture_output=True,
                          text=True, env=env, cwd=tmp_path)


def test_bad_python_entries_are_one_line_errors_before_anything_starts(vf03_python, tmp_path, tiny_model):
    cases = {
        f'id = "vf-single"\npython = "{tmp_path}/nope/bin/python"': "does not exist",
        f'id = "vf-single"\npython = "{sys.executable}"': "has no verifiers installed",
        f'id = "vf-nowhere"\npython = "{vf03_python}"': "module 'vf_nowhere' is not importable",
        'id = "vf-single"': "imports verifiers",
    }
    for entry, expected in cases.items():
        done = dry_run(tmp_path, tiny_model, entry)
        if expected == "imports verifiers":  # found nowhere here: the launcher says how to name its Python
            assert done.returncode == 2 and "python = " in done.stderr, done.stderr
            continue
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert expected in line and "prime-rl:" in line, line
        assert not (tmp_path / "run").exists()


def run_orchestrator_setup(tmp_path, model, env_entry: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    config = orchestrator_config(tmp_path, model, env_entry, "http://127.0.0.1:9")
    path = tmp_path / "orchestrator.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "orchestrator.main", "--config", str(path)], capture_output=True,
                          text=True, timeout=180, env=env or {**os.environ, "PYTHONPATH": str(REPO / "src")})


def test_an_environment_that_fails_to_load_is_one_line_naming_it(vf03_python, tmp_path, tiny_model):
    done = run_orchestrator_setup(tmp_path, tiny_model, {"id": "vf-broken", "python": str(vf03_python)})
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "environment 'vf-broken'" in line and "ValueError: boom from load_environment" in line


def test_a_load_that_reaches_for_the_hub_names_the_call_and_what_to_pass(vf03_python, tmp_path, tiny_model):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}  # fail at once, as offline does after retries
    done = run_orchestrator_setup(tmp_path, tiny_model, {"id": "vf-broken", "python": str(vf03_python),
                                                         "args": {"mode": "hub"}}, env=env)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "environment 'vf-broken'" in line and "datasets" in line and "load_dataset" in line
    assert "reached for the network" in line and "pass a local copy" in line and "vf_broken.py" in line


# --------------------------------------------------------------------------- the worker's life


def slow_reply(messages, index):
    time.sleep(0.5)
    return "x"


def start_sampling(tmp_path, model, env_id: str, python, server, tag: str, **popen) -> subprocess.Popen:
    """The orchestrator on a long run, returned once the fake server got its first sampling request."""
    config = orchestrator_config(tmp_path, model, {"id": env_id, "python": str(python)}, server.url, max_steps=50)
    path = tmp_path / "orchestrator.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.main", "--config", str(path)], env=env, **popen)
    deadline = time.monotonic() + 120
    while not any("/v1/completions" in p for _, p, _ in server.calls):
        assert time.monotonic() < deadline and proc.poll() is None, "the orchestrator never sampled"
        time.sleep(0.2)
    return proc


def test_a_worker_that_goes_silent_stops_the_run_with_one_line(vf03_python, tmp_path, tiny_model):
    """A reward function that blocks the worker's event loop: no heartbeat for
    worker_timeout_s, so the orchestrator kills the worker and stops, naming it."""
    with FakeInferenceServer(responder=reverse) as server:
        env = {"id": "vf-broken", "python": str(vf03_python), "args": {"mode": "hang"}, "worker_timeout_s": 3}
        path = tmp_path / "orchestrator.json"
        path.write_text(json.dumps(orchestrator_config(tmp_path, tiny_model, env, server.url)))
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "orchestrator.main", "--config", str(path)], capture_output=True,
                              text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        took = time.monotonic() - started
    assert done.returncode == 1 and took < 120, done.stderr
    (line,) = [s for s in done.stderr.strip().splitlines() if s.startswith("[orchestrator] error")]
    assert "environment 'vf-broken': its worker sent nothing for 3 s" in line and "it hangs" in line


def test_a_verifiers_version_outside_the_supported_ranges_is_one_line(tmp_path):
    """The probe's answer from a Python with verifiers 0.2.0 (a stand-in interpreter)."""
    from prime_rl.registry import ProbeError, check_worker_python, verifiers_api

    assert [verifiers_api(v) for v in ("0.2.9", "0.3.0", "0.3.1", "0.4.0", "0.4.2rc1", "0.5.0")] == [
        None, "classic", "classic", "v1", "v1", None]
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text('#!/bin/sh\necho \'{"verifiers": "0.2.0", "found": true, "python": "3.11.7"}\'\n')
    python.chmod(0o755)
    with pytest.raises(ProbeError, match=r"has verifiers 0\.2\.0; supported: 0\.3\.x \(classic API\) or 0\.4\.x"):
        check_worker_python("old-env", python)


def test_killing_the_worker_stops_the_orchestrator_with_one_line_naming_the_environment(vf03_python, tmp_path, tiny_model):
    tag = new_tag()
    with FakeInferenceServer(responder=slow_reply) as server:
        proc = start_sampling(tmp_path, tiny_model, "vf-multi", vf03_python, server, tag,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            (worker,) = [pid for pid, cmd in tagged_processes(tag) if "vfworker_main.py" in cmd]
            killed = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            stopped_s = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1 and stopped_s < 10
    (line,) = [s for s in err.strip().splitlines() if s.startswith("[orchestrator] error")]
    assert "environment 'vf-multi'" in line and "killed by signal 9" in line and "env-vf-multi.log" in line
    assert not tagged_processes(tag)


def test_the_worker_dies_with_the_orchestrator(vf03_python, tmp_path, tiny_model):
    tag = new_tag()
    with FakeInferenceServer(responder=slow_reply) as server:
        proc = start_sampling(tmp_path, tiny_model, "vf-single", vf03_python, server, tag,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.kill()  # SIGKILL: no clean-up of its own
        proc.wait()
        deadline = time.monotonic() + 10
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert not tagged_processes(tag), "the worker outlived the orchestrator"


# --------------------------------------------------------------------------- eval and gepa


def test_eval_of_a_classic_env_writes_results_with_rewards(vf03_python, tmp_path):
    stdout, rows = eval_results("vf-single", vf03_python, tmp_path, reverse, n=3, r=2)
    assert "lcs_reward" in stdout
    assert len(rows) == 6
    for row in rows:  # even requests answer the reversed text: reward 1; the others "nope"
        question = row["prompt"][-1]["content"]
        reply = row["completion"][-1]["content"]
        assert row["reward"] == pytest.approx(difflib.SequenceMatcher(None, reply.strip(), question[::-1]).ratio())
        assert {"lcs_reward", "answer_len"} <= set(row["metrics"]) and row["stop_condition"] == "max_turns_reached"
    assert any(r["reward"] == 1.0 for r in rows) and any(r["reward"] < 1.0 for r in rows)


def test_gepa_candidates_replace_a_classic_envs_system_prompt(vf03_python):
    """GEPA's adapter over the worker environment: the seed is verifiers' own system prompt,
    and a candidate prompt reaches the model in place of it (scored by verifiers' rubric)."""
    from orchestrator.client import ChatClient
    from orchestrator.envs import load_env
    from orchestrator.gepa_adapter import COMPONENT, EnvironmentAdapter, seed_prompt
    from orchestrator.sampler import ChatSampler
    from prime_rl.config import ClientConfig, EnvConfig, EvalSamplingConfig
    from helpers import INSTRUCTION, reverse_if_told

    env = load_env(EnvConfig(id="vf-single", python=vf03_python, args={"num_examples": 10}))
    try:
        assert seed_prompt(env, "vf-single") == "Reverse the text character by character."
        with FakeInferenceServer(responder=reverse_if_told) as server:
            client = ChatClient(ClientConfig(base_url=server.url, max_retries=0), "fake-model")
            adapter = EnvironmentAdapter(env, ChatSampler(client, EvalSamplingConfig()))
            try:
                examples = env.dataset[:3]
                seed = adapter.evaluate(examples, {COMPONENT: seed_prompt(env, "vf-single")}, capture_traces=True)
                told = adapter.evaluate(examples, {COMPONENT: f"Reverse it, {INSTRUCTION}."})
                systems = [body["messages"][0]["content"] for _, path, body in server.calls if path == "/v1/chat/completions"]
            finally:
                adapter.loop.run_until_complete(client.close())
                adapter.close()
    finally:
        env.close()
    assert told.scores == [1.0, 1.0, 1.0] and all(s < 1.0 for s in seed.scores), (seed.scores, told.scores)
    assert systems.count(f"Reverse it, {INSTRUCTION}.") == 3
    assert "lcs_reward = " in adapter.make_reflective_dataset({COMPONENT: "x"}, seed, [COMPONENT])[COMPONENT][0]["Feedback"]
    assert env.worker.proc.poll() is not None, "close() stops the worker"


def test_prime_rl_gepa_optimizes_a_classic_envs_system_prompt(vf03_python, tmp_path):
    """The command end to end: the seed is the classic environment's own system prompt, the
    search runs its rollouts in the worker and writes the three result files."""
    from helpers import reverse_if_told

    with FakeInferenceServer(responder=reverse_if_told) as model:
        endpoints = tmp_path / "endpoints.toml"
        endpoints.write_text(f'[[endpoint]]\nendpoint_id = "roller"\nmodel = "fake-model"\nurl = "{model.url}/v1"\n')
        done = subprocess.run([sys.executable, "-m", "prime_rl.cli", "gepa", "vf-single", "--python", str(vf03_python),
                               "-m", "roller", "-B", "8", "-n", "4", "-N", "4", "--endpoints-path", str(endpoints),
                               "--output-dir", str(tmp_path / "gepa")], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "seed prompt 'Reverse the text character by character.'" in done.stderr
    folder = done.stdout.split("[gepa] results in ")[1].split()[0]
    meta = json.loads(open(f"{folder}/metadata.json").read())
    assert meta["budget"]["used"] >= 4  # one validation pass at least, played by the worker
    assert {"best_prompt.txt", "pareto_frontier.jsonl", "metadata.json"} <= set(os.listdir(folder))
