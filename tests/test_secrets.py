"""Secrets in environment args and configs (issue 34, row 9): recognised by their name however
it is written (or, for a few unmistakable shapes, by their value), redacted in every file and
log line the run writes (the load-error line of orchestrator.log, eval `summary.json`, GEPA
`metadata.json`), and those files and the logs readable by their owner only."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from prime_rl.config import EnvConfig, EvalRunConfig, GepaRunConfig
from prime_rl.keys import REDACTED, holds_secret, is_secret_name, private_opener, redact, redact_text, scrub

# Spellings of a secret's name: the five, and variants it did not quote.
SECRET_NAMES = [
    "api_key", "apiKey", "accessToken", "Authorization", "cookie",
    "X-Api-Key", "X-Auth-Token", "clientSecret", "client_secret", "refresh_token", "privateKey", "sessionCookie",
    "Set-Cookie", "PASSWORD", "passphrase", "bearer", "credentials", "auth", "authToken", "jwt", "HF_TOKEN",
    "aws2SecretAccessKey", "apikey", "proxy-authorization", "db.password", "OpenAIKey",
]
# Look-alikes that hold no secret: counts of tokens, tokenizers, where a key is (a variable,
# a file), flags, and words that merely contain `key` or `auth`.
HARMLESS = {
    "max_tokens": 64, "num_tokens": 8, "tokenizer": "gpt2", "api_key_var": "OPENAI_API_KEY", "api_key_env": "JUDGE_KEY",
    "key_path": "/keys/judge.pem", "credentials_file": "/keys/creds.json", "token_id": 7, "author": "someone",
    "keyword": "sort", "max_token_budget": 100, "use_auth": True, "monkey": "business",
    "system_prompt": "Basic arithmetic. Be the bearer of good news.",
}


def secret_value(name: str) -> str:
    return f"s3cr3t-{SECRET_NAMES.index(name):02d}-value"


def args_with_secrets() -> dict:
    """Every spelling at the top level, some nested (a judge's headers, a list of backends)."""
    args = {name: secret_value(name) for name in SECRET_NAMES}
    args["judge"] = {"headers": {"x-goog-api-key": "s3cr3t-judge-header"}, "url": "https://bob:s3cr3t-url-pw@judge.example/v1"}
    args["backends"] = [{"Authorization": "Bearer s3cr3t.bearer-token", "name": "a"}]
    args["note"] = "Authorization: Bearer s3cr3t-in-a-sentence-0001"  # a bearer token in a field of any name
    return {**args, **HARMLESS}


def leaked(text: str) -> list[str]:
    return sorted({s for s in text.split('"') + text.split("'") + text.split() if "s3cr3t" in s})


# --------------------------------------------------------------------------- names and values


@pytest.mark.parametrize("name", SECRET_NAMES + ["x-goog-api-key", "curve_server_public", "Proxy-Authorization"])
def test_every_spelling_of_a_secret_name_is_one(name):
    assert is_secret_name(name)


# (`use_auth` is a secret's name; its value, a flag, is what is kept)
@pytest.mark.parametrize("name", [n for n in HARMLESS if n != "use_auth"] + ["PRIME_RL_TOKENIZER", "tokens", "keyboard", "author_key_var"])
def test_look_alikes_are_not_secret_names(name):
    assert not is_secret_name(name)


def test_redact_hides_every_secret_and_keeps_the_rest():
    args = args_with_secrets()
    shown = redact(args)
    assert leaked(json.dumps(shown)) == []
    assert all(shown[name] == REDACTED for name in SECRET_NAMES)
    assert {k: shown[k] for k in HARMLESS} == HARMLESS, "look-alikes, flags and prose stay as they are"
    assert shown["judge"]["url"] == f"https://{REDACTED}@judge.example/v1" and shown["backends"][0]["name"] == "a"
    assert holds_secret(args) and not holds_secret(HARMLESS) and not holds_secret({"api_key": None, "token": ""})
    assert redact({"api_key": None, "password": ""}) == {"api_key": None, "password": ""}  # unset: nothing to hide
    assert args == args_with_secrets(), "the caller's args are left alone"


def test_well_known_key_shapes_are_redacted_under_any_name():
    text = "judge sk-proj-abcdefghijklmnop0123 and hf_abcdefghijklmnopqrstuvwxyz12 and ghp_abcdefghijklmnopqrstuvwxyz123456"
    assert "sk-proj" not in redact_text(text) and "hf_abc" not in redact_text(text) and "ghp_" not in redact_text(text)
    assert redact({"model": "judge", "judge_model_args": ["--flag", "sk-ant-abcdefghijklmnopqrs"]})["judge_model_args"][1] == REDACTED
    for prose in ("the bearer of bad news", "task-abcdefghijklmnopqrstuvw", "hf_dataset_name", "see https://example.com/a@b"):
        assert redact_text(prose) == prose


def test_scrub_finds_a_secret_however_a_message_quotes_it():
    key = "s3cr3t\\with'quote\"and-\u00e9"  # a backslash, both quotes, a non-ASCII letter
    args = {"clientSecret": key, "pin": "123", "nested": [{"sessionCookie": 12345678}]}
    for message in (f"raw {key}", f"repr {args!r}", f"json {json.dumps(args)}", "number 12345678"):
        assert "s3cr3t" not in scrub(message, args) and "12345678" not in scrub(message, args), message
    assert scrub("pin 123 stays: no key is that short", args) == "pin 123 stays: no key is that short"


# --------------------------------------------------------------------------- the load-error line


def user_env_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A user's environment module on sys.path; its id (dashes for underscores)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name.replace("_", "-")


def test_the_load_error_line_of_orchestrator_log_quotes_no_secret(tmp_path, monkeypatch, capsys):
    """A wrong argument echoes the args (every spelling, nested ones too): the line the
    orchestrator prints (into orchestrator.log) redacts the secrets and keeps the rest."""
    from orchestrator.main import load_envs
    from prime_rl.settings import run_entry

    env_id = user_env_module(tmp_path, monkeypatch, "row9_wrong_arg_env", """
        def load_environment(n=1):
            raise AssertionError("never called with these args")
    """)
    entry = EnvConfig(id=env_id, args=args_with_secrets())
    code = run_entry("orchestrator", lambda: load_envs([entry], tmp_path))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert leaked(err) == [] and REDACTED in err, err
    assert f"environment {env_id!r}" in err and "'max_tokens': 64" in err and "unexpected keyword argument" in err


def test_an_environment_error_that_quotes_its_own_key_becomes_one_redacted_line(tmp_path, monkeypatch):
    """The environment's own error (a judge's 401 quoting the key it was given): one line,
    redacted, with no chained exception (a traceback would show it again)."""
    from orchestrator.envs import load_env

    env_id = user_env_module(tmp_path, monkeypatch, "row9_quoting_env", """
        def load_environment(accessToken=None, **kwargs):
            try:
                raise ConnectionError(f"judge refused token {accessToken}")
            except ConnectionError as e:
                raise RuntimeError("cannot reach the judge") from e
    """)
    with pytest.raises(ValueError) as e:
        load_env(EnvConfig(id=env_id, args={"accessToken": "s3cr3t-judge-token", "max_tokens": 8}))
    message = str(e.value)
    assert "s3cr3t" not in message and message.count("\n") == 0, message
    assert message == f"environment {env_id!r}: load_environment() raised RuntimeError: cannot reach the judge"
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_an_environment_error_without_a_secret_is_left_as_it_was(tmp_path, monkeypatch):
    from orchestrator.envs import load_env

    env_id = user_env_module(tmp_path, monkeypatch, "row9_plain_error_env", """
        def load_environment(**kwargs):
            raise RuntimeError("a bug of the environment's own")
    """)
    with pytest.raises(RuntimeError, match="a bug of the environment's own"):
        load_env(EnvConfig(id=env_id, args={"apiKey": "s3cr3t-unused", "n": 1}))


def test_a_workers_load_error_quotes_no_secret(tmp_path, monkeypatch):
    """A verifiers environment loads in a worker, which echoes the args it could not pass
    (and its log's last line when it dies): the orchestrator's line redacts them."""
    import orchestrator.envs as envs
    from orchestrator.envworker import EnvironmentWorkerError

    def failing_worker(name, env_id, module, args, *rest, **kwargs):
        raise EnvironmentWorkerError(f"environment {env_id!r}: load_environment(**{args!r}) does not take these arguments: "
                                     f"got an unexpected keyword argument 'X-Auth-Token'; last log line: token={args['X-Auth-Token']}")

    monkeypatch.setattr(envs, "check_worker_python", lambda env_id, python: SimpleNamespace(verifiers="0.1.9"))
    monkeypatch.setattr(envs, "verifiers_api", lambda version: "classic")
    monkeypatch.setattr(envs, "start_worker_env", failing_worker)
    with pytest.raises(ValueError) as e:
        # model_construct: the entry's own check of that Python would probe it for verifiers
        envs.load_env(EnvConfig.model_construct(id="some-verifiers-env", args=args_with_secrets(), python=sys.executable), tmp_path)
    assert leaked(str(e.value)) == [] and "'max_tokens': 64" in str(e.value), str(e.value)


# --------------------------------------------------------------------------- files


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_eval_summary_is_redacted_and_private(tmp_path):
    from orchestrator.eval import EnvResult, save_results

    cfg = EvalRunConfig.model_validate({
        "model": "m", "output_dir": str(tmp_path / "evals"), "run_id": "r1",
        "eval": [{"id": "reverse-text", "args": args_with_secrets()}],
        "client": {"base_url": "http://user:s3cr3t-in-base-url@127.0.0.1:8000/v1"},
        "target": {"type": "endpoint", "model": "m", "endpoint_id": "e"},
    })
    folder = save_results(cfg, EnvResult(cfg.eval[0], [], 1, [], 0.1), started=0.0)
    summary = folder / "summary.json"
    assert leaked(summary.read_text()) == [] and mode(summary) == 0o600
    saved = json.loads(summary.read_text())
    assert saved["env"]["args"]["apiKey"] == REDACTED and saved["env"]["args"]["max_tokens"] == 64
    assert saved["base_url"] == f"http://{REDACTED}@127.0.0.1:8000/v1"


def test_the_gepa_metadata_is_redacted_and_private(tmp_path):
    from orchestrator.gepa import Task, write_outputs
    from orchestrator.gepa_adapter import COMPONENT

    cfg = GepaRunConfig.model_validate({
        "model": "m", "reflection_model": "t", "output_dir": str(tmp_path / "gepa"), "run_id": "r1",
        "env": [{"id": "reverse-text", "args": args_with_secrets()}],
        "target": {"type": "endpoint", "model": "m", "endpoint_id": "e"},
        "reflection_target": {"type": "endpoint", "model": "t", "endpoint_id": "t"},
    })
    task = Task("reverse-text", None, "seed", [], [SimpleNamespace(id=0), SimpleNamespace(id=1)])
    result = SimpleNamespace(candidates=[{COMPONENT: "seed"}, {COMPONENT: "better"}], val_subscores=[{0: 0.0, 1: 1.0}, {0: 1.0, 1: 1.0}],
                             per_val_instance_best_candidates={0: {1}, 1: {0, 1}})
    folder = write_outputs(cfg, task, result, rollouts=4, started=0.0, interrupted=False)
    metadata = folder / "metadata.json"
    assert leaked(metadata.read_text()) == [] and mode(metadata) == 0o600
    saved = json.loads(metadata.read_text())
    assert saved["env"]["args"]["Authorization"] == REDACTED and saved["env"]["args"]["tokenizer"] == "gpt2"
    assert saved["best_candidate"] == 1 and saved["budget"]["used"] == 4


def test_a_config_holding_env_args_with_a_secret_is_private(tmp_path):
    from prime_rl.launch.deployment import write_config

    holding = write_config(tmp_path, "orchestrator", {"env": [{"id": "x", "args": {"sessionCookie": "s3cr3t-c"}}]})
    plain = write_config(tmp_path, "trainer", {"env": [{"id": "x", "args": HARMLESS}]})
    assert (mode(holding), mode(plain) & 0o077 != 0) == (0o600, True)


def test_process_logs_and_the_search_log_are_private_even_when_left_by_an_earlier_run(tmp_path):
    from orchestrator.gepa import SearchLog
    from prime_rl.launch.launcher import Launcher, ProcessSpec
    from prime_rl.rundir import log_path

    old = log_path(tmp_path, "orchestrator")
    old.parent.mkdir(parents=True)
    old.write_text("an earlier run's lines\n")
    old.chmod(0o644)
    launcher = Launcher(tmp_path, [ProcessSpec("orchestrator", [sys.executable, "-c", "print('hello')"]),
                                   ProcessSpec("trainer", [sys.executable, "-c", "pass"])])
    launcher.start()
    assert [p.wait(timeout=30) for p in launcher.procs.values()] == [0, 0]
    assert (mode(old), mode(log_path(tmp_path, "trainer"))) == (0o600, 0o600)
    assert old.read_text() == "an earlier run's lines\nhello\n"
    search = SearchLog(tmp_path / "gepa" / "search.log")
    search.log("iteration 1")
    search.close()
    assert mode(tmp_path / "gepa" / "search.log") == 0o600
    with open(tmp_path / "env-x.log", "ab", opener=private_opener) as f:  # the worker's log, as envworker opens it
        f.write(b"x\n")
    assert mode(tmp_path / "env-x.log") == 0o600
