"""Metrics sinks: JSONL rows, a failing sink switched off, one W&B run kept across a resume."""

import json
import types

from prime_rl.config import WandbConfig
from prime_rl.metrics import Metrics, make_metrics
from prime_rl.rundir import metrics_path, read_jsonl


class FakeWandb(types.ModuleType):
    """Stands in for the optional `wandb` package: records every init call."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run_id = kwargs["id"] or f"run{len(self.inits)}"
        return types.SimpleNamespace(id=run_id, log=lambda row, step: self.logged.append((run_id, step)), finish=lambda: None)


def test_a_resumed_process_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    config = WandbConfig(project="p", mode="offline")
    for step in (0, 1):  # the first run, then a resumed one
        metrics = make_metrics("trainer", tmp_path, (), config)
        metrics.log(step, {"loss/policy": 0.5, "note": "text is not sent"})
        metrics.close()
    assert [(i["id"], i["resume"]) for i in fake.inits] == [(None, None), ("run1", "allow")]
    assert fake.inits[0]["name"] == f"{tmp_path.name}-trainer"
    assert fake.logged == [("run1", 0), ("run1", 1)]
    assert (tmp_path / "wandb" / "trainer.id").read_text() == "run1\n"
    assert [r["step"] for r in read_jsonl(metrics_path(tmp_path))] == [0, 1]


def test_a_failing_sink_is_switched_off_and_training_goes_on(tmp_path, capsys):
    class Broken:
        def log(self, row):
            raise OSError("disk full")

        def close(self):
            pass

    rows = []
    good = types.SimpleNamespace(log=rows.append, close=lambda: None)
    metrics = Metrics("trainer", [Broken(), good])
    metrics.log(0, {"x": 1.0})
    metrics.log(1, {"x": 2.0})
    assert [r["step"] for r in rows] == [0, 1]
    assert capsys.readouterr().err.count("metrics sink Broken failed and is disabled: disk full") == 1


def test_secrets_stay_out_of_the_wandb_config_and_the_metrics_rows(tmp_path, monkeypatch):
    """The process's config goes to W&B with every key redacted, in any section and any
    spelling (`api_key`, a transport's `curve_secret_key`, an env's `hf_token`), while
    look-alikes (`max_tokens`, `tokenizer`, `api_key_var`, the name of a variable) stay."""
    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    secrets = ["sk-inference-123", "curve-secret-456", "hf-token-789", "pw-000"]
    settings = {
        "api_key": secrets[0],
        "client": {"api_key": secrets[0], "max_tokens": 8, "api_key_var": "OPENAI_API_KEY"},
        "transport": {"curve_secret_key": secrets[1], "curve_public_key": "pub", "host": "127.0.0.1"},
        "env": [{"env_args": {"hf_token": secrets[2], "judge": {"password": secrets[3]}}, "tokenizer": "tiny"}],
        "unset": {"api_key": None},
    }
    metrics = make_metrics("orchestrator", tmp_path, (), WandbConfig(project="p", mode="offline"), settings)
    metrics.log(0, {"reward/mean": 0.5})
    metrics.close()
    sent = json.dumps(fake.inits[0]["config"])
    assert not [s for s in secrets if s in sent], sent
    config = fake.inits[0]["config"]
    assert config["client"] == {"api_key": "<redacted>", "max_tokens": 8, "api_key_var": "OPENAI_API_KEY"}
    assert config["env"][0]["tokenizer"] == "tiny" and config["unset"] == {"api_key": None}
    assert settings["api_key"] == secrets[0], "the caller's settings are left alone"
    rows = metrics_path(tmp_path).read_text()
    assert "reward/mean" in rows and not [s for s in secrets if s in rows]
