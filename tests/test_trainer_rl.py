"""trainer.rl against a fake orchestrator: a PUSH socket in the test sends hand-made batches.

The end-to-end test runs `python -m trainer.rl` as a real process; the rest are fast
in-process checks of the receiver, config errors and padding invariance.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from helpers import build_tiny, free_port, free_port_pair

from prime_rl.config import LoraConfig, TransportConfig
from prime_rl.heartbeat import heartbeat_path, read_heartbeat
from prime_rl.rundir import MARKER, complete_steps, read_jsonl, weights_dir
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, encode_batch, make_sample
from trainer.data import BatchReceiver, collate
from trainer.model import forward_logits
from trainer.rl import main

from trainer_helpers import (
    TEMPERATURE,
    WORDS,
    batch_frame,
    completion_logprobs,
    make_samples,
    run_trainer_process,
    trainer_config,
)


def test_rl_trainer_process_trains_and_publishes_weights(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    config = trainer_config(tiny_model, run, free_port())
    samples = make_samples(tiny_model, policy_version=0)
    t0 = time.monotonic()
    short_mask = msgspec.structs.replace(samples[0], loss_mask=samples[0].loss_mask[:-1])
    frames = [
        b"\xc1 garbage: 0xc1 is never valid msgpack",
        batch_frame(0, samples, schema_version=SCHEMA_VERSION + 1),
        batch_frame(5, samples),  # a step the trainer is not at
        batch_frame(0, [short_mask, *samples[1:]]),  # tensors of inconsistent lengths
        batch_frame(0, samples),
        batch_frame(1, samples),
    ]
    returncode, out = run_trainer_process(tmp_path, config, frames)
    print(out)
    print(f"trainer process took {time.monotonic() - t0:.1f}s")

    assert returncode == 0, out
    rejected = [line for line in out.splitlines() if "rejected a message" in line]
    assert len(rejected) == 4, out
    assert "not a msgpack train batch" in rejected[0] and "wrong schema version" in rejected[1]
    assert "batch for step 5 arrived while expecting step 0" in rejected[2]
    assert "inconsistent lengths" in rejected[3]

    assert complete_steps(weights_dir(run)) == [1, 2]
    beat = read_heartbeat(heartbeat_path(run, "trainer"))  # what the launcher's watchdog reads
    assert (beat.progress, beat.waiting_for) == ("trained step 1", None)
    for step in (1, 2):
        assert (weights_dir(run) / f"step_{step}" / MARKER).is_file()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(weights_dir(run) / "step_2").state_dict()
    assert initial.keys() == trained.keys()
    # The update went the way of the advantages: the completion the batch rewarded most
    # (advantage +1) became more likely, the one it punished most (-1) less likely.
    before = completion_logprobs(tiny_model, samples)
    after = completion_logprobs(weights_dir(run) / "step_2", samples)
    assert after[0] > before[0] and after[1] < before[1], (before, after)

    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["process"] == "trainer"]
    assert [r["step"] for r in rows] == [0, 1]
    first = rows[0]
    # on-policy (ratio 1): -sum(advantage x completion tokens) / loss tokens
    # = -(1 * 4 - 1 * 6 + 0.5 * 4 - 0.5 * 8) / 22
    assert first["loss/policy"] == pytest.approx(4 / 22, abs=1e-3)
    assert first["loss/mismatch_kl"] < 1e-3
    assert first["loss/ratio"] == pytest.approx(1.0, abs=1e-4)
    assert first["loss/masked_frac"] == 0.0
    assert first["perf/samples"] == 4 and first["perf/loss_tokens"] == sum(len(w) + 1 for w in WORDS)
    assert [r["staleness/max"] for r in rows] == [0, 1]  # both batches were sampled by version 0
    for key in ("loss/policy", "loss/entropy", "optim/grad_norm", "optim/lr", "perf/tokens_per_s",
                "time/step", "time/wait_batch", "time/train", "time/save_weights"):
        assert key in first, key
    # Step 2 trains on rollouts of version 0 after one update: the ratio has moved off 1.
    assert rows[1]["loss/mismatch_kl"] > first["loss/mismatch_kl"]


def test_receiver_skips_invalid_frames_and_times_out(tiny_model):
    port = free_port()
    logged = []
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"tcp://127.0.0.1:{port}")
    sample = make_sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -2.0], advantage=1, reward=1, policy_version=0, example_id=0)
    good = encode_batch(TrainBatch(SCHEMA_VERSION, 3, 0, 1.0, [MicroBatch([sample])]))
    other_rank = encode_batch(TrainBatch(SCHEMA_VERSION, 3, 1, 1.0, [MicroBatch([sample])]))
    with BatchReceiver(TransportConfig(port=port, timeout_s=0.3), rank=0, log=logged.append) as receiver:
        for frame in (b"junk", other_rank, good):
            push.send(frame)
        assert receiver.receive(3).step == 3
        assert len(logged) == 2 and "rank 1" in logged[1]
        with pytest.raises(TimeoutError, match=rf"no batch for step 4 from tcp://127.0.0.1:{port} within 0.3s"):
            receiver.receive(4)
    push.close()
    ctx.term()


def test_config_error_exits_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.json")]) == 2
    assert main(["--max-steps", "zero"]) == 2
    assert "max_steps" in capsys.readouterr().err


def test_no_batch_fails_with_a_clear_message(tiny_model, tmp_path, capsys):
    port = free_port()
    argv = ["--model.name", str(tiny_model), "--output-dir", str(tmp_path / "run"),
            "--transport.port", str(port), "--transport.first-batch-timeout-s", "0.5"]
    assert main(argv) == 1
    assert f"failed: TimeoutError: no batch for step 0 from tcp://127.0.0.1:{port} within 0.5s" in capsys.readouterr().err
    assert not (tmp_path / "run" / "weights").exists()


def test_padding_does_not_change_logprobs(tiny_model):
    from transformers import AutoModelForCausalLM

    def token_logprobs(logits, ids):  # position t scores token t + 1
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    meta = {"advantage": 0, "reward": 0, "policy_version": 0, "example_id": 0}
    short = make_sample([257, 97, 98, 258], [0, 1, 1, 1], [0.0] * 4, **meta)
    long = make_sample(list(range(97, 117)), [0] * 10 + [1] * 10, [0.0] * 20, **meta)
    with torch.no_grad():
        alone = collate(MicroBatch([short]), 64, 0, torch.device("cpu"))
        padded = collate(MicroBatch([long, short]), 64, 0, torch.device("cpu"))
        lp_alone, lp_padded = (
            token_logprobs(forward_logits(model, m.input_ids, m.attention_mask), m.input_ids)
            for m in (alone, padded)
        )
    assert padded.input_ids.shape == (2, 20)
    torch.testing.assert_close(lp_padded[1, :3], lp_alone[0], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(tiny_model, tmp_path):
    """torchrun with 2 gloo ranks (FSDP2, unequal micro-batch counts) == one process on the same step."""
    from safetensors.torch import load_file

    samples = make_samples(tiny_model, policy_version=0)
    one = run_trainer(tiny_model, tmp_path / "one", world=1, splits=[[[0, 1], [2, 3]]], samples=samples)
    two = run_trainer(tiny_model, tmp_path / "two", world=2, splits=[[[0], [1]], [[2, 3]]], samples=samples)
    initial = load_file(str(tiny_model / "model.safetensors"))
    assert one.keys() == two.keys()
    assert max((one[k] - initial[k]).abs().max().item() for k in one) > 1e-3  # it did train
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 2e-5

    # Each run checkpointed its last step; the 2-rank checkpoint (DCP, sharded over ranks)
    # loads into one process with the same weights and the same AdamW state.
    from trainer_helpers import fresh
    from trainer.ckpt import load_checkpoint

    loaded = {}
    for name in ("one", "two"):
        model, optimizer, scheduler = fresh(tiny_model)
        assert load_checkpoint(model, optimizer, scheduler, tmp_path / name, step=2) == 2
        loaded[name] = (model.state_dict(), optimizer.state_dict()["state"])
    weights = loaded["two"][0]
    assert max((weights[k] - two[k]).abs().max().item() for k in two) == 0.0
    moments_one, moments_two = loaded["one"][1], loaded["two"][1]
    assert moments_one.keys() == moments_two.keys() and len(moments_one) > 0
    for key in moments_one:
        assert moments_one[key]["step"] == moments_two[key]["step"] == 2
        torch.testing.assert_close(moments_two[key]["exp_avg"], moments_one[key]["exp_avg"], atol=2e-5, rtol=1e-3)


def run_trainer(model_dir: Path, run: Path, world: int, splits: list, samples: list, **extra) -> dict:
    """Run trainer.rl for 2 steps on `world` ranks; rank r gets micro-batches splits[r] (sample
    indices). Returns the tensors of weights/step_2 (the model, or with LoRA the adapter)."""
    from safetensors.torch import load_file

    port = free_port() if world == 1 else free_port_pair()
    run.mkdir(parents=True)
    config = trainer_config(model_dir, run, port, timeout_s=120, **extra)
    (run / "trainer.json").write_text(json.dumps(config))
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(world)] if world > 1 else []
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PUSH) for _ in range(world)]
    for r, sock in enumerate(socks):
        sock.setsockopt(zmq.SNDTIMEO, 120_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{port + r}")
    proc = subprocess.Popen([sys.executable, *launcher, "-m", "trainer.rl", "--config", str(run / "trainer.json")],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(run)})  # torchrun's log folder
    try:
        for step in (0, 1):  # steps count from 0; weights/step_2 = after two steps
            for r, sock in enumerate(socks):
                micro = [MicroBatch([samples[i] for i in mb]) for mb in splits[r]]
                sock.send(encode_batch(TrainBatch(SCHEMA_VERSION, step, r, TEMPERATURE, micro)))
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for sock in socks:
            sock.close()
        ctx.term()
    folder = run / "weights" / "step_2"
    return load_file(str(folder / ("adapter_model.safetensors" if "lora" in extra else "model.safetensors")))


@pytest.mark.slow
def test_two_fsdp_ranks_train_the_same_lora_adapter_as_one_process(tiny_model, tmp_path):
    """LoRA under FSDP2 (frozen base and trainable adapters in the same shards): 2 gloo ranks
    write the adapter one process writes, and their checkpoint resumes in one process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    samples = make_samples(tiny_model, policy_version=0)
    lora = {"lora": {"rank": 4, "alpha": 8}}
    one = run_trainer(tiny_model, tmp_path / "one", world=1, splits=[[[0, 1], [2, 3]]], samples=samples, **lora)
    two = run_trainer(tiny_model, tmp_path / "two", world=2, splits=[[[0], [1]], [[2, 3]]], samples=samples, **lora)
    assert one.keys() == two.keys() and all(".lora_" in k for k in one)
    assert max(one[k].abs().max().item() for k in one if "lora_B" in k) > 1e-4  # B left zero: it trained
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 2e-5

    from trainer_helpers import fresh
    from trainer.ckpt import load_checkpoint

    model, optimizer, scheduler = fresh(tiny_model, lora=LoraConfig(**lora["lora"]))
    assert load_checkpoint(model, optimizer, scheduler, tmp_path / "two", step=2) == 2
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "two" / "weights" / "step_2")
    ids = torch.tensor([[5, 80, 81, 82]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)


def test_nonfinite_steps_are_skipped_then_stop_the_run(tiny_model, tmp_path):
    """An absurd learning rate blows the weights up after step 0, so every later loss is
    non-finite: those updates are skipped (weights keep their last finite values) and the
    second one in a row stops the trainer with a clear message."""
    run = tmp_path / "run"
    config = trainer_config(tiny_model, run, free_port(), lr=1e30, max_steps=5, max_nonfinite_steps=2)
    samples = make_samples(tiny_model, policy_version=0)
    returncode, out = run_trainer_process(tmp_path, config, [batch_frame(step, samples) for step in range(5)])
    assert returncode == 1, out
    assert "2 consecutive steps with a non-finite loss or gradient (trainer.max_nonfinite_steps = 2)" in out
    assert "update skipped, 1 in a row" in out
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["process"] == "trainer"]
    assert rows[-1]["optim/nonfinite_streak"] == 1 and rows[0]["optim/nonfinite_streak"] == 0
    from safetensors.torch import load_file

    last = max(complete_steps(weights_dir(run)))
    weights = load_file(str(weights_dir(run) / f"step_{last}" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values()), "published weights must stay finite"


def test_the_loss_mean_skips_samples_without_advantage_by_default():
    """A group whose rewards were all equal (advantage 0) carries no gradient; by default its
    tokens do not count in the step's mean either, so it cannot shrink the others' step."""
    from prime_rl.config import LossConfig
    from trainer.data import MicroTensors
    from trainer.rl import loss_token_count

    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]).bool()  # 3, 4, 2 loss tokens
    ids = torch.zeros(3, 5, dtype=torch.long)
    mt = MicroTensors(
        input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask, inference_logprobs=torch.zeros(3, 5),
        advantages=torch.tensor([0.5, 0.0, -0.5]), num_truncated=0, model_ids=ids, model_positions=ids,
        model_mask=torch.ones_like(ids), source=ids, num_model_tokens=15,
    )
    assert LossConfig().denominator == "informative"
    assert loss_token_count(mt, "informative") == 3 + 2
    assert loss_token_count(mt, "all") == 3 + 4 + 2


def test_lora_trains_with_less_peak_memory_than_full_fine_tuning(tmp_path):
    """The same two steps on the same 27M-parameter model (110 MB of float32 weights):
    full fine-tuning holds gradients and two AdamW moments of every weight (~3 x 110 MB
    more), LoRA those of the adapters only. Peak = the trainer process's max RSS on CPU."""
    model = build_tiny(tmp_path / "mid", hidden_size=512, num_layers=8, head_dim=64)
    weights_mb = (model / "model.safetensors").stat().st_size / 2**20
    samples = make_samples(model, policy_version=0)
    peaks = {}
    for mode, extra in (("full", {}), ("lora", {"lora": {"rank": 8}})):
        run = tmp_path / mode
        config = trainer_config(model, run, free_port(), **extra)
        returncode, out = run_trainer_process(tmp_path, config, [batch_frame(0, samples), batch_frame(1, samples)])
        assert returncode == 0, out
        rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["process"] == "trainer"]
        assert [r["step"] for r in rows] == [0, 1] and all(r["optim/grad_norm"] > 0 for r in rows), rows
        peaks[mode] = rows[-1]["perf/peak_memory_mb"]
    print(f"trainer peak memory, {weights_mb:.0f} MB of weights: full fine-tuning {peaks['full']:.0f} MB, LoRA {peaks['lora']:.0f} MB")
    assert peaks["lora"] < peaks["full"] - weights_mb, peaks
