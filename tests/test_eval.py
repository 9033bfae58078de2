"""`prime-rl eval`: config and option errors, the endpoints file, the shipped configs, the
text-only client, the launcher's terminal process, and end-to-end evals against a fake
OpenAI-compatible endpoint and against the real vLLM on the tiny model."""

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from prime_rl.traces import read_traces, rollout_traces_path

from helpers import REPO, free_port, new_tag, tagged_processes
from rich.console import Console

from orchestrator.client import ChatClient
from orchestrator.eval import EnvResult, result_table
from orchestrator.envs.reverse_text import lcs_ratio
from fake_inference import FakeInferenceServer
from orchestrator.sampler import ChatSampler
from prime_rl.cli import load_eval_config, main, resolve_eval
from prime_rl.commands.common import served_process_specs
from prime_rl.config import ClientConfig, EvalEnvConfig, EvalRunConfig, EvalSamplingConfig, KNOWN_ENVIRONMENTS
from prime_rl.envs import Example, Rollout
from prime_rl.endpoints import load_endpoints
from prime_rl.settings import ConfigError, load_config
from helpers import endpoints_file, eval_cli, sigint_as_from_a_terminal


# --------------------------------------------------------------------------- config and CLI errors

# (arguments after `eval`, text the one-line error must contain); {endpoints} is a tmp endpoints file
ERRORS = [
    (["no-such-env", "-m", "fake"], "unknown environment id 'no-such-env'"),
    (["reverse-text", "-m", "gpt-7"], "model: unknown endpoint 'gpt-7' in {endpoints} (known: fake, other)"),
    (["reverse-text", "--endpoint-id", "gpt-7"], "endpoint_id: unknown endpoint 'gpt-7'"),
    (["reverse-text", "-m", "fake", "-a", "{min_len: 5"], "-a/--env-args: not valid JSON"),
    (["reverse-text", "-m", "fake", "-a", "[1, 2]"], "-a/--env-args: expected a JSON object"),
    (["reverse-text", "-m", "{tmp}/no/such/weights/step_5"], "model: model path '{tmp}/no/such/weights/step_5' does not exist"),
    (["reverse-text", "-m", "fake", "-n", "0"], "num_examples must be -1 (all) or at least 1"),
    (["reverse-text", "-m", "fake", "-r", "many"], "rollouts_per_example: Input should be a valid integer"),
    (["reverse-text", "-m", "fake", "--sampling.top-q", "1"], "unknown key `top_q` in [sampling]"),
    (["reverse-text", "-m", "fake", "--client.base-url", "http://x"], "client.base_url: comes from the endpoint"),
    (["reverse-text", "-m", "fake", "--seq-len", "64", "--inference.seq-len", "128"], "conflicting values: `seq_len` = 64"),
    (["-m", "fake"], "expected an environment id or a config file first"),
    (["{tmp}/missing.toml"], "config file '{tmp}/missing.toml' not found"),
]


@pytest.mark.parametrize("args, expected", ERRORS, ids=[f"case{i}" for i in range(len(ERRORS))])
def test_bad_eval_command_exits_2_with_one_line(tmp_path, capsys, args, expected):
    endpoints = endpoints_file(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    expected = expected.replace("{tmp}", str(tmp_path)).replace("{endpoints}", str(endpoints))
    out_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *args, "--endpoints-path", str(endpoints), "--output-dir", str(out_dir)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert expected in err, err
    assert len(err.splitlines()) == 1, err
    assert not out_dir.exists(), "nothing may start before the config is valid"


def test_unknown_env_id_names_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "alphabet-sorter", "-m", "fake", "--endpoints-path", str(endpoints_file(tmp_path))])
    err = capsys.readouterr().err
    assert all(known in err for known in KNOWN_ENVIRONMENTS), err


def test_options_become_settings(tmp_path):
    cfg = load_eval_config([
        "reverse-text", "-m", "fake", "-n", "-1", "-r", "4", "-s", "-t", "64", "-T", "0",
        "-a", '{"min_len": 5}', "--inference.port", "8123", "--output-dir", str(tmp_path),
    ])
    assert (cfg.model, cfg.num_examples, cfg.rollouts_per_example, cfg.save_results) == ("fake", -1, 4, True)
    assert (cfg.sampling.max_tokens, cfg.sampling.temperature) == (64, 0.0)
    assert [(e.id, e.args) for e in cfg.eval] == [("reverse-text", {"min_len": 5})]
    assert cfg.inference.port == 8123 and cfg.output_dir == tmp_path
    long_form = load_eval_config(["reverse-text", "--model=fake", "--max-tokens", "64", "--temperature", "0.5", "--save-results"])
    assert (long_form.sampling.max_tokens, long_form.sampling.temperature, long_form.save_results) == (64, 0.5, True)



@pytest.mark.parametrize("command", ["eval", "gepa"])
def test_option_help_is_each_settings_own_doc_and_default(capsys, monkeypatch, command):
    """The options' help is generated from the fields: a changed default shows up at once."""
    from prime_rl.config import GepaConfig

    monkeypatch.setattr(EvalRunConfig.model_fields["num_examples"], "default", 7)
    monkeypatch.setattr(GepaConfig.model_fields["max_calls"], "default", 321)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    options = out.split("\noptions:\n")[1].split("\n\nEvery setting")[0]
    if command == "eval":
        assert "  -n/--num-examples  (--num-examples)\n      Examples per environment" in options
        assert "-1 = all). (default: 7)" in options
        assert "(the [[eval]] entry's args)\n      Keyword arguments passed to the environment's `load_environment`" in options
    else:
        assert "  -B/--max-calls  (--gepa.max-calls)\n      Evaluation budget" in options and "(default: 321)" in options
    assert "default 500" not in out and "(default 3)" not in out
def test_env_args_merge_into_a_config_with_one_entry_only(tmp_path):
    one = tmp_path / "one.toml"
    one.write_text('[[eval]]\nenv_id = "reverse-text"\nenv_args = { min_len = 4, max_len = 6 }\n')
    cfg = load_eval_config([str(one), "-a", '{"max_len": 9}'])
    assert cfg.eval[0].args == {"min_len": 4, "max_len": 9}
    with pytest.raises(ConfigError, match="has 4 \\[\\[eval\\]\\] entries"):
        load_eval_config([str(REPO / "configs" / "eval" / "multi-env.toml"), "-a", "{}"])


def test_entry_cannot_set_both_id_and_env_id(tmp_path):
    both = tmp_path / "both.toml"
    both.write_text('[[eval]]\nid = "reverse-text"\nenv_id = "gsm8k"\n')
    with pytest.raises(ConfigError, match="sets both `id` and `env_id`"):
        load_eval_config([str(both)])


def test_local_model_gets_its_own_server_on_a_free_port(tmp_path, tiny_model):
    cfg = load_eval_config(["reverse-text", "-m", str(tiny_model), "--seq-len", "256", "--endpoints-path", str(tmp_path / "none.toml")])
    cfg = resolve_eval(cfg)
    target = cfg.target
    assert (target.type, target.model, target.api_key_var) == ("local", str(tiny_model), None)
    assert cfg.inference.model == str(tiny_model) and cfg.inference.seq_len == 256
    assert cfg.client.base_url == f"http://127.0.0.1:{cfg.inference.port}"
    pinned = load_eval_config(["reverse-text", "-m", str(tiny_model), "--inference.port", "8123"])
    pinned = resolve_eval(pinned)
    assert pinned.client.base_url == "http://127.0.0.1:8123"
    # our own server requires a key on every route: one drawn per launch, the client's too
    assert cfg.inference.api_key and cfg.client.api_key == cfg.inference.api_key != pinned.inference.api_key
    # vLLM beside the eval, its sockets in a directory of its own the launcher removes after it
    specs = served_process_specs(cfg, tmp_path, "eval", "orchestrator.eval")
    assert [(s.name, s.tmp_dir_env) for s in specs] == [("inference", "TMPDIR"), ("eval", None)]
    assert set(specs[0].env) == {"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"} and (tmp_path / "configs" / "inference.json").is_file()


def test_a_lora_runs_weights_are_served_as_an_adapter_on_their_base_model(tmp_path, tiny_model):
    """`-m RUN/weights/step_N` of a LoRA run: vLLM serves the base model the adapter config
    names, with the adapter loaded from the start under the name requests use."""
    import json

    from prime_rl.vllm_command import vllm_command

    adapter = tmp_path / "weights" / "step_3"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model), "r": 4}))
    cfg = load_eval_config(["reverse-text", "-m", str(adapter), "--endpoints-path", str(tmp_path / "none.toml")])
    cfg = resolve_eval(cfg)
    target = cfg.target
    assert (target.type, target.model) == ("local", str(adapter))
    assert cfg.inference.model == str(tiny_model) and cfg.inference.max_lora_rank == 8  # vLLM's next rank
    cmd = vllm_command(cfg.inference, cpu=True)
    assert cmd[cmd.index("--lora-modules") + 1] == f"{adapter}={adapter.resolve()}" and "--enable-lora" in cmd

    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone"), "r": 4}))
    with pytest.raises(ConfigError, match=r"model \(the base model .*adapter_config.json names\): model path .*gone.* does not exist"):
        resolve_eval(load_eval_config(["reverse-text", "-m", str(adapter)]))


# --------------------------------------------------------------------------- endpoints and shipped configs


def test_endpoints_file_parses(tmp_path):
    endpoints = load_endpoints(endpoints_file(tmp_path, "http://127.0.0.1:1234"))
    assert sorted(endpoints) == ["fake", "other"]
    fake = endpoints["fake"]
    assert (fake.model, fake.url, fake.key) == ("fake/model-1", "http://127.0.0.1:1234/v1", "FAKE_EVAL_KEY")
    assert endpoints["other"].key is None  # a server that needs no key


@pytest.mark.parametrize("text, expected", [
    ('[[endpoint]]\nendpoint_id = "a"\nmodel = "m"\nurl = "http://x/v1"\nkeys = "K"\n', "unknown key `keys` in [endpoint.0]"),
    ('[[endpoint]]\nendpoint_id = "a"\nurl = "http://x/v1"\n', "missing required key `endpoint.0.model`"),
    ('[[endpoint]]\nendpoint_id = "a"\nmodel = "m"\nurl = "api.openai.com/v1"\n', "must start with http:// or https://"),
    ('[[endpoint]]\nendpoint_id = "a"\nmodel = "m"\nurl = "http://x/v1"\nkey = "sk-123-secret"\n', "must name an environment variable"),
    ('[[endpoint]]\nendpoint_id = "a"\nmodel = "m"\nurl = "http://x/v1"\n' * 2, "endpoint_id 'a' is defined twice"),
    ("[[endpoint]\n", "not valid TOML"),
])
def test_bad_endpoints_file_is_one_line(tmp_path, text, expected):
    path = tmp_path / "endpoints.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_endpoints(path)
    assert expected in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_shipped_endpoints_and_eval_configs_parse_and_resolve(monkeypatch):
    endpoints = load_endpoints(REPO / "configs" / "endpoints.toml")
    assert {"gpt-4.1-mini", "gpt-4.1-nano", "local-vllm"} <= set(endpoints)
    assert all(e.url.endswith("/v1") for e in endpoints.values())
    assert endpoints["local-vllm"].key == "VLLM_API_KEY"
    assert any(e.url == "https://api.pinference.ai/api/v1" and e.key == "PRIME_API_KEY" for e in endpoints.values())

    minimal = load_config(EvalRunConfig, [REPO / "configs" / "eval" / "minimal.toml"], [])
    assert [e.id for e in minimal.eval] == ["gsm8k"]
    multi = load_config(EvalRunConfig, [REPO / "configs" / "eval" / "multi-env.toml"], [])
    assert [e.id for e in multi.eval] == ["reverse-text", "alphabet-sort", "gsm8k", "wordle"]
    assert multi.save_results and multi.endpoint_id == "gpt-4.1-mini"
    monkeypatch.chdir(REPO)  # endpoints_path is relative to where the command runs
    for cfg in (resolve_eval(minimal), resolve_eval(multi)):
        target = cfg.target
        assert (target.type, target.endpoint_id, target.api_key_var) == ("endpoint", "gpt-4.1-mini", "OPENAI_API_KEY")
        assert cfg.client.base_url == "https://api.openai.com/v1"


# --------------------------------------------------------------------------- text-only client and launcher


MESSAGES = [{"role": "system", "content": "Reverse the text character by character."}, {"role": "user", "content": "abc"}]


@pytest.mark.parametrize("suffix", ["/v1", ""])
def test_chat_sampler_sends_text_chats_and_returns_text_replies(suffix):
    async def go(url):
        client = ChatClient(ClientConfig(base_url=url + suffix, timeout_s=5), "api-model")
        try:
            return await ChatSampler(client, EvalSamplingConfig(max_tokens=16)).reply(MESSAGES, [], n=2)
        finally:
            await client.close()

    with FakeInferenceServer() as server:
        replies = asyncio.run(go(server.url))
    assert [(r.text, r.finish_reason, r.turn) for r in replies] == [("cba", "stop", None), ("abc", "stop", None)]
    ((_, path, body),) = server.calls
    assert path == "/v1/chat/completions"  # the /v1 of an endpoint's URL is not doubled
    assert body == {"model": "api-model", "messages": MESSAGES, "n": 2, "max_tokens": 16}  # no temperature: the server's
    assert server.auth_headers == [None]


def test_launcher_terminal_process_writes_to_the_terminal_and_passes_its_exit_code(tmp_path):
    driver = "\n".join([
        "import sys",
        "from pathlib import Path",
        "from prime_rl.launch.launcher import ProcessSpec, run",
        "specs = [ProcessSpec('server', [sys.executable, '-c', 'import time; time.sleep(600)'], required=False),",
        "         ProcessSpec('eval', [sys.executable, '-c', 'print(\"table row\"); raise SystemExit(2)'], terminal=True)]",
        f"sys.exit(run(Path({str(tmp_path)!r}), specs, use_tmux=False, session_name='', exit_code_from='eval'))",
    ])
    tag = new_tag()
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PRIME_RL_TEST_TAG": tag})
    assert proc.returncode == 2, proc.stderr
    assert "table row" in proc.stdout
    assert "eval failed: it exited with code 2" in proc.stderr and "last lines" not in proc.stderr
    assert not (tmp_path / "logs" / "eval.log").exists() and (tmp_path / "logs" / "server.log").exists()
    assert tagged_processes(tag) == []


def test_table_shows_mean_metrics_and_pass_at_k_for_binary_rewards():
    examples = [Example(i, [{"role": "user", "content": "q"}]) for i in range(2)]
    groups = [[Rollout(i, [], reward=float(r), metrics={"exact": float(r)}) for r in rewards]
              for i, rewards in enumerate([(1, 0, 0), (0, 0, 0)])]
    console = Console(file=io.StringIO(), width=120)
    console.print(result_table(EnvResult(EvalEnvConfig(id="reverse-text"), examples, 3, groups, 1.0), "m"))
    text = console.file.getvalue()
    for row in ("2 examples x 3", "0.167 ± 0.373", "exact", "pass@1", "pass@3", "0.500"):  # pass@3: one of two examples
        assert row in text, text


# --------------------------------------------------------------------------- end to end


def test_eval_against_a_text_only_endpoint(tmp_path):
    with FakeInferenceServer() as server:
        endpoints = endpoints_file(tmp_path, server.url)
        out = tmp_path / "evals"
        proc = eval_cli(
            ["reverse-text", "-m", "fake", "-n", "4", "-r", "2", "-s", "--endpoints-path", str(endpoints), "--output-dir", str(out)],
            env={"FAKE_EVAL_KEY": "secret-key", "COLUMNS": "120"},
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reverse-text · fake/model-1" in proc.stdout and "lcs_reward" in proc.stdout and "8/8" in proc.stdout
    # the endpoint got text-only requests, with the key from the environment variable
    bodies = [body for _, path, body in server.calls if path == "/v1/chat/completions"]
    assert len(bodies) == 4 and all(b["n"] == 2 and "return_token_ids" not in b for b in bodies)
    assert set(server.auth_headers) == {"Bearer secret-key"}

    (folder,) = (out / "reverse-text--fake--model-1").iterdir()
    assert f"results in {folder}/" in proc.stdout
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert sorted((r["example_id"], r["rollout"]) for r in rows) == [(i, k) for i in range(4) for k in range(2)]
    for row in rows:  # one request per example: choice 0 answers the reversed text, choice 1 echoes it
        text = row["prompt"][-1]["content"]
        assert row["answer"] == text[::-1]
        assert row["completion"] == [{"role": "assistant", "content": text[::-1] if row["rollout"] == 0 else text}]
        assert row["reward"] == pytest.approx(1.0 if row["rollout"] == 0 else lcs_ratio(text, text[::-1]))
        assert (row["stop_condition"], row["finish_reason"], row["turns"], row["errors"]) == ("max_turns", "stop", 1, [])
    summary = json.loads((folder / "summary.json").read_text())
    rewards = [r["reward"] for r in rows]
    assert summary["reward/mean"] == pytest.approx(sum(rewards) / 8)
    assert summary["metrics/lcs_reward"] == pytest.approx(summary["reward/mean"])
    assert (summary["examples"], summary["rollouts"], summary["rollouts_per_example"]) == (4, 8, 2)
    assert (summary["model"], summary["endpoint_id"], summary["env"]["id"]) == ("fake/model-1", "fake", "reverse-text")
    # the key is read from the environment, never written anywhere
    assert not any("secret-key" in p.read_text() for p in out.rglob("*") if p.is_file())


def test_config_with_several_entries_and_overrides(tmp_path):
    config = tmp_path / "two.toml"
    config.write_text("""
model = "fake"
rollouts_per_example = 2
save_results = true
[sampling]
max_tokens = 5
[[eval]]
id = "reverse-text"
name = "short"
num_examples = 2
rollouts_per_example = 1
[[eval]]
env_id = "reverse-text"
name = "long"
env_args = { min_len = 10, max_len = 12 }
num_examples = 3
""")
    with FakeInferenceServer() as server:
        proc = eval_cli([str(config), "--endpoints-path", str(endpoints_file(tmp_path, server.url)), "--output-dir", str(tmp_path / "evals")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "short · fake/model-1" in proc.stdout and "long · fake/model-1" in proc.stdout
    rows = {}
    for name in ("short", "long"):
        (folder,) = (tmp_path / "evals" / f"{name}--fake--model-1").iterdir()
        rows[name] = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    assert (len(rows["short"]), len(rows["long"])) == (2, 6)
    assert all(len(r["prompt"][-1]["content"]) >= 10 for r in rows["long"])
    # max_tokens 5 cuts the long answers: finish_reason `length`
    assert all(r["finish_reason"] == "length" for r in rows["long"])
    assert all(b["max_tokens"] == 5 for _, path, b in server.calls if path == "/v1/chat/completions")


def test_ctrl_c_stops_the_eval_and_leaves_nothing_behind(tmp_path):
    tag = new_tag()
    with FakeInferenceServer(delay={"/v1/chat/completions": 20}) as server:
        cmd = [sys.executable, "-m", "prime_rl.cli", "eval", "reverse-text", "-m", "fake",
               "--endpoints-path", str(endpoints_file(tmp_path, server.url)), "--output-dir", str(tmp_path / "evals")]
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PRIME_RL_TEST_TAG": tag},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_from_a_terminal)
        deadline = time.monotonic() + 30
        while not server.calls and time.monotonic() < deadline:  # the eval is waiting on its requests
            time.sleep(0.1)
        assert server.calls, "the eval never sent a request"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert tagged_processes(tag) == []


def test_unreachable_endpoint_fails_with_one_line(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proc = eval_cli(["reverse-text", "-m", "fake", "-n", "2", "--client.max-retries", "1", "--client.retry-backoff-s", "0",
                     "--endpoints-path", str(endpoints_file(tmp_path, dead)), "--output-dir", str(tmp_path / "evals")])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[eval] error:")]
    assert len(errors) == 1 and f"{dead}/v1/chat/completions" in errors[0] and "(2 tries)" in errors[0], proc.stderr


def test_bad_environment_args_exit_2(tmp_path):
    """Environment args are checked where the environment loads (the eval process); its exit
    code 2 is the command's."""
    proc = eval_cli(["reverse-text", "-m", "fake", "-a", '{"no_such_arg": 1}',
                     "--endpoints-path", str(endpoints_file(tmp_path)), "--output-dir", str(tmp_path / "evals")])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no_such_arg" in proc.stderr


@pytest.fixture(scope="module")
def local_eval(tmp_path_factory, tool_model):
    """One `prime-rl eval` of a local model (one vLLM start) for the two tests below:
    reverse-text, wiki-search and math-python, the tool-warmed tiny model served with the
    hermes parser. Returns the results folder's rows per environment and their summaries."""
    tmp_path = tmp_path_factory.mktemp("local-eval")
    config = tmp_path / "eval.toml"
    config.write_text(f"""model = "{tool_model}"
num_examples = 2
rollouts_per_example = 2
save_results = true
seq_len = 1024

[sampling]
max_tokens = 96
temperature = 0.5

[[eval]]
id = "reverse-text"
num_examples = 3

[[eval]]
id = "wiki-search"
args = {{ source = "generated", max_turns = 3 }}

[[eval]]
id = "math-python"
args = {{ source = "generated", max_turns = 2 }}

[inference]
tool_call_parser = "hermes"
""")
    tag, out = new_tag(), tmp_path / "evals"
    proc = eval_cli([str(config), "--output-dir", str(out)], env={"PRIME_RL_TEST_TAG": tag}, timeout=600)
    logs = "".join(f"\n--- {p} ---\n{p.read_text()[-3000:]}" for p in out.rglob("*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    rows, summaries = {}, {}
    for env in ("reverse-text", "wiki-search", "math-python"):
        (folder,) = (out / f"{env}--{str(tool_model).strip('/').replace('/', '--')}").iterdir()
        rows[env] = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
        summaries[env] = json.loads((folder / "summary.json").read_text())
    (run,) = (out / "runs").iterdir()
    traces = read_traces(rollout_traces_path(run))
    return rows, summaries, tagged_processes(tag), traces


def test_eval_of_a_local_model_with_real_vllm(local_eval):
    """reverse-text in the local eval (``local_eval``): each saved reward is the environment's
    scoring of the saved completion (LCS ratio of the last reply and the reversed prompt), and
    the summary is that of results.jsonl."""
    rows, summaries, left, _ = local_eval
    rows, summary = rows["reverse-text"], summaries["reverse-text"]
    assert len(rows) == 6 and all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert sorted((r["example_id"], r["rollout"]) for r in rows) == [(e, k) for e in sorted({r["example_id"] for r in rows}) for k in (0, 1)]
    for row in rows:
        assert row["answer"] == row["prompt"][-1]["content"][::-1], row  # the answer is the prompt reversed
        replies = [m.get("content") or "" for m in row["completion"] if m["role"] == "assistant"]
        assert len(replies) == 1 and row["turns"] == 1, row
        assert row["reward"] == pytest.approx(lcs_ratio(replies[0].strip(), row["answer"])), row
    assert (summary["type"], summary["rollouts"], summary["examples"]) == ("local", 6, 3)
    assert summary["reward/mean"] == pytest.approx(sum(r["reward"] for r in rows) / 6)
    assert summary["truncated_frac"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / 6)
    assert left == [], "no child process may survive the eval"


def test_eval_runs_both_tool_environments_with_vllm_parsing_the_calls(local_eval):
    """wiki-search and math-python in one `prime-rl eval` of a local model (``local_eval``):
    vLLM serves it with the hermes parser, the tool-warmed model's calls are parsed and run
    (search results, sandboxed Python), and every rollout is saved with its tool metrics."""
    rows, _, left, _ = local_eval
    for env in ("wiki-search", "math-python"):
        assert len(rows[env]) == 4 and all(0.0 <= r["reward"] <= 1.0 for r in rows[env])
        assert all("total_tool_calls" in r["metrics"] for r in rows[env])
    assert sum(r["metrics"]["total_tool_calls"] for r in rows["wiki-search"]) > 0
    assert left == [], "no child process may survive the eval"


def test_every_rollout_of_an_eval_is_traced_with_its_tokens(local_eval):
    """`prime-rl eval` traces every rollout (kind `eval`) in OUTPUT_DIR/runs/<run>/traces/ for
    `prime-rl dashboard`: the same rewards and completions as results.jsonl, with the exact
    tokens vLLM sampled."""
    rows, _, _, traces = local_eval
    assert traces.skipped == 0 and len(traces.rows) == sum(len(r) for r in rows.values()) == 14
    for env, saved in rows.items():
        traced = [t for t in traces.rows if t["env"] == env]
        assert all(t["kind"] == "eval" and t["step"] == 0 and t["advantage"] is None for t in traced)
        assert sorted(t["reward"] for t in traced) == sorted(r["reward"] for r in saved)
        assert sorted(json.dumps(t["completion"]) for t in traced) == sorted(json.dumps(r["completion"]) for r in saved)
        assert all(t["turns"] and all(len(turn["tokens"]) == len(turn["logprobs"]) for turn in t["turns"]) for t in traced)


def test_eval_of_a_tool_environment_needs_a_tool_call_parser(tmp_path, tiny_model):
    proc = eval_cli(["wiki-search", "-m", str(tiny_model), "--output-dir", str(tmp_path)])
    assert proc.returncode == 2
    assert "calls tools: pass `--inference.tool_call_parser hermes`" in proc.stderr.strip().splitlines()[-1]


def test_chat_sampler_offers_tools_and_reads_the_endpoints_tool_calls():
    """An API model under eval gets the tools in the request; the tool calls of its reply
    come back as ToolCall objects (arguments as the JSON text the endpoint sent)."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            call = {"id": "c1", "type": "function", "function": {"name": "search_pages", "arguments": '{"query": "Vorlia"}'}}
            body = json.dumps({"choices": [{"index": 0, "finish_reason": "tool_calls",
                                            "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown() waits one poll
    tools = [{"type": "function", "function": {"name": "search_pages", "parameters": {"type": "object", "properties": {}}}}]

    async def go():
        client = ChatClient(ClientConfig(base_url=f"http://127.0.0.1:{server.server_port}/v1", timeout_s=5), "api-model")
        try:
            return await ChatSampler(client, EvalSamplingConfig()).reply(MESSAGES, [], n=1, tools=tools)
        finally:
            await client.close()

    try:
        (reply,) = asyncio.run(go())
    finally:
        server.shutdown()
    assert seen[0]["tools"] == tools
    assert (reply.text, reply.finish_reason, reply.turn) == ("", "tool_calls", None)
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [("c1", "search_pages", '{"query": "Vorlia"}')]
    assert reply.message()["tool_calls"][0]["function"]["name"] == "search_pages"
