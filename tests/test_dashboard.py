"""`prime-rl dashboard` (``prime_rl.observe.dashboard``): its data routes against a recorded run
(metrics, status, traces with the trainer's rows, GEPA's frontier), a file rewritten by a
resume, bad input (no such run, a port taken, a torn or malformed line, a run without
traces), the token beyond loopback, and that it never writes to the run."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from helpers import REPO
from prime_rl.launch.deployment import dashboard_spec, dashboard_url
from prime_rl.observe.dashboard import DASHBOARD_TOKEN_ENV, RunView, make_app, run_views
from prime_rl.rundir import append_jsonl, config_path, metrics_path
from prime_rl.traces import rollout_traces_path, trainer_traces_path


def trace_row(step: int, group: int, sample: int, reward: float, env="reverse-text", kind="train") -> dict:
    return {"id": f"{kind}-{step}-{group}-{sample}", "kind": kind, "step": step, "env": env, "example_id": group, "group": group,
            "sample": sample, "prompt": [{"role": "user", "content": "olleh"}],
            "completion": [{"role": "assistant", "content": f"hello {step}"}], "reward": reward, "metrics": {"lcs": reward},
            "errors": [], "advantage": reward - 0.5, "policy_version": [step, step], "stop_condition": "completed",
            "finish_reason": "stop", "truncated": False, "wall": 1000.0 + step,
            "turns": [{"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [104, 105], "tokens": ["h", "i"], "logprobs": [-0.5, -1.0],
                       "versions": [step, step], "part": 0}]}


def recorded_run(tmp_path: Path, steps: int = 3) -> Path:
    """A run folder as the trio leaves it: configs, metrics rows, both trace files (the trainer's
    for step 0 only), a torn last line in each."""
    run = tmp_path / "run"
    config_path(run, "orchestrator").parent.mkdir(parents=True)
    config_path(run, "orchestrator").write_text(json.dumps({"max_steps": 10}))
    for step in range(steps):
        append_jsonl(metrics_path(run), {"process": "orchestrator", "step": step, "time": step, "wall": 1000.0 + step,
                                         "reward/mean": 0.5 + 0.1 * step, "reward/reverse-text/mean": 0.5 + 0.1 * step})
        append_jsonl(metrics_path(run), {"process": "trainer", "step": step, "time": step, "wall": 1000.5 + step,
                                         "loss/policy": 0.1, "loss/mismatch_kl": 1e-4})
    rollout_traces_path(run).parent.mkdir()
    with open(rollout_traces_path(run), "w") as f:
        for step in range(steps):
            for sample in range(2):
                f.write(json.dumps(trace_row(step, 1, sample, reward=0.25 + 0.5 * sample)) + "\n")
        f.write("not a row\n")
        f.write(json.dumps(trace_row(0, 0, 0, 0.0, env="wordle", kind="eval")) + "\n")
        f.write('{"id": "train-9-0-0", "st')  # torn by a crash
    with open(trainer_traces_path(run), "w") as f:
        f.write(json.dumps({"id": "train-0-1-1", "part": 0, "step": 0, "rank": 0, "logprobs": [-0.4, -1.1],
                            "entropy": [1.5, 2.0], "masked": [0, 1]}) + "\n")
    return run


def client(*runs: Path, token: str | None = None) -> TestClient:
    views, problems = run_views(list(runs))
    assert not problems
    return TestClient(make_app(views, token))


def test_the_metrics_route_hands_out_new_rows_and_starts_over_after_a_rewrite(tmp_path):
    run = recorded_run(tmp_path)
    c = client(run)
    first = c.get("/api/metrics", params={"run": 0}).json()
    assert first["reset"] and len(first["rows"]) == 6 and first["next"] == 6
    append_jsonl(metrics_path(run), {"process": "orchestrator", "step": 3, "reward/mean": float("nan")})
    more = c.get("/api/metrics", params={"run": 0, "since": 6, "generation": first["generation"]}).json()
    assert not more["reset"] and [r["step"] for r in more["rows"]] == [3] and more["rows"][0]["reward/mean"] is None
    # a resume rewrites the file without the later steps: the page is told to start over
    lines = metrics_path(run).read_text().splitlines()[:2]
    metrics_path(run).unlink()
    metrics_path(run).write_text("\n".join(lines) + "\n")
    again = c.get("/api/metrics", params={"run": 0, "since": 7, "generation": more["generation"]}).json()
    assert again["reset"] and [r["step"] for r in again["rows"]] == [0, 0]


def test_the_status_route_is_the_panes_summary_with_a_failed_process(tmp_path):
    run = recorded_run(tmp_path)
    append_jsonl(metrics_path(run), {"process": "launcher", "event": "failed", "failed": "trainer", "reason": "exited with code 1"})
    status = client(run).get("/api/status", params={"run": 0}).json()
    assert status["step"] == 2 and status["max_steps"] == 10 and status["failed"] == ["trainer: exited with code 1"]
    assert any("FAILED" in line or "failed" in line for line in status["lines"]), status["lines"]


def test_the_trace_list_filters_and_skips_damage_and_a_trace_joins_the_trainers_rows(tmp_path):
    run = recorded_run(tmp_path)
    c = client(run)
    listed = c.get("/api/traces", params={"run": 0}).json()
    assert listed["total"] == 7 and listed["skipped"] == 1  # the torn last line waits for its end, uncounted
    assert listed["kinds"] == ["eval", "train"] and listed["envs"] == ["reverse-text", "wordle"] and listed["steps"] == [0, 1, 2]
    assert listed["traces"][0]["id"] == "eval-0-0-0"  # newest first
    train = c.get("/api/traces", params={"run": 0, "kind": "train", "step": 0, "min_reward": 0.5}).json()
    assert [t["id"] for t in train["traces"]] == ["train-0-1-1"] and train["traces"][0]["trained"]
    assert train["traces"][0]["preview"] == "hello 0"
    trace = c.get("/api/trace", params={"run": 0, "id": "train-0-1-1"}).json()
    assert trace["rollout"]["turns"][0]["tokens"] == ["h", "i"]
    assert trace["trainer"] == [{"id": "train-0-1-1", "part": 0, "step": 0, "rank": 0, "logprobs": [-0.4, -1.1],
                                 "entropy": [1.5, 2.0], "masked": [0, 1]}]
    assert c.get("/api/trace", params={"run": 0, "id": "train-1-1-0"}).json()["trainer"] == []
    assert c.get("/api/trace", params={"run": 0, "id": "nope"}).status_code == 404
    assert c.get("/api/traces", params={"run": 3}).status_code == 404


def test_a_run_without_traces_still_serves_its_metrics(tmp_path):
    run = recorded_run(tmp_path)
    for path in (rollout_traces_path(run), trainer_traces_path(run)):
        path.unlink()
    c = client(run)
    assert c.get("/api/traces", params={"run": 0}).json()["total"] == 0
    assert len(c.get("/api/metrics", params={"run": 0}).json()["rows"]) == 6


def test_gepas_frontier_and_evals_summaries_beside_the_run_are_found(tmp_path):
    run = tmp_path / "gepa" / "runs" / "20261205-abc"
    run.mkdir(parents=True)
    results = tmp_path / "gepa" / "reverse-text" / "20261205-abc"
    results.mkdir(parents=True)
    (results / "pareto_frontier.jsonl").write_text(json.dumps({"example_id": 3, "score": 0.9, "candidates": [0, 2],
                                                               "prompt": "Reverse it."}) + "\n")
    (results / "metadata.json").write_text(json.dumps({"num_candidates": 3, "val_scores": [0.5, 0.6, 0.9]}))
    got = client(run).get("/api/results", params={"run": 0}).json()
    assert got["frontier"][0]["prompt"] == "Reverse it." and got["gepa"]["val_scores"] == [0.5, 0.6, 0.9]


def test_the_page_and_plotly_are_served_from_the_packages(tmp_path):
    c = client(recorded_run(tmp_path))
    page = c.get("/")
    assert page.status_code == 200 and "static/plotly.min.js" in page.text and "https://" not in page.text
    js = c.get("/static/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000 and b"plotly" in js.content[:2000].lower()


def test_beyond_loopback_every_data_route_needs_the_token(tmp_path):
    c = client(recorded_run(tmp_path), token="s3cret-token")
    assert c.get("/api/runs").status_code == 403
    assert c.get("/api/runs", params={"token": "wrong"}).status_code == 403
    assert c.get("/api/runs", params={"token": "s3cret-token"}).json()[0]["label"] == "run"
    assert c.get("/api/runs", headers={"X-Dashboard-Token": "s3cret-token"}).status_code == 200
    assert c.get("/").status_code == 200  # the empty page and plotly hold no data


def test_the_launcher_hands_the_token_over_in_the_environment_and_prints_the_url(tmp_path):
    from prime_rl.config import RLConfig

    config = RLConfig.model_validate({"dashboard": {"enabled": True, "host": "0.0.0.0", "port": 9001}})
    spec = dashboard_spec(config, tmp_path / "run", sys.executable)
    token = spec.env[DASHBOARD_TOKEN_ENV]
    assert len(token) >= 24 and token not in " ".join(spec.argv) and spec.argv[-2:] == ["--", str(tmp_path / "run")]
    assert not spec.essential and not spec.required
    assert dashboard_url(config, [spec]) == f"http://0.0.0.0:9001/?token={token}"
    local = RLConfig.model_validate({"dashboard": {"enabled": True}})
    assert dashboard_url(local, [dashboard_spec(local, tmp_path, sys.executable)]) == "http://127.0.0.1:8265/"


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_it_never_writes_to_the_run(tmp_path):
    run = recorded_run(tmp_path)
    before = tree_digest(run)
    c = client(run)
    for route, params in [("runs", {}), ("metrics", {"run": 0}), ("status", {"run": 0}), ("traces", {"run": 0}),
                          ("trace", {"run": 0, "id": "train-0-1-1"}), ("results", {"run": 0})]:
        assert c.get(f"/api/{route}", params=params).status_code == 200, route
    assert tree_digest(run) == before


def dashboard_command(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_rl.cli", "dashboard", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_no_such_run_folder_is_one_line_and_exit_2(tmp_path):
    done = dashboard_command(str(tmp_path / "missing"), "--port", "1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"[dashboard] {tmp_path / 'missing'}: no such run folder (skipped)",
                                        "[dashboard] error: none of the run folders exists"]


def test_a_port_taken_is_one_line_and_exit_2(tmp_path):
    run = recorded_run(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = dashboard_command(str(run), "--port", str(port))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"[dashboard] error: cannot listen on 127.0.0.1:{port}:") and "--port" in line


def test_a_missing_run_beside_one_that_exists_is_named_and_the_other_served(tmp_path):
    run = recorded_run(tmp_path)
    views, problems = run_views([tmp_path / "missing", run, run])
    assert problems == [f"{tmp_path / 'missing'}: no such run folder (skipped)"]
    assert [v.label for v in views] == ["run", "run (2)"] and isinstance(views[0], RunView)
    assert os.path.isdir(run)


RECORDED = REPO / "tests" / "fixtures" / "dashboard-run"
"""A real 3-step run of the quickstart config on its model (metrics rows,
both trace files, max_steps in its orchestrator config; no keys)."""


def test_the_routes_against_a_recorded_quickstart_run():
    """Every traced rollout of the recorded run opens with the trainer's view of each of its
    sampled tokens, the two sides' logprobs close at step 0 (the mismatch the page colours by); the
    lists filter by step and reward; the status reads its steps."""
    c = client(RECORDED)
    listed = c.get("/api/traces", params={"run": 0, "limit": 500}).json()
    assert listed["total"] == 48 and listed["skipped"] == 0 and listed["steps"] == [0, 1, 2] and listed["kinds"] == ["train"]
    assert all(t["trained"] for t in listed["traces"])
    for t in listed["traces"]:
        trace = c.get("/api/trace", params={"run": 0, "id": t["id"]}).json()
        (part,) = trace["trainer"]
        sampled = [lp for turn in trace["rollout"]["turns"] for lp in turn["logprobs"]]
        assert len(part["logprobs"]) == len(part["entropy"]) == len(sampled) and part["step"] == t["step"]
        if t["step"] == 0:  # on-policy: the two sides score the same weights
            assert max(abs(a - b) for a, b in zip(sampled, part["logprobs"])) < 0.05
    high = c.get("/api/traces", params={"run": 0, "step": 2, "min_reward": 0.7}).json()["traces"]
    assert high and all(t["step"] == 2 and t["reward"] >= 0.7 for t in high)
    status = c.get("/api/status", params={"run": 0}).json()
    assert (status["step"], status["trained"], status["max_steps"], status["ended"]) == (2, 2, 3, "finished")
