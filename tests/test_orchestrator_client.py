"""InferenceClient against the fake vLLM server: parsing, request fields, admin recipe."""

import asyncio
import http.server
import threading
import time

import pytest
from prime_rl.config import ClientConfig

from orchestrator.client import InferenceClient, InferenceError, admin
from orchestrator.client.parse import PROBE_PROMPT_IDS, PROBE_TOLERANCE, cache_salt, parse_completion_choices
from fake_inference import IM_END, LOGPROB, FakeInferenceServer, encode_chat

from helpers import free_port

MESSAGES = [
    {"role": "system", "content": "Reverse the text character by character."},
    {"role": "user", "content": "abc"},
]
PROMPT = encode_chat(MESSAGES)  # the token ids the orchestrator renders and sends


async def complete(client, max_tokens, temperature=1.0):
    """One sample of PROMPT (the sampler's call, with n = 1)."""
    return (await client.complete_n(PROMPT, n=1, max_tokens=max_tokens, temperature=temperature))[0]


def run_with_client(server, fn, **config):
    async def go():
        client = InferenceClient(ClientConfig(base_url=server.url, **{"timeout_s": 5, **config}), "tiny")
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def test_completion_returns_exact_tokens_and_logprobs():
    with FakeInferenceServer() as server:
        result = run_with_client(server, lambda c: complete(c, max_tokens=16, temperature=0.7))
    assert result.prompt_ids == PROMPT
    assert result.completion_ids == [*b"cba", IM_END]  # the stop token is part of the completion
    assert result.completion_logprobs == [LOGPROB] * 4
    assert (result.text, result.finish_reason) == ("cba", "stop")
    ((_, path, body),) = server.calls
    assert path == "/v1/completions"
    assert body["model"] == "tiny" and body["prompt"] == PROMPT  # token ids: vLLM renders nothing
    assert (body["max_tokens"], body["temperature"], body["logprobs"], body["return_token_ids"]) == (
        16,
        0.7,
        0,  # the sampled token's logprob only
        True,
    )
    assert "seed" not in body  # per-request seeds can crash vLLM on CPU
    # the full softmax, whatever defaults the model folder's generation_config.json sets
    assert {k: body[k] for k in ("top_p", "top_k", "min_p")} == {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"]) == (0.0, 0.0, 1.0)


def test_max_tokens_cut_reports_length():
    with FakeInferenceServer() as server:
        result = run_with_client(server, lambda c: complete(c, max_tokens=2, temperature=1.0))
    assert (result.completion_ids, result.finish_reason) == ([*b"cb"], "length")


async def health_then_complete(client):
    await client.wait_healthy(timeout_s=2, poll_s=0.05)
    await complete(client, max_tokens=4, temperature=1.0)


def test_api_key_is_sent_as_bearer_on_every_route_once_the_server_proved_it_holds_it():
    """The identity challenge goes without the key; then /health too carries it (the
    server's middleware guards every route, inference.auth)."""
    with FakeInferenceServer(api_key="secret") as server:
        run_with_client(server, health_then_complete, api_key="secret")
    assert server.auth_headers == [None, "Bearer secret", "Bearer secret"]
    assert [path for _, path, _ in server.calls] == ["/health", "/v1/completions"]


class Stranger(http.server.ThreadingHTTPServer):
    """Another program on the port: answers every request with ``status`` (a body of "ok")
    and records the headers it was sent."""

    def __init__(self, status: int):
        self.status, self.seen = status, []
        stranger = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                stranger.seen.append((self.path, dict(self.headers)))
                self.send_response(stranger.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()


@pytest.mark.parametrize("status", [200, 404, 401])
def test_the_key_never_goes_to_another_program_on_the_port(status):
    """Whatever a stranger on the port answers (200 to everything, 404, 401), the start-up
    wait fails at once, in one line naming the port, and no request carried the key."""
    stranger = Stranger(status)
    try:
        with pytest.raises(InferenceError) as e:
            run_with_client(stranger, health_then_complete, api_key="secret")
    finally:
        stranger.shutdown()
        stranger.server_close()
    message = str(e.value)
    assert message.startswith(f"something else answers on {stranger.url.removeprefix('http://')}, not this run's"), message
    assert len(message.splitlines()) == 1 and "secret" not in message
    assert stranger.seen and all(path.startswith("/prime-rl/identity?nonce=") for path, _ in stranger.seen)
    assert not any(k.lower() == "authorization" for _, headers in stranger.seen for k in headers), stranger.seen


def test_a_wrong_identity_proof_gets_no_key():
    with FakeInferenceServer(api_key="secret", wrong_proof=True) as server:
        with pytest.raises(InferenceError, match="its identity proof is wrong"):
            run_with_client(server, health_then_complete, api_key="secret")
        with pytest.raises(InferenceError, match="its identity proof is wrong"):  # a request without a wait, too
            run_with_client(server, lambda c: complete(c, max_tokens=4), api_key="secret")
    assert server.auth_headers == [None, None] and server.calls == []


async def refused(client, within_s=5.0):
    """Poll with requests until one is refused: the server that stopped closed its kept-alive
    connection, and a request that still met it (before the close reached the client) fails
    another way; the next one connects anew."""
    deadline = time.monotonic() + within_s
    while True:
        with pytest.raises(InferenceError) as failed:
            await complete(client, max_tokens=4)
        if "ConnectError" in str(failed.value):
            return
        assert time.monotonic() < deadline, f"no request refused within {within_s} s (last: {failed.value})"


def test_a_replica_that_went_away_proves_itself_again():
    """A refused connection: the port may change hands, so the next request re-asks the proof
    (of whatever listens there now) before the key goes out again."""
    port = free_port()

    async def go():
        client = InferenceClient(ClientConfig(base_url=f"http://127.0.0.1:{port}", api_key="secret", timeout_s=5, max_retries=0), "tiny")
        try:
            with FakeInferenceServer(port=port, api_key="secret") as first:
                await complete(client, max_tokens=4)
            await refused(client)
            with FakeInferenceServer(port=port, api_key="secret") as second:
                await complete(client, max_tokens=4)
        finally:
            await client.close()
        return first, second

    first, second = asyncio.run(go())
    assert first.auth_headers == second.auth_headers == [None, "Bearer secret"]


def test_an_endpoint_key_goes_with_every_request():
    """An external endpoint's key (own_server=False) is meant for its URL: no challenge."""

    async def go(server):
        client = InferenceClient(ClientConfig(base_url=server.url, api_key="sk-endpoint", timeout_s=5), "tiny", own_server=False)
        try:
            await complete(client, max_tokens=4)
        finally:
            await client.close()

    with FakeInferenceServer() as server:
        asyncio.run(go(server))
    assert server.auth_headers == ["Bearer sk-endpoint"]


def slow_responder_tracking_peak():
    """A responder that takes 50 ms, and ``state["peak"]``: the most requests it served at once."""
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def slow(messages, index):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return "x"

    return slow, state


def test_concurrency_is_capped():
    slow, state = slow_responder_tracking_peak()

    async def many(client):
        return await asyncio.gather(*[complete(client, max_tokens=4, temperature=1.0) for _ in range(8)])

    with FakeInferenceServer(responder=slow) as server:
        results = run_with_client(server, many, max_concurrency=2)
    assert len(results) == 8 and state["peak"] <= 2


def test_reload_weights_between_requests_reloads_and_resets_the_prefix_cache(tmp_path):
    with FakeInferenceServer() as server:
        run_with_client(server, lambda c: c.reload_weights(tmp_path / "weights" / "step_3"))
    # nothing in flight: no pause (vLLM's costs ~25 ms), and so no resume
    assert server.admin_calls() == ["/collective_rpc", "/reset_prefix_cache"]
    rpc = server.calls[0][2]
    assert rpc == {
        "method": "reload_weights",
        "kwargs": {"weights_path": str((tmp_path / "weights" / "step_3").resolve())},
    }


def held_first_request():
    """(entered, release, responder): the fake server's first request sets ``entered`` and
    is answered only once the test sets ``release``: a request in flight, event-driven."""
    entered, release = threading.Event(), threading.Event()

    def held(messages, index):
        if index == 0:
            entered.set()
            release.wait(10)
        return "x"

    return entered, release, held


def test_reload_weights_with_a_request_in_flight_drains_it_first(tmp_path):
    """A generation request still running: pause (it finishes on the old weights), reload,
    reset the prefix cache, resume: the four calls in that order."""

    entered, release, held = held_first_request()

    async def reload_while_generating(client):
        request = asyncio.ensure_future(complete(client, max_tokens=4, temperature=1.0))
        await asyncio.to_thread(entered.wait, 10)  # the request is at the server
        await client.reload_weights(tmp_path)
        release.set()
        await request
        return client.frozen_by_reloads()

    with FakeInferenceServer(responder=held) as server:
        frozen = run_with_client(server, reload_while_generating)
    assert server.admin_calls() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert frozen == 0  # drained, not frozen: vLLM preempts nothing


def test_an_in_flight_reload_keeps_the_request_and_labels_it_with_both_versions(tmp_path):
    """keep: the request in flight is frozen, not drained (no prefix-cache reset while it holds
    blocks), continues on the new weights, and comes back labelled (old, new); a request
    made during the reload waits for it, and each version salts the prefix cache its own way."""
    entered, release, held = held_first_request()

    async def go(client):
        first = asyncio.ensure_future(complete(client, max_tokens=4))
        await asyncio.to_thread(entered.wait, 10)
        reload = asyncio.ensure_future(client.reload_weights(tmp_path, 1, keep=True))
        await asyncio.sleep(0)  # the reload has begun: a request made now waits for it
        second = asyncio.ensure_future(complete(client, max_tokens=4))
        await reload
        frozen = client.frozen_by_reloads()
        release.set()
        return await first, await second, frozen

    with FakeInferenceServer(responder=held) as server:
        first, second, frozen = run_with_client(server, go)
    assert server.admin_calls() == ["/pause?mode=keep", "/collective_rpc", "/resume"]
    assert frozen == 1  # the request in flight at the pause, which vLLM counts as preempted
    assert (first.versions, second.versions) == ((0, 1), (1, 1))
    generation = [(path, body) for _, path, body in server.calls if path == "/v1/completions"]
    assert [body["cache_salt"] for _, body in generation] == [cache_salt(0), cache_salt(1)]
    paths = [path for _, path, _ in server.calls]
    assert paths.index("/resume") < len(paths) - 1 - paths[::-1].index("/v1/completions")  # the second came after


def test_an_in_flight_reload_that_keeps_the_kv_tells_vllm_not_to_clear_it(tmp_path):
    """`inflight_kv = "keep"`: the pause asks vLLM to keep its caches (the frozen request's KV
    with them), so vLLM preempts nothing and the client counts nothing to take out of its
    preemption count; the request still comes back labelled (old, new)."""
    entered, release, held = held_first_request()

    async def go(client):
        first = asyncio.ensure_future(complete(client, max_tokens=4))
        await asyncio.to_thread(entered.wait, 10)
        await client.reload_weights(tmp_path, 1, keep=True)
        frozen = client.frozen_by_reloads()
        release.set()
        return await first, frozen

    with FakeInferenceServer(responder=held) as server:
        first, frozen = run_with_client(server, go, inflight_kv="keep")
    assert server.admin_calls() == ["/pause?mode=keep&clear_cache=false", "/collective_rpc", "/resume"]
    assert frozen == 0 and first.versions == (0, 1)


def test_a_reload_cancelled_after_its_pause_still_resumes_the_server(tmp_path):
    """A run stopped mid-reload (its weight follower cancelled) must not leave the engine
    paused: a warm server outlives the run, and the next run's requests would wait forever."""
    entered, release, held = held_first_request()

    async def go(client):
        request = asyncio.ensure_future(complete(client, max_tokens=4))
        await asyncio.to_thread(entered.wait, 10)
        reload = asyncio.ensure_future(client.reload_weights(tmp_path, 1, keep=True))
        while "/collective_rpc" not in server.admin_calls():
            await asyncio.sleep(0.01)
        reload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reload
        release.set()
        await request

    with FakeInferenceServer(responder=held, delay={"/collective_rpc": 1.0}) as server:
        run_with_client(server, go)
    assert server.admin_calls() == ["/pause?mode=keep", "/collective_rpc", "/resume"]


def test_failed_reload_names_the_call_and_still_resumes(tmp_path):
    entered, release, held = held_first_request()

    async def reload_while_generating(client):
        request = asyncio.ensure_future(complete(client, max_tokens=4, temperature=1.0))
        await asyncio.to_thread(entered.wait, 10)
        try:
            await client.reload_weights(tmp_path)
        finally:
            release.set()
            await request

    with FakeInferenceServer(fail={"/collective_rpc": 500}, responder=held) as server:
        with pytest.raises(InferenceError, match=r"/collective_rpc answered status 500"):
            run_with_client(server, reload_while_generating, max_retries=1, retry_backoff_s=0.01)
    # a 500 is retried once (max_retries=1), then the server is resumed and the error raised
    assert server.admin_calls() == ["/pause?mode=wait", "/collective_rpc", "/collective_rpc", "/resume"]


def test_a_reload_that_times_out_is_not_sent_again(tmp_path):
    """The engine may still be loading: a second reload_weights would run behind its back."""
    with FakeInferenceServer(delay={"/collective_rpc": 1.0}) as server:
        with pytest.raises(InferenceError, match=r"/collective_rpc: no answer within 0.3 s \(not sent again"):
            run_with_client(server, lambda c: c.reload_weights(tmp_path), timeout_s=0.3, max_retries=3, retry_backoff_s=0.01)
    assert server.admin_calls() == ["/collective_rpc"]


def test_prefix_cache_reset_that_keeps_failing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr("orchestrator.client.admin.RESET_RETRY_S", 0.0)

    class NoReset(FakeInferenceServer):
        def handle(self, method, path, body):
            if path == "/reset_prefix_cache":
                self.calls.append((method, path, body))
                return 200, {"success": False}
            return super().handle(method, path, body)

    with NoReset() as server:
        with pytest.raises(InferenceError, match="reset_prefix_cache kept answering success=false"):
            run_with_client(server, lambda c: c.reload_weights(tmp_path))
    assert server.admin_calls() == ["/collective_rpc"] + ["/reset_prefix_cache"] * admin.RESET_TRIES


def test_wait_healthy():
    with FakeInferenceServer() as server:
        run_with_client(server, lambda c: c.wait_healthy(timeout_s=2))
        assert server.admin_calls() == ["/health"]


def test_wait_healthy_times_out_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on

    async def go():
        client = InferenceClient(ClientConfig(base_url=url, timeout_s=1), "tiny")
        try:
            await client.wait_healthy(timeout_s=0.3, poll_s=0.1)
        finally:
            await client.close()

    with pytest.raises(TimeoutError, match=f"{url}/health not healthy after"):
        asyncio.run(go())


def test_server_error_names_url_and_status():
    with FakeInferenceServer(fail={"/v1/completions": 400}) as server:
        with pytest.raises(InferenceError, match=r"/v1/completions answered status 400: .*injected"):
            run_with_client(server, lambda c: complete(c, max_tokens=4, temperature=1.0))


def response(token_ids, logprobs, prompt=(1, 2)):
    return {
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "logprobs": {"token_logprobs": logprobs, "tokens": [], "top_logprobs": []},
                "finish_reason": "stop",
                "token_ids": token_ids,
                "prompt_token_ids": list(prompt),
            }
        ],
    }


def test_parse_rejects_logprob_count_mismatch():
    with pytest.raises(InferenceError, match="3 completion token ids but 2 logprobs"):
        parse_completion_choices(response([5, 6, 7], [-0.1, -0.2]), [1, 2])


def test_parse_rejects_missing_token_ids():
    payload = response([5], [-0.1])
    payload["choices"][0]["token_ids"] = None
    with pytest.raises(InferenceError, match="return_token_ids"):
        parse_completion_choices(payload, [1, 2])


def test_parse_rejects_a_prompt_the_server_saw_differently():
    with pytest.raises(InferenceError, match="prompt_token_ids differ from the token ids sent"):
        parse_completion_choices(response([5], [-0.1], prompt=(1, 3)), [1, 2])


def test_parse_rejects_non_finite_logprobs():
    with pytest.raises(InferenceError, match="non-finite logprob"):
        parse_completion_choices(response([5], [float("-inf")]), [1, 2])


def test_parse_empty_completion():
    payload = response([], [])
    payload["choices"][0]["logprobs"] = None  # vLLM's shape when nothing was generated
    assert parse_completion_choices(payload, [1, 2])[0].completion_ids == []


def test_complete_n_returns_every_choice_from_one_request():
    with FakeInferenceServer() as server:
        results = run_with_client(server, lambda c: c.complete_n(PROMPT, n=3, max_tokens=16, temperature=1.0))
    assert len(server.calls) == 1 and server.calls[0][2]["n"] == 3
    # the fake answers sample 0 and 2 reversed, sample 1 echoed
    assert [r.text for r in results] == ["cba", "abc", "cba"]
    assert all(r.prompt_ids == PROMPT for r in results)


def test_refused_connection_is_retried_until_the_server_is_up(monkeypatch):
    """The server comes up during the client's first back-off (an event, not a timer): the
    request succeeds on its second try, one retry counted."""
    port = free_port()
    servers = []  # created late: binding the port is what makes connections succeed
    real_sleep = asyncio.sleep

    async def back_off(seconds):  # the client's wait after a failed try
        if not servers:
            servers.append(FakeInferenceServer(port=port).start())
        await real_sleep(0)

    monkeypatch.setattr("orchestrator.client.pool.asyncio.sleep", back_off)

    async def go():
        client = InferenceClient(
            ClientConfig(base_url=f"http://127.0.0.1:{port}", timeout_s=5, max_retries=4, retry_backoff_s=0.2), "tiny"
        )
        try:
            return await complete(client, max_tokens=8, temperature=1.0), client.retries
        finally:
            await client.close()

    try:
        result, retries = asyncio.run(go())
    finally:
        for server in servers:
            server.stop()
    assert result.text == "cba" and retries == 1


def test_connection_errors_fail_clearly_after_the_retries():
    port = free_port()

    async def go():
        client = InferenceClient(
            ClientConfig(base_url=f"http://127.0.0.1:{port}", timeout_s=5, max_retries=2, retry_backoff_s=0.01), "tiny"
        )
        try:
            await complete(client, max_tokens=8, temperature=1.0)
        finally:
            assert client.retries == 2
            await client.close()

    with pytest.raises(InferenceError, match=rf"POST http://127.0.0.1:{port}/v1/completions failed: ConnectError"):
        asyncio.run(go())


@pytest.mark.parametrize("fault", [{"fail": {"/v1/completions": 503}}, {"delay": {"/v1/completions": 1.5}}], ids=["http-503", "timeout"])
def test_transient_server_errors_and_timeouts_are_retried_and_counted(fault):
    async def complete_and_count(client):
        return await complete(client, max_tokens=8, temperature=1.0), client.retries

    with FakeInferenceServer(faults_first=2, **fault) as server:
        result, retries = run_with_client(server, complete_and_count, timeout_s=0.5, max_retries=3, retry_backoff_s=0.01)
    assert result.text == "cba"
    assert retries == 2


def test_a_server_error_that_persists_fails_after_the_retries():
    with FakeInferenceServer(fail={"/v1/completions": 503}) as server:
        with pytest.raises(InferenceError, match=r"/v1/completions answered status 503"):
            run_with_client(server, lambda c: complete(c, max_tokens=4, temperature=1.0), max_retries=2, retry_backoff_s=0.01)
        assert len([c for c in server.calls if c[1] == "/v1/completions"]) == 3


def test_a_request_that_keeps_timing_out_fails_naming_the_wait():
    with FakeInferenceServer(delay={"/v1/completions": 1.0}) as server:
        with pytest.raises(InferenceError, match=r"/v1/completions: no answer within 0.3 s \(2 tries\)"):
            run_with_client(server, lambda c: complete(c, max_tokens=4, temperature=1.0), timeout_s=0.3, max_retries=1, retry_backoff_s=0.01)


# --------------------------------------------------------------------------- several replicas


def run_with_replicas(servers, fn, **config):
    """``fn(client)`` with one client over every server, one replica each."""

    async def go():
        client = InferenceClient(ClientConfig(base_url=[s.url for s in servers], **{"timeout_s": 5, **config}), "tiny")
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def completions_served(server):
    return len([path for _, path, _ in server.calls if path == "/v1/completions"])


def test_requests_one_at_a_time_alternate_over_the_replicas():
    async def four_in_a_row(client):
        for _ in range(4):
            await complete(client, max_tokens=4)
        return client.requests_per_replica()

    with FakeInferenceServer() as a, FakeInferenceServer() as b:
        counts = run_with_replicas([a, b], four_in_a_row)
    assert counts == [2, 2] and (completions_served(a), completions_served(b)) == (2, 2)


def test_a_request_goes_to_the_replica_with_the_fewest_in_flight():
    """A's first request is still running: the next three, one at a time, all go to B."""

    entered, release, held = held_first_request()

    async def while_a_is_busy(client):
        busy = asyncio.ensure_future(complete(client, max_tokens=4))  # replica 0: first in the round robin
        await asyncio.to_thread(entered.wait, 10)
        for _ in range(3):
            await complete(client, max_tokens=4)
        release.set()
        await busy
        return client.requests_per_replica()

    with FakeInferenceServer(responder=held) as a, FakeInferenceServer() as b:
        counts = run_with_replicas([a, b], while_a_is_busy)
    assert counts == [1, 3] and (completions_served(a), completions_served(b)) == (1, 3)


def test_the_concurrency_cap_covers_all_replicas_together():
    slow, state = slow_responder_tracking_peak()

    async def many(client):
        await asyncio.gather(*[complete(client, max_tokens=4) for _ in range(12)])
        return client.requests_per_replica()

    with FakeInferenceServer(responder=slow) as a, FakeInferenceServer(responder=slow) as b:
        counts = run_with_replicas([a, b], many, max_concurrency=3)
    assert sum(counts) == 12 and min(counts) > 0 and state["peak"] <= 3


def test_a_reload_reaches_every_replica_and_drains_only_the_busy_one(tmp_path):
    """A has a generation request in flight, B has none: A pauses and resumes around its
    reload, B reloads directly; both reset their prefix cache."""

    entered, release, held = held_first_request()

    async def reload_while_a_generates(client):
        request = asyncio.ensure_future(complete(client, max_tokens=4))
        await asyncio.to_thread(entered.wait, 10)
        await client.reload_weights(tmp_path / "step_2")
        release.set()
        await request

    with FakeInferenceServer(responder=held) as a, FakeInferenceServer() as b:
        run_with_replicas([a, b], reload_while_a_generates)
    assert a.admin_calls() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert b.admin_calls() == ["/collective_rpc", "/reset_prefix_cache"]
    assert a.loaded_weights == b.loaded_weights == str((tmp_path / "step_2").resolve())


def test_a_reload_failing_on_one_replica_names_it_after_the_others_finish(tmp_path):
    with FakeInferenceServer() as a, FakeInferenceServer(fail={"/collective_rpc": 500}) as b:
        with pytest.raises(InferenceError, match=rf"POST {b.url}/collective_rpc answered status 500"):
            run_with_replicas([a, b], lambda c: c.reload_weights(tmp_path), max_retries=0)
    assert a.admin_calls() == ["/collective_rpc", "/reset_prefix_cache"]  # A's reload completed
    assert b.admin_calls() == ["/collective_rpc"]


def test_wait_healthy_waits_for_every_replica_and_names_the_one_that_is_down():
    dead = f"http://127.0.0.1:{free_port()}"

    async def go(urls):
        client = InferenceClient(ClientConfig(base_url=urls, timeout_s=1), "tiny")
        try:
            await client.wait_healthy(timeout_s=0.3, poll_s=0.1)
        finally:
            await client.close()

    with FakeInferenceServer() as a, FakeInferenceServer() as b:
        asyncio.run(go([a.url, b.url]))
        assert a.admin_calls() == b.admin_calls() == ["/health"]
        with pytest.raises(TimeoutError, match=f"{dead}/health not healthy after"):
            asyncio.run(go([a.url, dead]))


def test_the_probe_scores_one_fixed_prompt_on_every_replica():
    with FakeInferenceServer() as a, FakeInferenceServer() as b:
        values = run_with_replicas([a, b], lambda c: c.probe_replicas())
    expected = LOGPROB * (len(PROBE_PROMPT_IDS) - 1)  # the first token has no logprob
    assert values == [pytest.approx(expected)] * 2
    for server in (a, b):
        ((_, path, body),) = server.calls
        assert path == "/v1/completions"
        assert (body["prompt"], body["prompt_logprobs"], body["max_tokens"]) == (list(PROBE_PROMPT_IDS), 0, 1)


def test_the_probe_fails_naming_a_replica_on_other_weights():
    """B kept other weights: its probe score differs, and the error lists every replica's."""
    with FakeInferenceServer() as a, FakeInferenceServer(prompt_logprob=LOGPROB - 0.01) as b:
        with pytest.raises(InferenceError, match=rf"different weights.*{a.url}: -3\.750000, {b.url}: -3\.900000"):
            run_with_replicas([a, b], lambda c: c.probe_replicas())


def test_the_probe_tolerates_differences_below_its_tolerance():
    with FakeInferenceServer() as a, FakeInferenceServer(prompt_logprob=LOGPROB - 1e-5) as b:
        values = run_with_replicas([a, b], lambda c: c.probe_replicas())
    assert abs(values[0] - values[1]) < PROBE_TOLERANCE
