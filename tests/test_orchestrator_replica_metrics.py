"""The orchestrator's policy sync and step metrics with several inference replicas (fake
servers): the reload probe's values and the per-replica request counts reach the metrics row."""

import asyncio

import pytest
from prime_rl.config import ClientConfig, OrchestratorConfig
from prime_rl.envs import Rollout, Turn
from prime_rl.rundir import begin_step_dir, finish_step_dir, weights_dir

from orchestrator.batch import ScoredRollout
from orchestrator.client import InferenceClient, InferenceError
from fake_inference import LOGPROB, FakeInferenceServer, encode_chat
from orchestrator.main import sync_policy, step_metrics


def write_weights(run_dir, step):
    tmp = begin_step_dir(weights_dir(run_dir), step)
    (tmp / "model.safetensors").write_bytes(b"fake")
    finish_step_dir(tmp, step)


def sync_with_replicas(tmp_path, servers, verify_reload):
    """Step 1 with weights/step_1 written: one reload over every server; returns the sync and
    the client's per-replica request counts after one sample."""
    write_weights(tmp_path, 1)
    client_cfg = ClientConfig(base_url=[s.url for s in servers], timeout_s=5, verify_reload=verify_reload)
    cfg = OrchestratorConfig(output_dir=tmp_path, async_level=0, batch_size=2, rollouts_per_example=2, client=client_cfg)

    async def go():
        client = InferenceClient(client_cfg, "tiny")
        try:
            sync = await sync_policy(1, 0, cfg, client)
            await client.complete_n(encode_chat([{"role": "user", "content": "abc"}]), n=1, max_tokens=4, temperature=1.0)
            return cfg, sync, client.requests_per_replica()
        finally:
            await client.close()

    return asyncio.run(go())


def metrics_row(cfg, sync, requests):
    items = [ScoredRollout(Rollout(0, [Turn([1, 2], [3], [-0.1])], reward=r), 0.0, 1) for r in (0.0, 1.0)]
    return step_metrics(1, items, sync, cfg, 1.0, 1.0, 0, requests)


def test_a_verified_reload_logs_every_replicas_probe_and_request_count(tmp_path):
    with FakeInferenceServer() as a, FakeInferenceServer() as b:
        cfg, sync, requests = sync_with_replicas(tmp_path, [a, b], verify_reload=True)
    row = metrics_row(cfg, sync, requests)
    probe = pytest.approx(LOGPROB * 15)  # 16 probe tokens, the first without a logprob
    assert (row["weights/reloaded_step"], row["weights/probe_logprob/0"], row["weights/probe_logprob/1"]) == (1, probe, probe)
    assert (row["inference/requests/0"], row["inference/requests/1"]) == (1, 0)


def test_without_verify_reload_no_probe_is_sent_or_logged(tmp_path):
    with FakeInferenceServer() as a, FakeInferenceServer() as b:
        cfg, sync, requests = sync_with_replicas(tmp_path, [a, b], verify_reload=False)
        assert [path for _, path, _ in a.calls + b.calls].count("/v1/completions") == 1  # the sample only
    row = metrics_row(cfg, sync, requests)
    assert sync.probe_logprobs == () and not any(key.startswith("weights/probe_logprob/") for key in row)


def test_one_replica_logs_no_request_counts(tmp_path):
    with FakeInferenceServer() as a:
        cfg, sync, requests = sync_with_replicas(tmp_path, [a], verify_reload=True)
    row = metrics_row(cfg, sync, requests)
    assert "weights/probe_logprob/0" in row and not any(key.startswith("inference/requests/") for key in row)


def test_a_replica_left_on_other_weights_fails_the_sync(tmp_path):
    with FakeInferenceServer() as a, FakeInferenceServer(prompt_logprob=-1.0) as b:
        with pytest.raises(InferenceError, match=rf"replicas serve different weights.*{b.url}: -15\.000000"):
            sync_with_replicas(tmp_path, [a, b], verify_reload=True)
