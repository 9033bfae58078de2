"""The GEPA adapter over an environment: candidates are system prompts, scores the rubric's,
and the maintained `gepa` search, driven through it, finds a better prompt.

The rollout model is the fake OpenAI server: it reverses the text only when the system
prompt says "character by character, last character first"; otherwise it echoes the text.
The teacher is a function that proposes that instruction once the feedback it reads shows
echoed answers scored below 1."""

from pathlib import Path

import gepa
import pytest

from orchestrator.client import ChatClient
from orchestrator.envs import load_env
from fake_inference import FakeInferenceServer
from orchestrator.gepa_adapter import COMPONENT, EnvironmentAdapter, NoSystemPrompt, seed_prompt
from prime_rl.envs.env import with_system_prompt
from orchestrator.sampler import ChatSampler
from prime_rl.config import ClientConfig, EnvConfig, EvalSamplingConfig
from prime_rl.envs import SingleTurnEnv
from helpers import INSTRUCTION, reverse_if_told


def teacher(prompt: str) -> str:
    """GEPA's reflection LM: sees its meta-prompt (current instruction + the feedback records)."""
    if "reward 1.000" in prompt and "reward 0." not in prompt:
        return "```\nReverse the text character by character, last character first.\n```"
    return f"```\nReverse the text character by character, {INSTRUCTION}.\n```"


@pytest.fixture
def adapter_and_server():
    env = load_env(EnvConfig(id="reverse-text", args={"num_examples": 20, "num_eval_examples": 10}))
    with FakeInferenceServer(responder=reverse_if_told) as server:
        client = ChatClient(ClientConfig(base_url=server.url, max_retries=0), "fake-model")
        adapter = EnvironmentAdapter(env, ChatSampler(client, EvalSamplingConfig()), state_columns=("turn",))
        try:
            yield env, adapter
        finally:
            adapter.loop.run_until_complete(client.close())
            adapter.close()


def test_a_candidate_replaces_the_environment_system_prompt(adapter_and_server):
    env, adapter = adapter_and_server
    examples = env.dataset[:3]
    seed = adapter.evaluate(examples, {COMPONENT: seed_prompt(env, "reverse-text")}, capture_traces=True)
    told = adapter.evaluate(examples, {COMPONENT: f"Reverse it, {INSTRUCTION}."})
    assert told.scores == [1.0, 1.0, 1.0] and all(s < 1.0 for s in seed.scores), (seed.scores, told.scores)
    assert told.trajectories is None and adapter.metric_calls == 6
    trace = seed.trajectories[0]
    assert trace["query"] == examples[0].prompt[-1]["content"] and trace["answer"] == examples[0].answer
    assert trace["reward"] == seed.scores[0] and trace["turn"] == 1 and trace["error"] == ""
    records = adapter.make_reflective_dataset({COMPONENT: "x"}, seed, [COMPONENT])[COMPONENT]
    assert len(records) == 3 and set(records[0]) == {"Inputs", "Generated Outputs", "Feedback"}
    assert f"expected answer: {examples[0].answer}" in records[0]["Feedback"] and "lcs_reward = " in records[0]["Feedback"]
    assert "turn: 1" in records[0]["Feedback"]


def test_with_system_prompt_inserts_one_where_the_example_has_none():
    from prime_rl.envs import Example

    example = Example(0, [{"role": "user", "content": "abc"}])
    assert with_system_prompt(example, "P").prompt == [{"role": "system", "content": "P"}, {"role": "user", "content": "abc"}]
    assert example.prompt == [{"role": "user", "content": "abc"}]


def test_an_environment_without_a_system_prompt_is_refused():
    env = SingleTurnEnv(dataset=[{"question": "q", "answer": "a"}])
    with pytest.raises(NoSystemPrompt, match="environment 'mine' has no system prompt to optimize"):
        seed_prompt(env, "mine")


def test_alphabet_sort_needs_a_seed_prompt_file_which_then_seeds_the_search(tmp_path):
    """alphabet-sort ships no system prompt: one line before any rollout; with
    --system-prompt-file the file's text is the seed candidate."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    with FakeInferenceServer(responder=reverse_if_told) as model:
        endpoints = tmp_path / "endpoints.toml"
        endpoints.write_text(f'[[endpoint]]\nendpoint_id = "roller"\nmodel = "fake-model"\nurl = "{model.url}/v1"\n')
        common = ["-m", "roller", "-B", "8", "-n", "4", "-N", "4", "--endpoints-path", str(endpoints), "--output-dir", str(tmp_path / "gepa")]
        refused = subprocess.run([sys.executable, "-m", "prime_rl.cli", "gepa", "alphabet-sort", *common],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        seed = tmp_path / "seed.txt"
        seed.write_text("Sort the names alphabetically.\n")
        seeded = subprocess.run([sys.executable, "-m", "prime_rl.cli", "gepa", "alphabet-sort", *common, "--system-prompt-file", str(seed)],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        completions = sum("completions" in path for _, path, _ in model.calls)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "[gepa] environment 'alphabet-sort' has no system prompt to optimize" in refused.stderr
    assert "--system-prompt-file" in refused.stderr
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    folder = Path(seeded.stdout.split("[gepa] results in ")[1].split()[0])
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["val_score"]["seed"] == meta["val_scores"][0] and completions >= 4
    assert "Sort the names alphabetically." in seeded.stderr  # the seed prompt it started from


def test_gepa_finds_a_prompt_that_scores_higher_on_validation(adapter_and_server):
    env, adapter = adapter_and_server
    seed = seed_prompt(env, "reverse-text")
    result = gepa.optimize(
        seed_candidate={COMPONENT: seed}, trainset=list(env.dataset[:12]), valset=env.eval_examples(6), adapter=adapter,
        reflection_lm=teacher, max_metric_calls=60, reflection_minibatch_size=3, seed=0,
    )
    scores = result.val_aggregate_scores
    best = result.candidates[result.best_idx][COMPONENT]
    assert INSTRUCTION in best and scores[result.best_idx] == 1.0 > scores[0], (best, scores)
    assert adapter.metric_calls <= 60 + 3  # GEPA stops at the budget (it may finish the minibatch it began)


# --------------------------------------------------------------------------- the gepa process


def teacher_server_reply(messages, index) -> str:
    """The teacher as an OpenAI-compatible server: the same proposals as `teacher`."""
    return teacher(messages[-1]["content"])


def run_gepa_process(tmp_path, rollout_url: str, teacher_url: str, **gepa_settings):
    import json
    import subprocess
    import sys

    from helpers import REPO

    config = {
        "model": "fake-model", "reflection_model": "fake-teacher", "output_dir": str(tmp_path / "gepa"), "run_id": "r1",
        "env": [{"id": "reverse-text", "args": {"num_examples": 20, "num_eval_examples": 10}}],
        "gepa": {"max_calls": 60, "num_train": 12, "num_val": 6, "minibatch_size": 3, "state_columns": ["turn"], **gepa_settings},
        "client": {"base_url": rollout_url, "max_retries": 0}, "reflection_client": {"base_url": teacher_url},
        "target": {"type": "endpoint", "model": "fake-model", "endpoint_id": "rollouts"},
        "reflection_target": {"type": "endpoint", "model": "fake-teacher", "endpoint_id": "teacher"},
    }
    path = tmp_path / "gepa.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "orchestrator.gepa", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_gepa_process_writes_the_best_prompt_the_frontier_and_metadata(tmp_path):
    import json

    with FakeInferenceServer(responder=reverse_if_told) as model, FakeInferenceServer(responder=teacher_server_reply) as teach:
        out = run_gepa_process(tmp_path, model.url, teach.url)
    assert out.returncode == 0, out.stdout + out.stderr
    folder = tmp_path / "gepa" / "reverse-text" / "r1"
    assert f"[gepa] results in {folder}/" in out.stdout
    best = (folder / "best_prompt.txt").read_text()
    assert INSTRUCTION in best
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["val_score"]["best"] == 1.0 > meta["val_score"]["seed"], meta
    assert 0 < meta["budget"]["used"] <= 63 and meta["budget"]["max_calls"] == 60 and not meta["interrupted"]
    assert meta["model"] == "fake-model" and meta["reflection_model"] == "fake-teacher" and meta["num_val"] == 6
    frontier = [json.loads(line) for line in (folder / "pareto_frontier.jsonl").read_text().splitlines()]
    assert len(frontier) == 6 and all(row["score"] == 1.0 and INSTRUCTION in row["prompt"] for row in frontier), frontier


def test_an_unreachable_teacher_is_one_line_before_any_work(tmp_path):
    from helpers import free_port

    with FakeInferenceServer(responder=reverse_if_told) as model:
        out = run_gepa_process(tmp_path, model.url, f"http://127.0.0.1:{free_port()}")
        completions = [path for _, path, _ in model.calls if "completions" in path]
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "the reflection model's endpoint http://127.0.0.1:" in out.stderr and "unreachable" in out.stderr
    assert completions == [] and not (tmp_path / "gepa").exists()


def test_a_budget_below_one_validation_pass_is_refused(tmp_path):
    from prime_rl.config import GepaRunConfig
    from prime_rl.settings import ConfigError, load_config

    path = tmp_path / "gepa.json"
    path.write_text('{"env": [{"id": "reverse-text"}], "gepa": {"max_calls": 10, "num_val": 50}}')
    with pytest.raises(ConfigError) as e:
        load_config(GepaRunConfig, [path], [])
    assert "gepa.max_calls (10) is smaller than one evaluation of the validation set (gepa.num_val = 50 rollouts)" in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_prime_rl_gepa_with_stand_in_endpoints_for_both_roles(tmp_path):
    """The command as users run it: both models are named endpoints of an endpoints file."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    with FakeInferenceServer(responder=reverse_if_told) as model, FakeInferenceServer(responder=teacher_server_reply) as teach:
        endpoints = tmp_path / "endpoints.toml"
        endpoints.write_text(
            f'[[endpoint]]\nendpoint_id = "roller"\nmodel = "fake-model"\nurl = "{model.url}/v1"\nkey = "ROLLER_KEY"\n\n'
            f'[[endpoint]]\nendpoint_id = "teacher"\nmodel = "fake-teacher"\nurl = "{teach.url}/v1"\n'
        )
        out = subprocess.run(
            [sys.executable, "-m", "prime_rl.cli", "gepa", "reverse-text", "-m", "roller", "-M", "teacher", "-B", "60", "-n", "12",
             "-N", "6", "--minibatch-size", "3", "--state-columns", "turn,answer", "-a", '{"num_examples": 20, "num_eval_examples": 10}',
             "--endpoints-path", str(endpoints), "--output-dir", str(tmp_path / "gepa")],
            cwd=REPO, capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "ROLLER_KEY": "k1"},
        )
        auth = {headers for headers in model.auth_headers}
    assert out.returncode == 0, out.stdout + out.stderr
    folder = Path(out.stdout.split("[gepa] results in ")[1].split()[0])
    assert folder.parent == tmp_path / "gepa" / "reverse-text"
    assert INSTRUCTION in (folder / "best_prompt.txt").read_text()
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["val_score"]["best"] > meta["val_score"]["seed"] and meta["settings"]["state_columns"] == ["turn", "answer"]
    assert meta["model"] == "fake-model" and meta["reflection_model"] == "fake-teacher" and meta["budget"]["used"] <= 63
    assert len((folder / "pareto_frontier.jsonl").read_text().splitlines()) == 6
    assert auth == {"Bearer k1"}, "the rollout endpoint's key comes from its variable"
    # every rollout GEPA ran is traced, with the candidate prompt it tried, for `prime-rl dashboard`
    from prime_rl.traces import read_traces, rollout_traces_path

    (run,) = (tmp_path / "gepa" / "runs").iterdir()
    traces = read_traces(rollout_traces_path(run))
    assert traces.skipped == 0 and len(traces.rows) == meta["budget"]["used"]
    assert all(t["kind"] == "gepa" and t["env"] == "reverse-text" and t["candidate"] for t in traces.rows)
    assert any(INSTRUCTION in t["candidate"] for t in traces.rows) and len({t["id"] for t in traces.rows}) == len(traces.rows)


def test_an_interrupted_search_saves_what_it_has_and_says_so(tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time

    from helpers import REPO

    with FakeInferenceServer(responder=reverse_if_told, delay={"/v1/chat/completions": 0.3}) as model, \
            FakeInferenceServer(responder=teacher_server_reply) as teach:
        config = {
            "model": "m", "output_dir": str(tmp_path / "gepa"), "run_id": "r2",
            "env": [{"id": "reverse-text", "args": {"num_examples": 20, "num_eval_examples": 10}}],
            "gepa": {"max_calls": 500, "num_train": 12, "num_val": 6, "minibatch_size": 3},
            "client": {"base_url": model.url, "max_retries": 0}, "reflection_client": {"base_url": teach.url},
            "target": {"type": "endpoint", "model": "m"}, "reflection_target": {"type": "endpoint", "model": "t"},
        }
        (tmp_path / "gepa.json").write_text(json.dumps(config))
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.gepa", "--config", str(tmp_path / "gepa.json")], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while sum("completions" in path for _, path, _ in model.calls) < 9 and time.monotonic() < deadline:
            time.sleep(0.1)  # the seed's 6 validation rollouts and a minibatch have begun
        proc.send_signal(signal.SIGTERM)  # what the launcher sends on Ctrl-C
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "interrupted after" in err and "the best prompt so far and the frontier are saved" in err, err
    meta = json.loads((tmp_path / "gepa" / "reverse-text" / "r2" / "metadata.json").read_text())
    assert meta["interrupted"] and 6 <= meta["budget"]["used"] < 500
    assert (tmp_path / "gepa" / "reverse-text" / "r2" / "best_prompt.txt").read_text().strip()


def test_prime_rl_gepa_on_the_tiny_model_served_by_real_vllm(tmp_path, tiny_model):
    """The mechanics with a local model for both roles (its scores need not improve: the tiny
    model's 512-token context cannot even hold the teacher's prompt, so proposals fail and are
    skipped). vLLM is started and stopped by the command."""
    import json
    import subprocess
    import sys

    from helpers import REPO, new_tag, tagged_processes

    tag = new_tag()
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.cli", "gepa", "reverse-text", "-m", str(tiny_model), "-B", "12", "-n", "4", "-N", "3",
         "--minibatch-size", "2", "-t", "16", "--seq-len", "512", "--output-dir", str(tmp_path / "gepa"),
         "--endpoints-path", str(tmp_path / "none.toml")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "PRIME_RL_TEST_TAG": tag},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    folder = Path(out.stdout.split("[gepa] results in ")[1].split()[0])
    assert (folder / "best_prompt.txt").read_text().strip()
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["model"] == str(tiny_model) and 6 <= meta["budget"]["used"] <= 14 and meta["num_val"] == 3
    assert len((folder / "pareto_frontier.jsonl").read_text().splitlines()) == 3
    assert "rollouts" in out.stdout + out.stderr  # the progress bar
    assert tagged_processes(tag) == [], "the vLLM server stops with the run"


# --------------------------------------------------------------------------- using the result


def test_system_prompt_file_replaces_the_environment_prompt_in_rl_and_eval(tmp_path):
    from prime_rl.cli import load_eval_config
    from prime_rl.config import RLConfig
    from prime_rl.settings import ConfigError, load_config

    best = tmp_path / "best_prompt.txt"
    best.write_text(f"Reverse it, {INSTRUCTION}.\n")
    env = load_env(EnvConfig(id="reverse-text", args={"num_examples": 4, "num_eval_examples": 2}, system_prompt_file=best))
    assert env.system_prompt == f"Reverse it, {INSTRUCTION}."
    assert {e.prompt[0]["content"] for e in env.dataset + env.eval_dataset} == {env.system_prompt}
    assert [m["role"] for m in env.dataset[0].prompt] == ["system", "user"]

    rl = tmp_path / "rl.toml"
    rl.write_text(f'[[env]]\nid = "reverse-text"\nsystem_prompt_file = "{best}"\n')
    assert load_config(RLConfig, [rl], []).orchestrator.env[0].system_prompt_file == best
    cfg = load_eval_config(["reverse-text", "-m", "fake", "--system-prompt-file", str(best)])
    assert cfg.eval[0].env_config().system_prompt_file == best
    with pytest.raises(ConfigError) as e:
        load_eval_config(["reverse-text", "-m", "fake", "--system-prompt-file", str(tmp_path / "missing.txt")])
    assert "system_prompt_file: " in str(e.value) and "does not exist" in str(e.value) and len(str(e.value).splitlines()) == 1
