"""The orchestrator loop: policy sync rules, config errors, and a 2-step end-to-end run
as a subprocess against the fake vLLM server, with this test playing the trainer."""

import asyncio
import time
from pathlib import Path

import pytest
from prime_rl.config import OrchestratorConfig
from prime_rl.envs import Rollout, Turn
from prime_rl.metrics import Metrics
from prime_rl.rundir import begin_step_dir, finish_step_dir, metrics_path, read_jsonl, weights_dir
from prime_rl.wire import decode_batch, encode_batch, sample_arrays

from orchestrator.batch import ScoredRollout, pack_batches
from orchestrator.data import ExampleOrder
from fake_inference import FakeInferenceServer
from orchestrator.main import WEIGHTS_POLL_S, check_async_bound, main, resume, start_generation, stop_generation, sync_policy
from orchestrator.progress import Cursor, StepRecord, save_record
from orchestrator.traces import TraceWriter
from prime_rl.traces import read_traces, rollout_traces_path

from helpers import free_port, orchestrator_process

REPO = Path(__file__).resolve().parents[1]


def write_weights(run_dir, step):
    tmp = begin_step_dir(weights_dir(run_dir), step)
    (tmp / "model.safetensors").write_bytes(b"fake")
    finish_step_dir(tmp, step)


def single(example_id):
    return Rollout(example_id, [Turn([1, 2, 3], [4, 5], [-0.5, -1.0])], 1.0)


class RecordingClient:
    def __init__(self):
        self.reloaded = []

    async def reload_weights(self, path, version=None, keep=False):
        self.reloaded.append(Path(path).name)


def sync(step, loaded, run_dir, async_level=1, timeout=5.0):
    cfg = OrchestratorConfig(output_dir=run_dir, async_level=async_level, weights_timeout_s=timeout)
    client = RecordingClient()
    result = asyncio.run(sync_policy(step, loaded, cfg, client))
    return result, client.reloaded


def test_initial_policy_serves_step_one(tmp_path):
    result, reloaded = sync(step=1, loaded=0, run_dir=tmp_path)  # step 1 may use version 0 when async_level=1
    assert (result.version, result.reloaded_step, reloaded) == (0, None, [])


def test_newer_weights_are_reloaded_without_waiting(tmp_path):
    write_weights(tmp_path, 1)
    write_weights(tmp_path, 2)
    (weights_dir(tmp_path) / "step_3").mkdir()  # no marker yet: must be ignored
    result, reloaded = sync(step=3, loaded=0, run_dir=tmp_path, async_level=2)
    assert (result.version, result.reloaded_step, reloaded) == (2, 2, ["step_2"])


def test_too_old_policy_waits_for_the_required_step(tmp_path):
    """Step 2 needs version 1: the sync is still waiting after several polls of the empty
    weights folder, and returns with step 1 once the trainer writes it."""

    async def go():
        cfg = OrchestratorConfig(output_dir=tmp_path, async_level=1, weights_timeout_s=5)
        client = RecordingClient()
        task = asyncio.ensure_future(sync_policy(2, 0, cfg, client))
        await asyncio.sleep(3 * WEIGHTS_POLL_S)
        waiting = not task.done()
        write_weights(tmp_path, 1)  # the trainer, later
        return waiting, await task, client.reloaded

    waiting, result, reloaded = asyncio.run(go())
    assert waiting and (result.version, reloaded) == (1, ["step_1"]) and result.wait_s >= 3 * WEIGHTS_POLL_S


def test_weights_wait_times_out_naming_the_step(tmp_path):
    with pytest.raises(TimeoutError, match=r"weights/step_1 \(with its STABLE marker\)"):
        sync(step=2, loaded=0, run_dir=tmp_path, timeout=0.2)


def test_max_off_policy_steps_reaches_the_pool_and_the_check_before_sending(tmp_path):
    """`max_off_policy_steps` sets the pool's bound, and the check every batch passes before
    it is sent holds samples to it (to `async_level` without it, or with the step barrier)."""
    cfg = OrchestratorConfig(output_dir=tmp_path, batch_size=8, rollouts_per_example=2, async_level=1,
                             max_off_policy_steps=2)

    async def pool_of(cfg):
        client = type("Client", (), {"version": 0})()
        generation = start_generation(cfg, [], ExampleOrder([1], seed=0), None, client, [])
        await stop_generation(generation)
        return generation.pool

    pool = asyncio.run(pool_of(cfg))
    assert (pool.max_off_policy, pool.async_level, pool.k) == (2, 1, 4)
    assert asyncio.run(pool_of(OrchestratorConfig(output_dir=tmp_path))).max_off_policy == 1  # async_level's default

    def items(version):
        return [ScoredRollout(single(0), 0.0, version, "env", version)]

    check_async_bound(items(3), 5, cfg)  # 2 behind: allowed
    with pytest.raises(RuntimeError, match="version 2 breaks max_off_policy_steps 2"):
        check_async_bound(items(2), 5, cfg)
    with pytest.raises(RuntimeError, match="version 3 breaks async_level 1"):
        check_async_bound(items(3), 5, OrchestratorConfig(output_dir=tmp_path))
    barrier = cfg.model_copy(update={"batching": "step"})  # trains each group in its own step
    assert asyncio.run(pool_of(barrier)).max_off_policy == 1
    with pytest.raises(RuntimeError, match="version 3 breaks async_level 1"):
        check_async_bound(items(3), 5, barrier)


def test_config_errors_exit_2(tmp_path, capsys):
    assert main(["--batch-size", "10", "--rollouts-per-example", "4"]) == 2
    assert "must be divisible by rollouts_per_example" in capsys.readouterr().err
    assert main(["--async-level", "-1"]) == 2
    assert "async_level" in capsys.readouterr().err
    assert main(["--batch-size", "4", "--rollouts-per-example", "4", "--num-trainer-ranks", "8"]) == 2
    assert "batch_size (4) must be at least num_trainer_ranks (8): every rank needs a sample" in capsys.readouterr().err
    assert main(["--env", '[{"id": "reverse-text", "args": {"bogus": 1}}]']) == 2
    assert "bogus" in capsys.readouterr().err


class RecordingSender:
    def __init__(self):
        self.sent = []

    def send_frame(self, rank, step, frame):
        self.sent.append((rank, step, frame))


def test_resume_on_another_rank_count_repacks_the_recorded_batches(tmp_path, capsys):
    """Step 1's record, made for 2 trainer ranks, is re-sent to the 1 rank the run now has;
    its trace rows are written again (the launcher's rewind dropped them)."""
    items = [ScoredRollout(single(example_id=i // 2), float(i), 1) for i in range(4)]
    batches = pack_batches(items, step=1, num_ranks=2, micro_batch_size=2, temperature=1.0, seq_len=16)
    data = {"seed": 0, "dataset_sizes": [10], "weights": [1.0], "examples_per_step": 2}
    frames = [encode_batch(b) for b in batches]
    save_record(tmp_path, StepRecord(step=1, frames=frames, before=Cursor({"counts": [2]}), after=Cursor({"counts": [4]}),
                                     picks=[(0, 2), (0, 3)], min_version=1, max_version=1, data=data,
                                     traces=['{"id":"train-1-0-0","step":1}']))
    cfg = OrchestratorConfig(output_dir=tmp_path, batch_size=4, rollouts_per_example=2, micro_batch_size=2,
                             ckpt={"resume_step": 1})
    sender = RecordingSender()
    cursor = Cursor({"counts": [4]}, [])
    traces = TraceWriter(tmp_path, cfg.traces, None, cfg.seq_len)
    assert resume(cfg, data, ExampleOrder([10], seed=0), sender, Metrics("orchestrator", []), traces) == (2, 1, cursor)
    assert "re-packed step 1's batch from 2 ranks to 1" in capsys.readouterr().out
    assert [r["id"] for r in read_traces(rollout_traces_path(tmp_path)).rows] == ["train-1-0-0"]
    ((rank, step, frame),) = sender.sent
    batch = decode_batch(frame, expected_step=1, expected_rank=0)
    assert (rank, step) == (0, 1)
    assert [[s.advantage for s in m.samples] for m in batch.micro_batches] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("batching", ["continuous", "step"])
def test_two_steps_end_to_end(tmp_path, tiny_model, batching):
    """async_level=0 (on-policy): step 0 uses the initial model; step 1 must wait for
    weights/step_1, which this test (the trainer) writes only after receiving step 0's batch.
    The preflight checks step 0's groups; eval runs every step and on the final weights. Both
    schedules: the weight follower loads step_1 (continuous), or step 1's sync does (step)."""
    port = free_port()
    config = {
        "batching": batching,
        "model": str(tiny_model),
        "eval": {"interval": 1, "num_examples": 3},
        "env": [{"id": "reverse-text", "args": {"num_examples": 50}}],
        "sampling": {"max_tokens": 16, "temperature": 0.8},
        "client": {"timeout_s": 10},
        "transport": {"port": port, "timeout_s": 20},
        "batch_size": 8,
        "rollouts_per_example": 4,
        "micro_batch_size": 3,
        "max_steps": 2,
        "async_level": 0,
        "seq_len": 128,
        "output_dir": str(tmp_path),
        "weights_timeout_s": 20,
    }
    with FakeInferenceServer() as server:
        config["client"]["base_url"] = server.url
        with orchestrator_process(config, tmp_path) as receive:
            first = receive(0)
            assert not any(p.startswith("/collective_rpc") for p in server.admin_calls())
            write_weights(tmp_path, 1)
            second = receive(1)
            write_weights(tmp_path, 2)  # the final eval waits for the last weights

    for batch, version in ((first, 0), (second, 1)):
        samples = [s for m in batch.micro_batches for s in m.samples]
        assert [len(m.samples) for m in batch.micro_batches] == [3, 3, 2]
        assert batch.temperature == 0.8
        assert {s.policy_version for s in samples} == {version}
        for s in samples:
            ids, mask, logprobs = sample_arrays(s)
            assert mask.sum() > 0 and not mask[0] and (logprobs[~mask] == 0).all()
        # groups of 4 with the fake's alternating right/wrong answers: advantages sum to 0 per group
        for g in range(2):
            assert sum(s.advantage for s in samples[4 * g : 4 * g + 4]) == pytest.approx(0.0, abs=1e-6)

    admin = server.admin_calls()
    assert admin[0] == "/health"
    assert admin[1:] == ["/collective_rpc", "/reset_prefix_cache"] * 2  # between steps: nothing to drain
    assert server.loaded_weights == str((tmp_path / "weights" / "step_2").resolve())
    all_rows = read_jsonl(metrics_path(tmp_path))
    (preflight,) = [r for r in all_rows if r["process"] == "preflight"]
    step0 = next(r for r in all_rows if r["process"] == "orchestrator" and r.get("step") == 0 and "reward/mean" in r)
    assert preflight["step"] == 0 and preflight["preflight/reverse-text/examples"] == 2  # step 0's groups, no others
    assert preflight["preflight/reverse-text/reward/mean"] == pytest.approx(step0["reward/mean"])
    evals = [r for r in all_rows if r["process"] == "eval"]
    assert [(r["step"], r["eval/policy_version"]) for r in evals] == [(0, 0), (1, 1), (2, 2)]
    assert all(r["eval/reverse-text/examples"] == 3 and 0 <= r["eval/reward/mean"] <= 1 for r in evals)
    rows = [r for r in all_rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["staleness/max"] == 0 for r in rows)
    assert rows[1]["weights/reloaded_step"] == 1 and rows[1]["policy/version"] == 1
    assert 0.0 < rows[0]["reward/mean"] < 1.0 and rows[0]["reward/max"] == 1.0
    assert rows[0]["reward/reverse-text/mean"] == rows[0]["reward/mean"] and rows[0]["batch/reverse-text/rollouts"] == 8
    assert rows[0]["metrics/reverse-text/lcs_reward"] == rows[0]["reward/mean"]
    assert rows[0]["errors/reverse-text/lcs_reward"] == 0 and rows[0]["stop/max_turns_frac"] == 1.0
    for key in (
        "reward/std",
        "staleness/mean",
        "batch/zero_adv_groups_frac",
        "seq/completion_len_mean",
        "perf/tokens_per_s",
        "time/generate",
        "time/step",
        "time/wait_weights",
        "time/reload",
    ):
        assert key in rows[1], key


def run_main_in_process(tmp_path, server, capsys, model, **overrides):
    flags = {
        "model": str(model),
        "preflight.enabled": "false",
        "client.base-url": server.url,
        "transport.port": str(free_port()),
        "transport.timeout-s": "0.3",
        "batch-size": "4",
        "rollouts-per-example": "2",
        "max-steps": "1",
        "output-dir": str(tmp_path),
        **overrides,
    }
    argv = [part for key, value in flags.items() for part in (f"--{key}", value)]
    code = main(argv + ["--env", '[{"id": "reverse-text", "args": {"num_examples": 8}}]'])
    return code, capsys.readouterr().err


def test_missing_trainer_exits_1_with_a_message(tmp_path, capsys, tiny_model):
    with FakeInferenceServer() as server:
        code, err = run_main_in_process(tmp_path, server, capsys, tiny_model)
    assert code == 1
    assert "trainer rank 0 did not take the batch for step 0" in err and "Traceback" not in err


def test_failing_inference_exits_1_with_one_message(tmp_path, capsys, tiny_model):
    with FakeInferenceServer(fail={"/v1/completions": 500}) as server:
        code, err = run_main_in_process(tmp_path, server, capsys, tiny_model)
    assert code == 1
    assert err.count("/v1/completions answered status 500") == 1  # 4 failed rollouts, one line


def test_two_environments_mixed_3_to_1_with_their_own_metrics(tmp_path, tiny_model):
    """Weights 3:1 give 6 and 2 of every 8 examples, every step; each environment has its own
    reward and metrics rows, and its samples are its own (short vs long texts). Every step:
    with `batching = "step"`, where each step samples its own groups. Continuous batching cuts
    a step from the groups that complete first, so a step may hold 7 and 1 (seen once in 6
    runs); its mix holds over the order the groups start in (tests/test_orchestrator_data.py)."""
    port = free_port()
    config = {
        "model": str(tiny_model),
        "env": [
            {"id": "reverse-text", "name": "short", "weight": 3, "args": {"min_len": 3, "max_len": 4}},
            {"id": "primeintellect/reverse-text", "name": "long", "weight": 1, "args": {"min_len": 12, "max_len": 12}},
        ],
        "preflight": {"enabled": False},
        "sampling": {"max_tokens": 16},
        "transport": {"port": port, "timeout_s": 20},
        "batch_size": 32,
        "rollouts_per_example": 4,
        "max_steps": 2,
        "async_level": 1,
        "batching": "step",
        "seq_len": 128,
        "output_dir": str(tmp_path),
    }
    with FakeInferenceServer() as server:
        config["client"] = {"base_url": server.url, "timeout_s": 10}
        with orchestrator_process(config, tmp_path) as receive:
            batches = [receive(step) for step in range(2)]
    for batch in batches:
        lengths = [int(sample_arrays(s)[2].astype(bool).sum()) for m in batch.micro_batches for s in m.samples]
        # the fake answers the text (reversed or not) + <|im_end|>: 4-5 sampled tokens vs 13
        assert sum(n <= 5 for n in lengths) == 24 and sum(n == 13 for n in lengths) == 8
    rows = [r for r in read_jsonl(metrics_path(tmp_path)) if r["process"] == "orchestrator"]
    for row in rows:
        assert (row["batch/short/rollouts"], row["batch/long/rollouts"]) == (24, 8)
        mean = (24 * row["reward/short/mean"] + 8 * row["reward/long/mean"]) / 32
        assert row["reward/mean"] == pytest.approx(mean)
        assert {"metrics/short/lcs_reward", "metrics/long/lcs_reward", "errors/long/lcs_reward"} <= set(row)


def think_then_answer(messages, index):
    return "<think>hmm</think>ok"


def test_per_turn_trains_each_turn_of_a_template_that_rewrites_earlier_turns(tmp_path, think_model):
    """With a think-stripping template and multi_turn = per_turn, each turn is a sample whose
    prompt is the template's fresh rendering: turn 2's prompt shows turn 1 without its <think>."""
    config = {
        "model": str(think_model),
        "multi_turn": "per_turn",
        "env": [{"id": "alphabet-sort", "args": {"min_turns": 2, "max_turns": 2, "num_examples": 8, "num_eval_examples": 2}}],
        "preflight": {"enabled": False},
        "sampling": {"max_tokens": 32},
        "transport": {"port": free_port(), "timeout_s": 20},
        "batch_size": 4,
        "rollouts_per_example": 2,
        "max_steps": 1,
        "seq_len": 1024,
        "output_dir": str(tmp_path),
    }
    with FakeInferenceServer(responder=think_then_answer) as server:
        config["client"] = {"base_url": server.url, "timeout_s": 10}
        with orchestrator_process(config, tmp_path) as receive:
            batch = receive(0)
    samples = [s for m in batch.micro_batches for s in m.samples]
    assert len(samples) == 8  # 4 rollouts x 2 turns
    for first, second in zip(samples[::2], samples[1::2]):
        ids1, mask1, _ = (a.tolist() for a in sample_arrays(first))
        ids2, mask2, _ = (a.tolist() for a in sample_arrays(second))
        sampled = [*b"<think>hmm</think>ok", 258]
        assert [t for t, m in zip(ids1, mask1) if m] == [t for t, m in zip(ids2, mask2) if m] == sampled
        text2 = bytes(t for t in ids2 if t < 256).decode()
        assert text2.count("<think>") == 1 and "assistant\nok" in text2  # turn 1 re-rendered without it
        assert first.advantage == second.advantage


# --------------------------------------------------------------------------- never a silent hang


def stall_config(tmp_path, tiny_model, server, **overrides):
    return {
        "model": str(tiny_model),
        "preflight": {"enabled": False},
        "env": [{"id": "reverse-text", "args": {"num_examples": 50}}],
        "sampling": {"max_tokens": 8},
        "client": {"base_url": server.url, "timeout_s": 1, "max_retries": 0},
        "transport": {"port": free_port(), "timeout_s": 20},
        "batch_size": 4,
        "rollouts_per_example": 2,
        "micro_batch_size": 4,
        "async_level": 0,
        "seq_len": 128,
        "output_dir": str(tmp_path),
        "weights_timeout_s": 2,
        **overrides,
    }


def test_a_reload_that_never_answers_fails_the_run_naming_it(tmp_path, tiny_model):
    """Continuous batching loads new weights in the background: a reload that hangs ends the
    run within the client's timeout, with one line naming the call, not a silent wait."""
    result = {}
    with FakeInferenceServer(delay={"/collective_rpc": 30}) as server:
        config = stall_config(tmp_path, tiny_model, server, max_steps=3)
        with orchestrator_process(config, tmp_path, expect_code=1, result=result) as receive:
            receive(0)
            write_weights(tmp_path, 1)
    assert "/collective_rpc: no answer within 1 s (not sent again" in result["out"], result["out"]
    assert "Traceback" not in result["out"]


def test_no_group_starts_past_the_last_step_and_the_process_exits_at_once(tmp_path, tiny_model):
    """async_level 1 would let version 0 sample steps 0 and 1, but the run has one step: only
    its two groups are sampled (a third request would take 60 s), and the orchestrator exits
    as soon as the batch is taken. Groups still in flight at the end (the filter's
    replacements) are cancelled: tests/test_inflight.py."""
    def slow_sometimes(messages, index):
        if index >= 4:  # samples after the step's 2 groups x 2 rollouts
            time.sleep(60)
        return "x"

    result = {}
    with FakeInferenceServer(responder=slow_sometimes) as server:
        config = stall_config(tmp_path, tiny_model, server, max_steps=1, async_level=1,
                              client={"base_url": server.url, "timeout_s": 120})
        with orchestrator_process(config, tmp_path, result=result) as receive:
            receive(0)
        requests = [path for _, path, _ in server.calls if path == "/v1/completions"]
    assert len(requests) == 2, requests
    assert result["exit_s"] < 10, result


def test_a_final_eval_waiting_for_weights_the_trainer_never_writes_ends_naming_them(tmp_path, tiny_model):
    """At max_steps the last evaluation waits for the final weights; a trainer gone without
    writing them ends the wait after weights_timeout_s with one line, and the heartbeat said
    what the orchestrator was waiting for."""
    from prime_rl.heartbeat import heartbeat_path, read_heartbeat

    result = {}
    with FakeInferenceServer() as server:
        config = stall_config(tmp_path, tiny_model, server, max_steps=1, eval={"interval": 1, "num_examples": 2})
        with orchestrator_process(config, tmp_path, expect_code=1, result=result) as receive:
            receive(0)
            deadline = time.monotonic() + 10
            while (beat := read_heartbeat(heartbeat_path(tmp_path, "orchestrator"))) is None or not beat.waiting_for:
                assert time.monotonic() < deadline, "no heartbeat while waiting"
                time.sleep(0.05)
            waiting = beat.waiting_for
    assert "final weights (step 1)" in waiting, waiting
    assert "weights/step_1 (with its STABLE marker)" in result["out"] and "Traceback" not in result["out"]


def test_answered_requests_count_as_progress_for_the_watchdog(tmp_path, monkeypatch):
    """A long evaluation sends no batch for a while: answered requests still move the
    heartbeat's progress (and only when their count moved)."""
    from prime_rl.heartbeat import Heartbeat, heartbeat_path, read_heartbeat

    import orchestrator.main as orchestrator_main

    monkeypatch.setattr(orchestrator_main, "PROGRESS_POLL_S", 0.01)

    class Client:
        answered = 0

    class Limiter:
        def describe(self) -> str:
            return "8 episodes in flight in environment 'x'"

    async def go():
        client, hb = Client(), Heartbeat(tmp_path, "orchestrator", min_interval_s=0.0)
        task = asyncio.create_task(orchestrator_main.report_answers(client, hb, Limiter()))
        with hb.waiting("the evaluation at step 3"):
            await asyncio.sleep(0.05)
            quiet = read_heartbeat(heartbeat_path(tmp_path, "orchestrator"))
            client.answered = 7
            await asyncio.sleep(0.05)
            moved = read_heartbeat(heartbeat_path(tmp_path, "orchestrator"))
        task.cancel()
        return quiet, moved

    quiet, moved = asyncio.run(go())
    assert quiet.progress == "started" and quiet.waiting_for == "the evaluation at step 3"
    assert moved.progress == "7 generation requests answered" and moved.waiting_for == "the evaluation at step 3"
    assert moved.detail == "8 episodes in flight in environment 'x'"  # what the watchdog shows beside the wait
    assert moved.progress_unix > quiet.progress_unix
