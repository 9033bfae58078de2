"""The real trio (vLLM server, orchestrator, trainer) on the tiny model, headless and in tmux:
multi-turn, a kill and a resume with a distillation teacher, tools, another family (LoRA: in
test_verifiers_trio.py, on a classic verifiers environment).
Where one run can carry several capabilities' checks, a module fixture runs it once and a test
per capability asserts on what it left (``tmux_run``, ``distilled_run``)."""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import (
    REPO, assert_no_ipc_socket_left, assert_traced, finish, free_port, ipc_sockets_in_tmp, kill_mid_run, mask_spans, new_tag, resume,
    start_launcher, tagged_processes, trio_toml, watched_cores, watched_sockets,
)
from orchestrator.data import ExampleOrder
from orchestrator.envs import load_env
from orchestrator.progress import load_record
from prime_rl.config import EnvConfig
from prime_rl.wire import decode_batch, sample_arrays, teacher_array, teacher_top_arrays
from prime_rl.rundir import (
    MARKER,
    complete_steps,
    config_path,
    log_path,
    metrics_path,
    read_jsonl,
    rollouts_dir,
    weights_step_dir,
)

MAX_STEPS = 4
ASYNC_LEVEL = 1


def launch(tmp_path, tiny_model, run_name: str, *flags: str, **toml):
    """Start `prime-rl` on a trio_toml run of MAX_STEPS (``toml``: more of its arguments)."""
    run_dir = tmp_path / run_name
    config = tmp_path / f"{run_name}.toml"
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, async_level=ASYNC_LEVEL, **toml))
    tag = new_tag()
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    cmd = [sys.executable, "-m", "prime_rl.cli", str(config), *flags]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, run_dir, tag


@pytest.mark.slow  # the same checks run in tmux mode below; headless runs in every other trio test
def test_real_trio_headless(tmp_path, sampling_defaults_model):
    """The trio headless, on a model whose generation_config.json truncates sampling (see
    ``assert_trained_and_handed_off``)."""
    proc, run_dir, tag = launch(tmp_path, sampling_defaults_model, "headless", "--no-tmux")
    finish(proc, run_dir)
    assert_trained_and_handed_off(run_dir)
    assert tagged_processes(tag) == [], "no child process may survive the run"


def assert_trained_and_handed_off(run_dir) -> None:
    """Every step trained and logged once within the async bound, new weights reloaded in
    order, and the samples drawn from the full softmax the trainer scores: the model's
    generation_config.json truncates sampling (top_k 3, top_p 0.5), yet the mismatch KL at
    the first step stays below 1e-3 (7.5e-2 with such a file before requests pinned every
    field)."""
    rows = read_jsonl(metrics_path(run_dir))

    orchestrator = [r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r]
    assert [r["step"] for r in orchestrator] == list(range(MAX_STEPS))
    for row in orchestrator:  # staleness/max is the max over every sample of the step
        assert 0 <= row["staleness/max"] <= ASYNC_LEVEL, row
        assert row["policy/version"] >= row["step"] - ASYNC_LEVEL, row

    # New weights were reloaded into vLLM (newest first when several were ready), in order,
    # and every version a step needed came from such a reload.
    reloaded = [r["weights/reloaded_step"] for r in orchestrator if "weights/reloaded_step" in r]
    assert reloaded == sorted(set(reloaded)) and reloaded, reloaded
    assert {r["policy/version"] for r in orchestrator} <= {0, *reloaded}
    assert reloaded[-1] >= MAX_STEPS - 1 - ASYNC_LEVEL

    trainer = [r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS))
    assert trainer[0]["loss/mismatch_kl"] < 1e-3, trainer[0]
    assert (weights_step_dir(run_dir, MAX_STEPS) / MARKER).is_file()
    assert_preflight_read_step_0(rows, groups_per_step=16 // 4)  # trio_toml's batch_size // rollouts_per_example
    assert_traced(run_dir, MAX_STEPS, rollouts_per_example=4)  # trio_toml's


def assert_preflight_read_step_0(rows: list[dict], groups_per_step: int) -> None:
    """One preflight row, of step 0's own groups (their count and mean reward): the check
    sampled nothing of its own, and step 0 was trained on once like every other step."""
    (preflight,) = [r for r in rows if r["process"] == "preflight"]
    step0 = next(r for r in rows if r["process"] == "orchestrator" and r.get("step") == 0 and "reward/mean" in r)
    examples = [v for k, v in preflight.items() if k.endswith("/examples")]
    means = [v for k, v in preflight.items() if k.endswith("/reward/mean")]
    assert preflight["step"] == 0 and examples == [groups_per_step], preflight
    assert means == [pytest.approx(step0["reward/mean"])], (preflight, step0)


# --------------------------------------------------------------------------- tmux, multi-turn

MULTI_TURN_ARGS = {"min_turns": 2, "max_turns": 2, "max_names_per_turn": 2, "num_examples": 64, "num_eval_examples": 4}
MULTI_TURN_ENV = f"""id = "primeintellect/alphabet-sort"
args = {{ {", ".join(f"{k} = {v}" for k, v in MULTI_TURN_ARGS.items())} }}"""
MULTI_TURN_MAX_TOKENS = 12
EVAL = "\n[eval]\ninterval = 2\nnum_examples = 2\n"
"""The tmux run evaluates at steps 0 and 2 and after the last: two examples, one rollout each."""
PANES = ["inference", "orchestrator", "trainer", "dashboard", "status"]


@dataclass
class TmuxRun:
    """What the shared tmux run left for its tests to check."""

    run_dir: Path
    out: str  # the launcher's output
    session_name: str
    seen: set[str]  # panes that showed their process's lines (the status pane: that it was piped)
    drawn: str  # everything the status pane drew
    session_left: bool  # whether the tmux session still existed after the run
    left_running: list  # tagged processes alive after the run
    sockets: dict  # the UNIX sockets the run's processes bound, with their directories' modes
    tmp_before: set  # vLLM-named sockets in /tmp before the run
    cores: dict  # the trainer's and the orchestrator's threads' cores, polled through the run


def watch_panes(proc, server, session_name: str, drawn: Path) -> set[str]:
    """Until every pane follows its process's log (or the run ends): the panes seen doing so;
    the status pane's drawing is piped to ``drawn`` (tmux pipe-pane)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline and len(seen) < len(PANES):
        try:
            if server.has_session(session_name):
                panes = server.sessions.get(session_name=session_name).active_window.panes
                if [p.pane_title for p in panes] != PANES:  # still being laid out
                    time.sleep(0.2)
                    continue
                for pane in panes:
                    if pane.pane_title == "status" and "status" not in seen:
                        pane.cmd("pipe-pane", "-o", f"cat >> {str(drawn)!r}")
                        seen.add("status")
                    elif f"[{pane.pane_title}]" in "\n".join(pane.capture_pane()):
                        seen.add(pane.pane_title)
        except Exception:  # noqa: BLE001 - the session may vanish between calls
            pass
        time.sleep(0.5)
    return seen


@pytest.fixture(scope="module")
def tmux_run(tmp_path_factory, sampling_defaults_model) -> TmuxRun:
    """One real trio run carries several capabilities' checks (one vLLM start, not several):
    tmux mode with the dashboard's pane (the test below), a sound run on a model whose
    generation_config.json truncates sampling (``assert_trained_and_handed_off``), two-turn
    alphabet-sort trained on exactly the sampled tokens, and traced evaluations. The model is
    the tiny one with only that file changed (same weights and tokenizer)."""
    import libtmux

    tmp_path = tmp_path_factory.mktemp("tmux")
    tmp_before = ipc_sockets_in_tmp()
    proc, run_dir, tag = launch(tmp_path, sampling_defaults_model, f"tmux-{os.getpid()}", env=MULTI_TURN_ENV, seq_len=768,
                                max_tokens=MULTI_TURN_MAX_TOKENS,
                                extra=EVAL + f"\n[dashboard]\nenabled = true\nport = {free_port()}\n")
    session_name = f"prime-rl-{run_dir.name}"
    server, drawn = libtmux.Server(), tmp_path / "status-pane.txt"
    modules = {"trainer": "trainer.rl", "orchestrator": "orchestrator.main"}
    with watched_sockets(proc.pid) as sockets, watched_cores(proc.pid, modules) as cores:
        seen = watch_panes(proc, server, session_name, drawn)
        out = finish(proc, run_dir)
    return TmuxRun(run_dir, out, session_name, seen, drawn.read_text() if drawn.is_file() else "",
                   server.has_session(session_name), tagged_processes(tag), dict(sockets), tmp_before, dict(cores))


def test_tmux_mode_shows_one_pane_per_process(tmux_run):
    """The real trio in tmux: one pane per process following its log (the dashboard's, started
    by `[dashboard] enabled`, among them) and the `status` pane drawing the steps from
    metrics.jsonl, the session gone after the run, nothing left running."""
    assert tmux_run.seen == set(PANES), tmux_run.seen
    assert "[prime-rl] dashboard: http://127.0.0.1:" in tmux_run.out
    # The status pane drew the steps from metrics.jsonl (it redraws when rows arrive)
    assert f"/ {MAX_STEPS}" in tmux_run.drawn and "reward " in tmux_run.drawn, tmux_run.drawn
    assert f"tmux attach -t {tmux_run.session_name}" in tmux_run.out
    assert not tmux_run.session_left, "the tmux session must be gone after the run"
    assert tmux_run.left_running == []


def test_vllm_leaves_no_socket_in_tmp(tmux_run):
    """vLLM's ZeroMQ IPC sockets (8 files per start piled up in /tmp, as vLLM removes none) lay
    in a private directory the launcher made for the server and removed after it
    (``assert_no_ipc_socket_left``)."""
    assert_no_ipc_socket_left(tmux_run.sockets, tmux_run.tmp_before)


def test_on_two_cores_the_trainer_and_the_orchestrator_leave_vllm_a_core_until_ready(tmux_run):
    """`deployment.cpu_vllm_first`: on a machine of two cores both start with every thread on
    the second core, vLLM's API server importing on the first, and once ready run on both
    (their threads polled through the run: the first poll and the last); each says so."""
    run_cores = sorted(os.sched_getaffinity(0))
    if len(run_cores) != 2:
        pytest.skip("the placement applies on two cores")
    for name in ("trainer", "orchestrator"):
        polls = tmux_run.cores[name]
        assert polls and polls[0] == {frozenset(run_cores[1:])}, (name, polls[:3])
        assert polls[-1] == {frozenset(run_cores)}, (name, polls[-3:])
        log = (tmux_run.run_dir / "logs" / f"{name}.log").read_text()
        assert f"[{name}] ready: on cores {run_cores[0]},{run_cores[1]} from now (started on {run_cores[1]} " in log


def test_every_step_trains_once_on_the_full_softmax_and_hands_off_in_order(tmux_run):
    """The tmux run's steps (``assert_trained_and_handed_off``; tmux changes none of it)."""
    assert_trained_and_handed_off(tmux_run.run_dir)


def test_multi_turn_trio_trains_exactly_the_sampled_tokens(tmux_run, sampling_defaults_model):
    """alphabet-sort (two turns) on the real trio (the tmux run): in every recorded sample the
    loss mask is 1 on exactly the tokens vLLM sampled in each turn (after each generation
    prompt, up to its <|im_end|> or max_tokens) and 0 on the rendered prompt, the template glue
    and the follow-up message; vLLM's logprobs are there and only there; mismatch KL at step 0
    < 1e-3."""
    from prime_rl.chat import render_ids
    from transformers import AutoTokenizer

    run_dir, max_tokens = tmux_run.run_dir, MULTI_TURN_MAX_TOKENS
    tok = AutoTokenizer.from_pretrained(sampling_defaults_model)
    env = load_env(EnvConfig(id="alphabet-sort", args=MULTI_TURN_ARGS))
    generation = [257, *b"assistant\n"]
    checked = 0
    for step in range(MAX_STEPS):
        record = load_record(run_dir, step)
        for micro in decode_batch(record.frames[0]).micro_batches:
            for sample in micro.samples:
                ids, mask, logprobs = (a.tolist() for a in sample_arrays(sample))
                example = env.dataset[sample.example_id]
                # turn 1's prompt is the template's rendering of the example's prompt
                first = render_ids(tok, example.prompt, add_generation_prompt=True)
                assert ids[: len(first)] == first and not any(mask[: len(first)])
                spans = [(i, j) for i, j in mask_spans(mask)]
                assert len(spans) == 2, spans  # one span of sampled tokens per turn
                (s1, e1), (s2, e2) = spans
                assert s1 == len(first) and ids[s2 - len(generation) : s2] == generation
                for s, e in spans:  # a turn ends at its <|im_end|>, or at max_tokens without it
                    assert ids[e - 1] == 258 or (e - s == max_tokens and 258 not in ids[s:e])
                # between the turns: the end-of-turn the model did not emit, then the follow-up
                closing = [] if ids[e1 - 1] == 258 else [258]
                follow_up = [*closing, 10, 257, *f"user\n{example.info['follow_ups'][0]}".encode(), 258, 10, *generation]
                assert ids[e1:s2] == follow_up
                assert e2 == len(ids)  # the sample ends with the last sampled token
                assert all((lp != 0) == m for lp, m in zip(logprobs, mask))
                checked += 1
    assert checked == MAX_STEPS * 16
    trainer = [r for r in read_jsonl(metrics_path(run_dir)) if r["process"] == "trainer"]
    assert trainer[0]["loss/mismatch_kl"] < 1e-3, trainer[0]
    orchestrator = [r for r in read_jsonl(metrics_path(run_dir)) if r["process"] == "orchestrator"]
    assert all(r["seq/turns_mean"] == 2 and "reward/alphabet-sort/mean" in r for r in orchestrator)
    # the traces show both turns of a rollout in order, the follow-up between them
    for row in assert_traced(run_dir, MAX_STEPS, rollouts_per_example=4):
        assert [m["role"] for m in row["completion"]] == ["assistant", "user", "assistant"] and len(row["turns"]) == 2
        assert all(len(turn["tokens"]) == len(turn["completion_ids"]) == len(turn["logprobs"]) for turn in row["turns"])
        assert row["turns"][0]["tokens"][:1] == [tok.decode(row["turns"][0]["completion_ids"][:1])]


def test_evaluations_during_rl_are_traced(tmux_run):
    """`[eval] interval = 2` on the tmux run: the evaluations at steps 0, 2 and after the last
    step each trace their two groups (kind `eval`, no advantage), in the run's trace file."""
    from prime_rl.traces import read_traces, rollout_traces_path

    evals = [r for r in read_traces(rollout_traces_path(tmux_run.run_dir)).rows if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 2, MAX_STEPS]
    assert all(r["env"] == "alphabet-sort" and r["advantage"] is None and r["turns"] for r in evals)
    assert len(evals) == 3 * 2 and len({r["id"] for r in evals}) == 6


# --------------------------------------------------------------------------- kill, then resume

RESUME_RUN = {"max_steps": 16, "lr": 1e-2, "batch_size": 64, "rollouts_per_example": 8}
"""Long and fast-learning enough that the weights move far from the start before the kill
(measured on such a run's weights: after 8 steps they lie 13.6 single steps from the initial
model, after 4 steps 5.9; ``assert_resumed_cleanly`` needs more than 4)."""
CKPT = "\n[ckpt]\ninterval = 4\nkeep_last = 10\n[trainer.weights]\nkeep_last = 40\n"
"""Every step's weights are kept: the checkpoint's and the first ones after the resume are compared."""
KILL_AFTER_CHECKPOINT = 8


def weights_of(folder: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def distance(a: dict, b: dict) -> float:
    """L2 distance of two state dicts of the same model (all tensors, float64)."""
    import numpy as np

    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k].astype(np.float64)) ** 2) for k in a)))


def recorded_picks(run_dir, first_step: int) -> dict[int, list]:
    """The examples the orchestrator sampled at each step >= first_step (its progress records)."""
    records = {step: load_record(run_dir, step) for step in complete_steps(rollouts_dir(run_dir)) if step >= first_step}
    return {step: record.picks for step, record in records.items()}


def assert_resumed_cleanly(run_dir, resume_step: int) -> None:
    rows = read_jsonl(metrics_path(run_dir))
    steps = list(range(RESUME_RUN["max_steps"]))
    # Every step trained once and logged once, before and after the restart; the preflight
    # read step 0's groups once, and the resume did not run it again.
    assert [r["step"] for r in rows if r["process"] == "trainer"] == steps
    assert_preflight_read_step_0(rows, groups_per_step=RESUME_RUN["batch_size"] // RESUME_RUN["rollouts_per_example"])
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in orchestrator] == steps
    for row in orchestrator:
        assert row["step"] - ASYNC_LEVEL <= row["policy/version"] <= row["step"], row
    # Learning survived the restart, checked on the weights (the rewards of a short run at
    # temperature 1 without a seed are not a proof): the first weights the resumed trainer wrote
    # lie one optimizer step from the checkpoint's and far from the initial model's, where a
    # restart from scratch would have put them (AdamW moves a weight by about lr a step).
    initial = weights_of(Path(json.loads(config_path(run_dir, "trainer").read_text())["model"]["name"]))
    checkpoint, after = weights_of(weights_step_dir(run_dir, resume_step)), weights_of(weights_step_dir(run_dir, resume_step + 1))
    moved, step = distance(checkpoint, initial), distance(after, checkpoint)
    assert step < moved / 4 and distance(after, initial) > moved / 2, (step, moved)
    print(f"weights: the checkpoint lies {moved:.3f} from the initial model, the first step after the resume {step:.3f}")
    # No prompt skipped or repeated. With continuous batching the groups start in the seeded
    # order (a resume first restarts those that were in flight) and each step trains the ones
    # that completed first: every recorded step holds examples of that order, none twice, and
    # none of the order's examples is missing except groups in flight at either end or
    # dropped as too old.
    sizes = [len(load_env(EnvConfig(id="reverse-text")).dataset)]
    per_step = RESUME_RUN["batch_size"] // RESUME_RUN["rollouts_per_example"]
    in_flight = (ASYNC_LEVEL + 1) * per_step  # the orchestrator's default max_inflight_groups
    first = resume_step - 1
    reference = ExampleOrder(sizes, seed=0).next(RESUME_RUN["max_steps"] * per_step + 2 * in_flight)
    picks = recorded_picks(run_dir, first_step=first)
    assert sorted(picks) == list(range(first, RESUME_RUN["max_steps"]))
    assert all(len(step_picks) == per_step for step_picks in picks.values())
    flat = [pick for step in sorted(picks) for pick in picks[step]]
    assert len(flat) == len(set(flat)), "an example was trained on twice"
    assert set(flat) <= set(reference), "an example outside the seeded order"
    dropped = sum(r.get("batch/stale_groups_dropped", 0) for r in orchestrator if r["step"] >= first)
    missing = set(reference[first * per_step + in_flight : RESUME_RUN["max_steps"] * per_step - in_flight]) - set(flat)
    assert len(missing) <= dropped, (missing, dropped)
    # the traces too: every step's groups once (those of the re-sent batches written again after
    # the rewind dropped them), each trained on once
    assert_traced(run_dir, RESUME_RUN["max_steps"], RESUME_RUN["rollouts_per_example"])


TEACHER = """
[teacher]
model = "{model}"
port = {port}
system_prompt = "Reverse the text, character by character."

[trainer.loss.distill]
reward_weight = 0.5
kl_weight = 1.0
top_k = 5
"""
"""A local distillation teacher (its own vLLM process), scoring under a system prompt of its
own (context distillation): half reward and half reverse KL over its top 5 tokens."""


@dataclass
class KilledRun:
    """A run SIGKILLed mid-run (one process), then resumed with `--resume` to its end."""

    run_dir: Path
    config: Path
    out: str  # the killed run's launcher output
    code: int  # its exit code
    stopped_s: float  # seconds the launcher took to stop the others
    resume_step: int  # the checkpoint step the resume started from
    resume_s: float


def kill_and_resume(tmp_path, model, marker: str, extra: str = "") -> KilledRun:
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    config.write_text(trio_toml(model, run_dir, async_level=ASYNC_LEVEL, **RESUME_RUN, extra=CKPT + extra))
    out, code, stopped_s = kill_mid_run(run_dir, config, marker, KILL_AFTER_CHECKPOINT)
    resume_step, resume_s = resume(run_dir, config, "--resume")
    return KilledRun(run_dir, config, out, code, stopped_s, resume_step, resume_s)


@pytest.fixture(scope="module")
def distilled_run(tmp_path_factory, tiny_model, other_tiny_model) -> KilledRun:
    """The trainer's kill and resume, with a distillation teacher: one run (one pair of
    launches) carries the kill-and-resume checks and the teacher's (test below). Student: the
    tiny model; teacher: other weights of its architecture."""
    teacher = TEACHER.format(model=other_tiny_model, port=free_port())
    return kill_and_resume(tmp_path_factory.mktemp("distill"), tiny_model, "-m trainer.rl", extra=teacher)


@pytest.mark.parametrize(
    "victim, marker",
    [
        ("trainer", "-m trainer.rl"),
        # The same resume from the same checkpoint after another victim (and, after the
        # orchestrator's, a second resume from it): slow-marked to keep the default suite near
        # 20 minutes (the launcher's stop-the-others rule for any process is
        # tests/test_launcher.py's); `bash scripts/test.sh -m slow` runs them.
        pytest.param("orchestrator", "-m orchestrator.main", marks=pytest.mark.slow),
        pytest.param("inference", "-m inference.vllm_cpu", marks=pytest.mark.slow),
    ],
    ids=["trainer", "orchestrator", "inference"],
)
def test_a_killed_process_stops_the_run_and_the_run_resumes(request, tmp_path, tiny_model, victim, marker):
    """SIGKILL one process of the real trio mid-run: the launcher stops the others, exits 1
    naming the dead process with its log tail, and leaves nothing running. `--resume` then
    finishes the run from the newest checkpoint with nothing lost and nothing done twice.
    The trainer's run is the distillation run (``distilled_run``): its teacher's vLLM stops
    and restarts with the others."""
    run = request.getfixturevalue("distilled_run") if victim == "trainer" else kill_and_resume(tmp_path, tiny_model, marker)
    assert run.code == 1, run.out
    assert f"{victim} failed: it was killed by SIGKILL" in run.out, run.out
    assert f"last lines of {log_path(run.run_dir, victim)}" in run.out
    assert run.stopped_s < 30, f"the launcher took {run.stopped_s:.1f} s to stop the others"

    assert run.resume_step >= KILL_AFTER_CHECKPOINT
    print(f"killed {victim}; resumed from step {run.resume_step}; the resumed run took {run.resume_s:.1f} s")
    assert_resumed_cleanly(run.run_dir, run.resume_step)

    if victim == "orchestrator":  # slow-marked: a third run of 32 steps
        # Resuming again from the same checkpoint samples on from the same cursor: the same
        # examples first (which step each lands in depends on when its group completes).
        first = recorded_picks(run.run_dir, first_step=run.resume_step)
        again_step, _ = resume(run.run_dir, run.config, "--resume-step", str(run.resume_step))
        assert again_step == run.resume_step
        again = recorded_picks(run.run_dir, first_step=run.resume_step)
        flat = lambda picks: {pick for step_picks in picks.values() for pick in step_picks}  # noqa: E731
        in_flight = (ASYNC_LEVEL + 1) * RESUME_RUN["batch_size"] // RESUME_RUN["rollouts_per_example"]
        assert len(flat(again) ^ flat(first)) <= 2 * in_flight, "the same examples, but for those in flight at the end"
        assert_resumed_cleanly(run.run_dir, run.resume_step)


# --------------------------------------------------------------------------- distillation


def test_a_teacher_process_scores_every_sampled_token_across_the_kill(distilled_run):
    """The distillation run (``distilled_run``, its trainer SIGKILLed after a checkpoint and
    resumed): the teacher's vLLM started with the run; every recorded sample carries the
    teacher's logprob at each sampled token (0 elsewhere) and its 5 most likely tokens there,
    most likely first; both processes log the reverse KL; every step trained once across the
    kill (and no process, the teacher's vLLM included, is left: ``kill_mid_run`` and
    ``resume`` check that)."""
    run_dir, max_steps = distilled_run.run_dir, RESUME_RUN["max_steps"]
    assert "teacher: vLLM on CPU" in distilled_run.out
    rows = read_jsonl(metrics_path(run_dir))
    trainer = [r for r in rows if r["process"] == "trainer"]
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in trainer] == list(range(max_steps)), "every step trained once across the kill"
    assert all(r["loss/reverse_kl"] == r["loss/reverse_kl"] for r in trainer)  # logged and finite
    assert all(r["loss/reverse_kl_top_k"] >= 0 for r in trainer)
    assert all(r["distill/reverse_kl"] == r["distill/reverse_kl"] and r["distill/teacher_s"] > 0 for r in orchestrator)

    import numpy as np

    scored, steps = [], complete_steps(rollouts_dir(run_dir))  # the records a resume may still need
    assert len(steps) >= max_steps - KILL_AFTER_CHECKPOINT, steps
    for step in steps:
        for frame in load_record(run_dir, step).frames:
            for micro in decode_batch(frame).micro_batches:
                scored += [assert_teacher_scored(sample, step) for sample in micro.samples]
    assert len(scored) == RESUME_RUN["batch_size"] * len(steps)  # batch_size rollouts of one sample each
    # Over the run, not per sample: one short sample's tokens may agree within 1e-3 by chance
    # (CI saw a one-token sample at -5.5370 vs -5.5373).
    teacher, student = (np.concatenate(side) for side in zip(*scored))
    assert not np.allclose(teacher, student, atol=1e-3), "the teacher is another model"


def assert_teacher_scored(sample, step: int):
    """The teacher's logprob at each sampled token of ``sample`` and its top 5 tokens there;
    returns the teacher's and the student's logprobs at the sampled tokens."""
    import numpy as np

    ids, mask, student = sample_arrays(sample)
    teacher_lp = teacher_array(sample)
    assert teacher_lp is not None, f"step {step}: a sample without teacher logprobs"
    assert (teacher_lp[mask] < 0).all() and (teacher_lp[~mask] == 0).all()
    top_ids, top_lp = teacher_top_arrays(sample)
    assert top_ids.shape == top_lp.shape == (mask.sum(), 5), f"step {step}: not 5 tokens a sampled token"
    assert (np.diff(top_lp, axis=1) <= 0).all() and (top_lp <= 0).all(), "most likely first"
    sampled = ids[mask]
    assert (teacher_lp[mask] <= top_lp[:, 0] + 1e-5).all(), "no token beats the teacher's first"
    listed = top_ids == sampled[:, None]
    np.testing.assert_allclose(top_lp[listed], np.repeat(teacher_lp[mask], listed.sum(1)), atol=1e-4)
    return teacher_lp[mask], student[mask]


# --------------------------------------------------------------------------- tools

TOOL_ENV = """id = "wiki-search"
args = { source = "generated", max_turns = 4 }"""


def test_tool_calling_trio_parses_calls_with_vllm_and_trains_only_the_model_tokens(tmp_path, tool_model):
    """wiki-search on the real trio with the tool-warmed tiny model: vLLM's hermes parser reads
    the model's `<tool_call>` JSON (the rollout goes on with `<tool_response>` blocks holding
    real search results), the loss mask is 1 exactly on the sampled tokens of each turn and 0
    on every tool output, and the mismatch KL at the first step is below 1e-3."""
    run_dir, config = tmp_path / "tools", tmp_path / "tools.toml"
    config.write_text(trio_toml(tool_model, run_dir, max_steps=2, env=TOOL_ENV, seq_len=1024, max_tokens=96,
                                batch_size=8, rollouts_per_example=4, temperature=0.5,
                                preflight="enabled = false", extra='tool_call_parser = "hermes"\n'))
    proc, tag = start_launcher(config)
    finish(proc, run_dir)
    assert tagged_processes(tag) == []

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    calls = responses = 0
    for step in range(2):
        for micro in decode_batch(load_record(run_dir, step).frames[0]).micro_batches:
            for sample in micro.samples:
                ids, mask, logprobs = (a.tolist() for a in sample_arrays(sample))
                # vLLM's logprobs on the sampled tokens only (at temperature 0.5 one may round to 0)
                assert all(lp == 0 for lp, m in zip(logprobs, mask) if not m) and all(lp <= 0 for lp in logprobs)
                spans = mask_spans(mask)
                text = lambda a, b: tok.decode(ids[a:b])  # noqa: E731
                for (s, e), (s_next, _) in zip(spans, spans[1:]):
                    between = text(e, s_next)  # the environment's turn: never trained on
                    if "<tool_response>" in between:
                        responses += 1
                        calls += "<tool_call>" in text(s, e)
                for s, e in spans:
                    assert "<tool_response>" not in text(s, e)
    assert responses > 0 and calls == responses, (calls, responses)
    rows = read_jsonl(metrics_path(run_dir))
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert sum(r["metrics/wiki-search/total_tool_calls"] for r in orchestrator) > 0
    trainer = [r for r in rows if r["process"] == "trainer"]
    assert trainer[0]["loss/mismatch_kl"] < 1e-3, trainer[0]
    # the traces show the calls and the tool's replies in order, as a person reads the episode
    traced = assert_traced(run_dir, 2, rollouts_per_example=4)
    with_calls = [r for r in traced if any(m.get("tool_calls") for m in r["completion"])]
    assert with_calls and all("tool" in [m["role"] for m in r["completion"]] for r in with_calls)


# llama is slow-marked to keep the default suite near 20 minutes: packing's tests compare
# its logprobs with one row per sample on CPU; the trio runs the other family here.
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen3_moe"])
def test_other_model_families_train_hand_off_and_match_vllm(tmp_path, family_models, arch):
    """The documentation's other families (Qwen3 dense is every other trio test's model),
    tiny and random: the trainer steps with FSDP2, writes weights vLLM reloads, and vLLM's
    logprobs match the trainer's at the first step."""
    from transformers import AutoConfig

    model = family_models[arch]
    proc, run_dir, tag = launch(tmp_path, model, arch, "--no-tmux")
    finish(proc, run_dir)
    rows = read_jsonl(metrics_path(run_dir))
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS))
    assert trainer[0]["loss/mismatch_kl"] < 1e-3, trainer[0]
    # Every step with a group of unequal rewards trained (a random model's batch can also
    # have none: then the update is skipped on purpose, trainer.optim.clip_and_step).
    zero_adv = {r["step"]: r["batch/zero_adv_groups_frac"] for r in rows if r["process"] == "orchestrator" and "reward/mean" in r}
    informative = [r for r in trainer if zero_adv[r["step"]] < 1]
    assert informative and all(r["optim/grad_norm"] > 0 for r in informative), (zero_adv, trainer)
    reloaded = [r["weights/reloaded_step"] for r in rows if r["process"] == "orchestrator" and "weights/reloaded_step" in r]
    assert reloaded, "vLLM never reloaded the trainer's weights"
    handed_off = weights_step_dir(run_dir, MAX_STEPS)
    assert AutoConfig.from_pretrained(handed_off).model_type == AutoConfig.from_pretrained(model).model_type
    assert tagged_processes(tag) == []


# --------------------------------------------------------------------------- LoRA

@pytest.mark.slow
def test_lora_rl_raises_the_quickstart_reward(tmp_path):
    """The quickstart (tiny model, SFT warm-up, async RL on reverse-text) with LoRA layered on
    (`configs/reverse-text/lora.toml`), 60 steps: the reward of the last 5 steps is above
    that of the first 5, and vLLM sampled what the trainer scores at the first step."""
    base, data, sft, run_dir = tmp_path / "base", tmp_path / "sft.jsonl", tmp_path / "sft", tmp_path / "rl"
    for cmd in ([str(REPO / "scripts" / "build_tiny_model.py"), str(base)],
                [str(REPO / "scripts" / "make_sft_data.py"), str(data)],
                ["-m", "prime_rl.cli", "sft", str(REPO / "configs/reverse-text/sft.toml"), "--model.name", str(base),
                 "--data.path", str(data), "--output-dir", str(sft)]):
        subprocess.run([sys.executable, *cmd], check=True, capture_output=True, cwd=REPO)
    proc, tag = start_launcher(
        REPO / "configs/reverse-text/rl.toml", REPO / "configs/reverse-text/lora.toml", "--model", str(sft),
        "--output-dir", str(run_dir), "--max-steps", "60", "--inference.port", str(free_port()), "--transport.port", str(free_port()),
    )
    finish(proc, run_dir, timeout=1500)
    assert tagged_processes(tag) == []
    rows = read_jsonl(metrics_path(run_dir))
    reward = [r["reward/mean"] for r in rows if r["process"] == "orchestrator" and "reward/mean" in r]
    trainer = [r for r in rows if r["process"] == "trainer"]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    print(f"LoRA on the quickstart: reward first 5 steps {first:.3f}, last 5 {last:.3f}; "
          f"mismatch KL at step 0 {trainer[0]['loss/mismatch_kl']:.2e}; trainer peak memory {trainer[-1]['perf/peak_memory_mb']:.0f} MB")
    assert len(reward) == 60 and last > first, reward
    assert trainer[0]["loss/mismatch_kl"] < 1e-3
