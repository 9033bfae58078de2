"""The inference server's API key on every route (inference.auth): the middleware alone on a
tiny ASGI app, its identity proof and the client that waits for it before sending the key,
how inference.server wires it into vLLM, and one real vLLM server."""

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from prime_rl.config import ClientConfig, InferenceConfig
from prime_rl.keys import IDENTITY_PATH, new_nonce, proves_identity
from prime_rl.vllm_command import AUTH_MIDDLEWARE, shell_line, vllm_command, vllm_env
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from inference.auth import API_KEY_ENV, RequireApiKey
from orchestrator.client import InferenceClient, InferenceError

from helpers import REPO, free_port, standalone_server

KEY = "sekret"
ADMIN_ROUTES = ["/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/server_info", "/is_paused", "/sleep"]


async def ok_app(scope, receive, send):
    """Answers 200 to any HTTP request and accepts any websocket: what the middleware guards."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    return TestClient(RequireApiKey(ok_app))


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/completions", *ADMIN_ROUTES])
def test_every_route_refuses_a_request_without_the_key(guarded, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        response = guarded.post(path, headers=headers)
        assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"}), headers
    assert guarded.get(path).status_code == 401


@pytest.mark.parametrize("path", ["/health", *ADMIN_ROUTES])
def test_the_key_opens_every_route(guarded, path):
    for scheme in ("Bearer", "bearer"):
        response = guarded.post(path, headers={"Authorization": f"{scheme} {KEY}"})
        assert (response.status_code, response.text) == (200, "ok")


def test_cors_preflights_pass_without_the_key(guarded):
    assert guarded.options("/v1/completions").status_code == 200


def test_websockets_need_the_key_too(guarded):
    with pytest.raises(WebSocketDisconnect):
        with guarded.websocket_connect("/v1/realtime"):
            pass
    with guarded.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        with pytest.raises(WebSocketDisconnect):
            ws.receive_text()  # the app accepted, then closed normally


def test_the_identity_route_proves_the_key_without_it(guarded):
    """The one route open without the key: an HMAC of the client's nonce, which only a holder
    of the key can compute (prime_rl.keys); a malformed or oversized nonce is refused."""
    nonce = new_nonce()
    response = guarded.get(IDENTITY_PATH, params={"nonce": nonce})
    assert response.status_code == 200 and proves_identity(KEY, nonce, response.json())
    assert not proves_identity("other-key", nonce, response.json())
    assert KEY not in response.text
    for params in ({}, {"nonce": "zz" * 32}, {"nonce": "ab" * 8 + "a"}, {"nonce": "ab" * 65}, [("nonce", nonce), ("nonce", nonce)]):
        assert guarded.get(IDENTITY_PATH, params=params).status_code == 400, params
    assert guarded.post(IDENTITY_PATH, params={"nonce": nonce}).status_code == 400
    assert guarded.get(IDENTITY_PATH + "/x", params={"nonce": nonce}).status_code == 401


@contextlib.contextmanager
def served(app):
    """``app`` on a free port, served by uvicorn in a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("client_key", [KEY, "not-the-servers-key"])
def test_the_client_sends_the_key_only_after_the_middleware_proved_it_holds_it(monkeypatch, client_key):
    """The real middleware over HTTP: the client's first request (the identity challenge)
    goes without the key; with the right key the server proves itself, and /health, the
    reload and the prefix-cache reset then carry the key and succeed. A client holding
    another key finds the proof wrong and sends its key nowhere."""
    monkeypatch.setenv(API_KEY_ENV, KEY)
    seen = []
    middleware = RequireApiKey(ok_app)

    async def recorded(scope, receive, send):
        if scope["type"] == "http":
            seen.append((scope["path"], dict(scope["headers"]).get(b"authorization")))
        await middleware(scope, receive, send)

    async def start_and_reload(url):
        client = InferenceClient(ClientConfig(base_url=url, api_key=client_key, timeout_s=10), "tiny")
        try:
            await client.wait_healthy(timeout_s=10, poll_s=0.05)
            await client.reload_weights("/tmp/weights")
        finally:
            await client.close()

    with served(recorded) as url:
        if client_key == KEY:
            asyncio.run(start_and_reload(url))
            bearer = f"Bearer {KEY}".encode()
            assert seen == [(IDENTITY_PATH, None), ("/health", bearer), ("/collective_rpc", bearer), ("/reset_prefix_cache", bearer)]
        else:
            with pytest.raises(InferenceError, match="its identity proof is wrong"):
                asyncio.run(start_and_reload(url))
            assert seen == [(IDENTITY_PATH, None)]


def test_the_launcher_prints_no_key_and_writes_it_to_private_configs_only(tmp_path):
    """`prime-rl --dry-run` with a key: the placement it prints never shows the key, and of
    the resolved configs only the owner can read those that hold it (the processes read it
    from there)."""
    import stat

    key = "launcher-key-" + new_nonce()[:12]
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.cli", "configs/wiki-search.toml", "--dry-run", "--output-dir", str(tmp_path / "run"),
         "--inference.api-key", key],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert key not in out.stdout + out.stderr
    configs = list((tmp_path / "run" / "configs").glob("*.json"))
    holding = {p.name for p in configs if key in p.read_text()}
    assert {"orchestrator.json", "inference-0.json"} <= holding, holding
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in configs if p.name in holding)


def test_lifespan_events_reach_the_app(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(RequireApiKey(app)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_a_missing_key_stops_the_server_from_starting(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{API_KEY_ENV} is not set"):
        RequireApiKey(ok_app)


def test_the_server_passes_the_key_in_its_environment_not_its_command(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    cfg = InferenceConfig(api_key=KEY)
    cmd = vllm_command(cfg, cpu=True)
    assert cmd[cmd.index("--middleware") + 1] == AUTH_MIDDLEWARE == f"{RequireApiKey.__module__}.{RequireApiKey.__name__}"
    assert KEY not in cmd and "--api-key" not in cmd
    assert vllm_env(cfg, cpu=True)[API_KEY_ENV] == KEY
    assert KEY not in shell_line(cfg, cpu=False) and f"{API_KEY_ENV}='<redacted>'" in shell_line(cfg, cpu=False)
    open_cfg = InferenceConfig()
    assert "--middleware" not in vllm_command(open_cfg, cpu=True)
    assert API_KEY_ENV not in vllm_env(open_cfg, cpu=True)


@pytest.mark.slow  # the default suite checks the same on the scale-out trio's replicas (test_scale_out)
def test_real_vllm_refuses_admin_routes_without_the_key(tmp_path, tiny_model):
    """vLLM's own --api-key leaves /collective_rpc and /pause open; with `api_key` set they
    answer 401 without it, and the client (key on every request) finds the server healthy
    and probes it: the same weights score the same, call after call."""

    async def healthy_then_probe_twice(url):
        client = InferenceClient(ClientConfig(base_url=url, api_key=KEY, timeout_s=30), str(tiny_model))
        try:
            await client.wait_healthy(timeout_s=300, poll_s=1)
            return [(await client.probe_replicas())[0] for _ in range(2)]
        finally:
            await client.close()

    with standalone_server(tmp_path, "inference", model=str(tiny_model), api_key=KEY, seq_len=128, max_num_seqs=4) as url:
        probes = asyncio.run(healthy_then_probe_twice(url))
        for path in ("/collective_rpc", "/pause"):
            response = httpx.post(url + path, json={"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}})
            assert response.status_code == 401, (path, response.text)
        assert httpx.get(f"{url}/health").status_code == 401
        assert httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert probes[0] == probes[1] and math.isfinite(probes[0]) and probes[0] < 0


def test_a_run_draws_a_key_for_the_servers_it_starts_when_the_config_names_none(tmp_path):
    """Without `inference.api_key`, any local user could reach the run's own vLLM on loopback
    and `/pause` it or load other weights: every launch draws a key for its servers (the
    local teacher's too), written only where the processes read it (0600), never printed."""
    import stat

    from prime_rl.config import RLConfig
    from prime_rl.launch.resolve import resolve, with_server_key

    cfg = resolve(RLConfig.model_validate({
        "model": "Qwen/Qwen3-0.6B", "batch_size": 64, "teacher": {"model": "t"},
        "trainer": {"loss": {"distill": {"reward_weight": 0.5}}},
    }))
    first, second = with_server_key(cfg), with_server_key(cfg)
    key = first.inference.api_key
    assert key and len(key) >= 40 and key != second.inference.api_key and cfg.inference.api_key is None
    assert first.orchestrator.client.api_key == key and first.orchestrator.teacher.client.api_key == key
    given = cfg.model_copy(deep=True)
    given.inference.api_key = "given-key"
    assert with_server_key(given) is given, "a key the config names is the one used"

    runs = []
    for name in ("a", "b"):
        out = subprocess.run(
            [sys.executable, "-m", "prime_rl.cli", "configs/wiki-search.toml", "--dry-run", "--output-dir", str(tmp_path / name)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        configs = tmp_path / name / "configs"
        inference = json.loads((configs / "inference-0.json").read_text())
        orchestrator = json.loads((configs / "orchestrator.json").read_text())
        assert inference["api_key"] and orchestrator["client"]["api_key"] == inference["api_key"]
        assert inference["api_key"] not in out.stdout + out.stderr
        assert stat.S_IMODE((configs / "inference-0.json").stat().st_mode) == 0o600
        runs.append(inference["api_key"])
    assert runs[0] != runs[1], "drawn per launch"
