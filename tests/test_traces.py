"""Rollout traces (issue 37): the rows the orchestrator and the trainer write, reading them
back (torn and damaged lines), the rewind on resume, the step's record, the wire fields, and
the trainer's per-token view, against hand-computed values."""

import json
import math

import numpy as np
import pytest
import torch

from orchestrator.batch import ScoredRollout, pack_batches
from orchestrator.main import RateWindow
from orchestrator.progress import StepRecord, Cursor, load_record, save_record
from orchestrator.traces import TraceWriter, chosen_groups, env_secrets, table_row
from prime_rl.config import LossConfig
from prime_rl.config.orchestrator import TracesConfig
from prime_rl.envs import Rollout, Turn
from prime_rl.launch.resume import drop_trace_rows, rewind
from prime_rl.traces import read_traces, rollout_traces_path, trace_id, trainer_traces_path
from prime_rl.wire import WireError, decode_batch, encode_batch, make_sample
from trainer.traces import sample_traces, write_traces


class CharTokenizer:
    """Each id is a character (the tiny test models' byte-level vocabulary)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def rollout(example_id=0, reward=1.0, completion="ab", multi_turn=False, **kw):
    turns = [Turn([1, 2, 3], [ord(c) for c in completion], [-0.5] * len(completion), versions=(2, 3))]
    messages = [{"role": "assistant", "content": completion}]
    if multi_turn:  # a tool call, the tool's reply, then the answer
        turns.append(Turn([9, 9], [ord("z")], [-0.25], versions=(3, 3)))
        messages = [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "found"},
            {"role": "assistant", "content": "z"},
        ]
    return Rollout(example_id, turns, reward, prompt=[{"role": "user", "content": "ba"}], completion=messages,
                   metrics={"lcs": reward}, stop_condition="completed", finish_reason="stop", **kw)


def writer(tmp_path, groups=2, secrets=(), seq_len=64):
    return TraceWriter(tmp_path, TracesConfig(groups=groups), CharTokenizer(), seq_len, secrets=secrets, seed=0)


def test_whole_groups_are_chosen_at_random_the_same_for_the_same_seed_and_step():
    picked = chosen_groups(8, 2, seed=0, step=5)
    assert len(picked) == 2 and picked == sorted(set(picked)) and all(0 <= g < 8 for g in picked)
    assert chosen_groups(8, 2, seed=0, step=5) == picked  # a resumed run traces the same groups
    assert {tuple(chosen_groups(8, 2, seed=0, step=s)) for s in range(20)} != {tuple(picked)}  # not always the first
    assert chosen_groups(3, "all", 0, 0) == chosen_groups(3, 5, 0, 0) == [0, 1, 2]
    assert chosen_groups(3, 0, 0, 0) == []


def test_a_steps_traced_rows_are_whole_groups_with_their_advantages(tmp_path):
    """Three groups of two rollouts; two groups traced: four rows, each with its group, place,
    advantage and the trainer's key (the same id on the item the trainer gets)."""
    w = writer(tmp_path)
    items = [ScoredRollout(rollout(example_id=g, reward=float(i)), advantage=i - 0.5, policy_version=2, env="rt",
                           last_policy_version=3) for g in range(3) for i in range(2)]
    marked = w.mark(7, items, [2, 2, 2])
    groups = chosen_groups(3, 2, 0, 7)
    assert [m.trace_id for m in marked] == [trace_id("train", 7, g, i) if g in groups else None
                                            for g in range(3) for i in range(2)]
    rows = w.train_rows(7, marked, [2, 2, 2])
    assert [(r["group"], r["sample"], r["advantage"]) for r in rows] == [(g, i, i - 0.5) for g in groups for i in range(2)]
    row = rows[0]
    assert row["id"] == "train-7-%d-0" % groups[0] and row["kind"] == "train" and row["step"] == 7 and row["env"] == "rt"
    assert row["example_id"] == groups[0] and row["reward"] == 0.0 and row["metrics"] == {"lcs": 0.0}
    assert row["policy_version"] == [2, 3] and row["stop_condition"] == "completed" and row["finish_reason"] == "stop"
    assert row["prompt"] == [{"role": "user", "content": "ba"}] and row["completion"][0]["content"] == "ab"
    assert row["turns"] == [{"prompt_ids": [1, 2, 3], "completion_ids": [97, 98], "tokens": ["a", "b"],
                             "logprobs": [-0.5, -0.5], "versions": [2, 3], "part": 0}]
    assert row["truncated"] is False
    # the trainer gets the ids on its samples
    samples = [s for b in pack_batches(marked, step=7, num_ranks=1, micro_batch_size=8, temperature=1.0, seq_len=64)
               for m in b.micro_batches for s in m.samples]
    assert sorted(s.trace_id for s in samples if s.trace_id) == sorted(r["id"] for r in rows)


def test_a_multi_turn_rollout_with_tools_keeps_every_message_and_turn_in_order(tmp_path):
    w = writer(tmp_path, seq_len=6)
    (row,) = w.lines([w.row(rollout(multi_turn=True), "train", 0, "tools", 0, 0, "train-0-0-0", advantage=0.5)])
    row = json.loads(row)
    assert [m["role"] for m in row["completion"]] == ["assistant", "tool", "assistant"]
    assert row["completion"][0]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}
    assert [t["tokens"] for t in row["turns"]] == [["a", "b"], ["z"]]
    assert [t["versions"] for t in row["turns"]] == [[2, 3], [3, 3]]
    assert row["truncated"] is True  # 3 + 2 + 2 + 1 tokens > seq_len 6
    assert "-> lookup(" in table_row(row)[5]


def test_no_secret_reaches_a_trace(tmp_path, monkeypatch):
    """A key of the settings and one read from the environment, echoed by the model or the
    environment, are written as <redacted>, however they are quoted; so is a key by its look."""
    monkeypatch.setenv("MY_JUDGE_KEY", "judge-secret-4242")
    settings = {"env": [{"args": {"api_key": "settings-secret-1234"}}]}
    w = writer(tmp_path, secrets=[settings, env_secrets("MY_JUDGE_KEY")])
    echoed = rollout(completion="x")
    echoed.completion[0]["content"] = 'settings-secret-1234 "judge-secret-4242" sk-abcdefghijklmnopqrstuv'
    echoed.prompt[0]["content"] = "Authorization: Bearer abcdef123456"
    w.write(w.lines([w.row(echoed, "train", 0, "rt", 0, 0, "train-0-0-0")]))
    text = rollout_traces_path(tmp_path).read_text()
    for secret in ("settings-secret-1234", "judge-secret-4242", "sk-abcdefghijklmnopqrstuv", "abcdef123456"):
        assert secret not in text
    assert text.count("<redacted>") == 4


def test_non_finite_scores_are_written_as_null(tmp_path):
    w = writer(tmp_path)
    (line,) = w.lines([w.row(rollout(reward=math.nan), "eval", 0, "rt", 0, 0, "eval-rt-0-0-0")])
    row = json.loads(line)
    assert row["reward"] is None and row["metrics"] == {"lcs": None} and row["advantage"] is None


def test_a_reader_skips_damage_counts_it_and_leaves_an_unfinished_line_for_later(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b'{"id": "a", "step": 0}\nnot json\n[1]\n{"id": "b", "step": 1.5}\n{"id": "c", "step": 2}\n{"id": "d", "st')
    read = read_traces(path)
    assert [r["id"] for r in read.rows] == ["a", "c"] and read.skipped == 3
    with open(path, "ab") as f:  # the writer finishes the line
        f.write(b'ep": 3}\n')
    more = read_traces(path, read.offset)
    assert [r["id"] for r in more.rows] == ["d"] and more.skipped == 0 and more.offset == path.stat().st_size
    assert read_traces(tmp_path / "missing.jsonl").rows == []


def test_the_rewind_drops_later_steps_and_a_torn_line_but_keeps_damage_before(tmp_path):
    path = tmp_path / "trainer.jsonl"
    path.write_bytes(b'{"id":"a","step":3}\ngarbage\n{"id":"b","step":4}\n{"id":"c","step":2}\n{"id":"d","st')
    assert drop_trace_rows(path, 4) == 2
    assert path.read_bytes() == b'{"id":"a","step":3}\ngarbage\n{"id":"c","step":2}\n'
    assert drop_trace_rows(path, 4) == 0


def test_a_resume_rewinds_both_trace_files(tmp_path):
    for path in (rollout_traces_path(tmp_path), trainer_traces_path(tmp_path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"id": f"train-{s}-0-0", "step": s}) + "\n" for s in range(6)))
    removed = rewind(tmp_path, 4)
    assert "2 trace rows of steps >= 4 in rollouts.jsonl" in removed and "2 trace rows of steps >= 4 in trainer.jsonl" in removed
    assert [r["step"] for r in read_traces(trainer_traces_path(tmp_path)).rows] == [0, 1, 2, 3]


def test_a_steps_record_keeps_its_trace_lines_for_the_replay(tmp_path):
    lines = ['{"id":"train-3-0-0","step":3}', '{"id":"train-3-0-1","step":3}']
    record = StepRecord(step=3, frames=[b"x"], before=Cursor({}), after=Cursor({}), picks=[(0, 1)], min_version=2,
                        max_version=3, traces=lines)
    save_record(tmp_path, record)
    assert load_record(tmp_path, 3).traces == lines
    record.traces = []
    save_record(tmp_path, record)  # a record without traces (or made before them) has none
    assert load_record(tmp_path, 3).traces == []


def test_the_trace_id_travels_on_the_wire_and_a_bad_one_is_refused():
    sample = make_sample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], advantage=1.0, reward=1.0, policy_version=0,
                         example_id=0, trace_id="train-1-0-2", trace_part=1)
    from orchestrator.batch import pack_samples

    (batch,) = pack_samples([sample], step=1, num_ranks=1, micro_batch_size=1, temperature=1.0)
    (got,) = decode_batch(encode_batch(batch)).micro_batches[0].samples
    assert (got.trace_id, got.trace_part) == ("train-1-0-2", 1)
    for bad in ("", "x" * 129, "a\nb"):
        (batch,) = pack_samples([make_sample([1, 2], [0, 1], [0.0, -0.1], advantage=0.0, reward=0.0, policy_version=0,
                                             example_id=0, trace_id=bad)], step=1, num_ranks=1, micro_batch_size=1,
                                temperature=1.0)
        with pytest.raises(WireError, match="trace_id must be 1 to 128 printable characters"):
            decode_batch(encode_batch(batch))


def test_the_trainers_view_of_a_traced_sample_token_by_token(tmp_path):
    """Two samples, the second traced: its two loss tokens' logprobs, entropies (scattered from
    the head's row-major order) and whether the token band (0.5, 2) dropped them:
    exp(-0.1 - -1.0) = 2.46 leaves it, exp(-0.2 - -0.3) = 1.11 stays."""
    loss_mask = torch.tensor([[1, 0, 0], [0, 1, 1]], dtype=torch.bool)
    trainer_lp = torch.tensor([[-0.4, 0.0, 0.0], [0.0, -0.1, -0.2]])
    inference_lp = torch.tensor([[-0.4, 0.0, 0.0], [0.0, -1.0, -0.3]])
    entropy = torch.tensor([0.7, 1.5, 2.5])  # [N]: sample 0's token, then sample 1's two
    cfg = LossConfig(importance="token_mask", mask_ratio_low=0.5, mask_ratio_high=2.0)
    (row,) = sample_traces([None, ("train-4-1-0", 0)], trainer_lp, inference_lp, loss_mask, entropy, cfg)
    assert row == {"id": "train-4-1-0", "part": 0, "logprobs": [-0.1, -0.2], "entropy": [1.5, 2.5], "masked": [1, 0]}
    assert sample_traces([None, None], trainer_lp, inference_lp, loss_mask, entropy, cfg) == []
    write_traces(tmp_path, 4, 1, [row])
    (written,) = read_traces(trainer_traces_path(tmp_path)).rows
    assert written == {**row, "step": 4, "rank": 1}


def test_the_sampling_rate_is_read_over_a_window_not_between_two_close_cuts():
    """Steps of 100 tokens in 1 s each, then a cut 0.01 s after the last: one step's rate is
    10,000 tok/s, the 10 s window's (100 x 11 tokens over 10.01 s, the oldest step dropped
    once the rest span 10 s) ~110."""
    single = RateWindow(seconds=0.0)
    assert single.add(100, 0.01) == pytest.approx(10_000)
    window = RateWindow(seconds=10.0)
    rates = [window.add(100, 1.0) for _ in range(12)]
    assert rates == [pytest.approx(100.0)] * 12
    assert window.add(100, 0.01) == pytest.approx(1100 / 10.01)
    assert len(window.steps) == 11
    assert np.isclose(RateWindow().add(0, 0.0), 0.0)


def test_with_wandb_the_traced_rows_go_as_a_table_every_n_steps(tmp_path, monkeypatch):
    """Steps 0 and 10 of an interval of 10 send a table (its chat as text, secrets scrubbed);
    step 5 does not. A table W&B refuses switches the tables off, never the run."""
    import sys
    import types

    tables, logged = [], []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data
            tables.append(self)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Table=Table))
    run = types.SimpleNamespace(log=lambda row, step: logged.append((step, row)))
    w = TraceWriter(tmp_path, TracesConfig(groups=1, wandb_interval=10), CharTokenizer(), 64,
                    secrets=[{"api_key": "key-in-a-reply-1234"}], wandb=run)
    echoed = rollout(completion="x")
    echoed.completion[0]["content"] = "key-in-a-reply-1234"
    for step in (0, 5, 10):
        w.write(w.lines([w.row(echoed, "train", step, "rt", 0, 0, trace_id("train", step, 0, 0), advantage=0.5)]), step)
    assert [step for step, _ in logged] == [0, 10]
    assert tables[0].columns == ["step", "env", "example_id", "group", "prompt", "completion", "reward", "advantage", "stop"]
    assert tables[0].data == [[0, "rt", 0, 0, "[user] ba", "[assistant] <redacted>", 1.0, 0.5, "completed"]]
    run.log = lambda row, step: (_ for _ in ()).throw(RuntimeError("W&B is down"))
    w.write(w.lines([w.row(echoed, "train", 20, "rt", 0, 0, "train-20-0-0")]), 20)
    assert w.wandb is None and len(read_traces(rollout_traces_path(tmp_path)).rows) == 4
