"""Trainer checkpoints: exact resume, the marker rule, pruning, and writes that fail."""

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from trainer_helpers import LORA, fresh, train_step
from prime_rl.config import OptimConfig
from prime_rl.rundir import MARKER, WriteFailed, checkpoint_step_dir, checkpoints_dir, complete_steps, weights_dir
from trainer.ckpt import CheckpointError, checkpoint_due, load_checkpoint, save_checkpoint
from trainer.weights import save_weights


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_resume_continues_exactly_like_an_uninterrupted_run(tiny_model, tmp_path, lora):
    straight = fresh(tiny_model, lora)
    for step in range(4):
        train_step(*straight, step)

    interrupted = fresh(tiny_model, lora)
    for step in range(2):
        train_step(*interrupted, step)
    save_checkpoint(*interrupted, tmp_path, step=2, keep_last=2)
    train_step(*interrupted, 99)  # work after the checkpoint is lost with the process

    resumed = fresh(tiny_model, lora)
    assert load_checkpoint(*resumed, tmp_path, step=2) == 2
    for step in range(2, 4):
        train_step(*resumed, step)

    for (name, a), b in zip(straight[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(a, b), name  # model, AdamW moments and the warm-up schedule all restored
    assert resumed[2].last_epoch == straight[2].last_epoch == 4
    assert resumed[1].param_groups[0]["lr"] == straight[1].param_groups[0]["lr"]


def test_resume_continues_a_decaying_lr_where_it_was(tiny_model, tmp_path):
    optim = OptimConfig(lr=1e-2, warmup_steps=1, decay="cosine", min_lr_ratio=0.1)
    straight = fresh(tiny_model, optim=optim, total_steps=5)
    for step in range(5):
        train_step(*straight, step)

    interrupted = fresh(tiny_model, optim=optim, total_steps=5)
    for step in range(3):
        train_step(*interrupted, step)
    save_checkpoint(*interrupted, tmp_path, step=3, keep_last=1)

    resumed = fresh(tiny_model, optim=optim, total_steps=5)
    load_checkpoint(*resumed, tmp_path, step=3)
    assert resumed[1].param_groups[0]["lr"] == pytest.approx(interrupted[1].param_groups[0]["lr"])
    for step in range(3, 5):
        train_step(*resumed, step)
    for (name, a), b in zip(straight[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(a, b), name
    assert straight[1].param_groups[0]["lr"] < 1e-2  # it did decay
    assert resumed[1].param_groups[0]["lr"] == straight[1].param_groups[0]["lr"]


def test_rng_state_is_restored(tiny_model, tmp_path):
    model, optimizer, scheduler = fresh(tiny_model)
    torch.manual_seed(123)
    save_checkpoint(model, optimizer, scheduler, tmp_path, step=1, keep_last=1)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_checkpoint(*fresh(tiny_model), tmp_path, step=1)
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_without_its_marker_is_never_loaded(tiny_model, tmp_path):
    state = fresh(tiny_model)
    save_checkpoint(*state, tmp_path, step=2, keep_last=2)
    # A crash between the rename and the marker, and one while filling step_4.tmp:
    shutil.copytree(checkpoint_step_dir(tmp_path, 2), checkpoint_step_dir(tmp_path, 3))
    (checkpoint_step_dir(tmp_path, 3) / MARKER).unlink()
    shutil.copytree(checkpoint_step_dir(tmp_path, 2), checkpoints_dir(tmp_path) / "step_4.tmp")
    assert complete_steps(checkpoints_dir(tmp_path)) == [2]
    for step in (3, 4):
        with pytest.raises(CheckpointError, match=rf"step_{step} is not a complete checkpoint \(no STABLE marker\); complete ones: \[2\]"):
            load_checkpoint(*fresh(tiny_model), tmp_path, step=step)


def test_a_tampered_checkpoint_cannot_run_code(tiny_model, tmp_path):
    """DCP's metadata file is a pickle: only DCP's own metadata types may come out of it."""
    import pickle

    state = fresh(tiny_model)
    save_checkpoint(*state, tmp_path, step=1, keep_last=1)
    evil = checkpoint_step_dir(tmp_path, 1) / "model_optim" / ".metadata"
    evil.write_bytes(pickle.dumps(EvilPayload()))
    with pytest.raises(CheckpointError, match="posix.system, which is not a DCP metadata type"):
        load_checkpoint(*fresh(tiny_model), tmp_path, step=1)
    assert not (tmp_path / "pwned").exists()


class EvilPayload:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_keep_last_prunes_old_checkpoints_but_weights_of_checkpoints_stay(tiny_model, tmp_path):
    model, optimizer, scheduler = fresh(tiny_model)
    for step in range(1, 6):
        save_weights(model, tmp_path, step, keep_last=1)
        if checkpoint_due(step, interval=2, max_steps=5):
            save_checkpoint(model, optimizer, scheduler, tmp_path, step, keep_last=2)
    assert complete_steps(checkpoints_dir(tmp_path)) == [4, 5]
    # weights keep_last=1, yet the weights of every kept checkpoint remain for a resume to serve
    # (step 2's go with the next weights save, now that checkpoint 2 is pruned)
    assert complete_steps(weights_dir(tmp_path)) == [2, 4, 5]
    save_weights(model, tmp_path, 6, keep_last=1)
    assert complete_steps(weights_dir(tmp_path)) == [4, 5, 6]
    assert [s for s in range(1, 8) if checkpoint_due(s, 3, 7)] == [3, 6, 7]
    assert not checkpoint_due(3, 0, 3)


# --------------------------------------------------------------------------- failing writes


@contextlib.contextmanager
def disk_full(path, size="3m", require_mount=False):
    """``path`` on a small tmpfs (a real ENOSPC); without mount rights, a 1 MiB file-size limit (EFBIG)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0
    if require_mount and not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root): the in-process disk-full test covers the path")
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        if not mounted:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, previous_limit[1]))
        yield "No space left on device" if mounted else "File too large"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def read_only(path):
    """Writes into ``path`` fail: chattr +i as root (EPERM), chmod 555 otherwise (EACCES)."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a filesystem without chattr +i: no way to deny a write")
        try:
            yield "Operation not permitted"
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield "Permission denied"
        finally:
            path.chmod(0o755)


def assert_previous_checkpoint_intact(tiny_model, run, failed_step):
    assert complete_steps(checkpoints_dir(run)) == [1]
    assert not checkpoint_step_dir(run, failed_step).exists()
    assert not (checkpoints_dir(run) / f"step_{failed_step}.tmp").exists()
    assert load_checkpoint(*fresh(tiny_model), run, step=1) == 1


def test_disk_full_keeps_the_previous_checkpoint_and_names_the_path(tiny_model, tmp_path):
    run = tmp_path / "run"
    state = fresh(tiny_model)
    with disk_full(run) as reason:
        save_checkpoint(*state, run, step=1, keep_last=5)  # ~2.4 MB: fits once, not twice
        train_step(*state, 1)
        with pytest.raises(WriteFailed) as failure:
            save_checkpoint(*state, run, step=2, keep_last=5)
        message = str(failure.value)
        assert message.startswith(f"cannot write checkpoint {checkpoint_step_dir(run, 2)}: {reason}"), message
        assert "\n" not in message
        assert_previous_checkpoint_intact(tiny_model, run, failed_step=2)


def test_permission_denied_keeps_the_previous_checkpoint_and_names_the_path(tiny_model, tmp_path):
    run = tmp_path / "run"
    state = fresh(tiny_model)
    save_checkpoint(*state, run, step=1, keep_last=5)
    with read_only(checkpoints_dir(run)) as reason:
        with pytest.raises(WriteFailed, match=rf"^cannot write checkpoint {checkpoint_step_dir(run, 2)}: {reason}"):
            save_checkpoint(*state, run, step=2, keep_last=5)
    assert_previous_checkpoint_intact(tiny_model, run, failed_step=2)
    weights_dir(run).mkdir(parents=True)
    with read_only(weights_dir(run)) as reason:
        with pytest.raises(WriteFailed, match=rf"^cannot write weights {weights_dir(run) / 'step_2'}: {reason}"):
            save_weights(state[0], run, 2, keep_last=1)


def test_trainer_process_stops_on_a_full_disk_naming_the_checkpoint(tiny_model, tmp_path):
    """The real trainer process on a nearly full disk: checkpoint 1 fits, checkpoint 2 does not."""
    from helpers import free_port
    from trainer_helpers import batch_frame, make_samples, run_trainer_process, trainer_config

    run = tmp_path / "run"
    samples = make_samples(tiny_model, policy_version=0)
    config = trainer_config(tiny_model, run, free_port(), max_steps=3, ckpt={"interval": 1, "keep_last": 3})
    with disk_full(run, size="4m", require_mount=True) as reason:
        code, out = run_trainer_process(tmp_path, config, [batch_frame(step, samples) for step in range(3)])
        last_line = out.strip().splitlines()[-1]
        assert code == 1, out
        assert last_line.startswith(f"[trainer] failed: WriteFailed: cannot write checkpoint {checkpoint_step_dir(run, 2)}: {reason}"), out
        assert_previous_checkpoint_intact(tiny_model, run, failed_step=2)
        assert complete_steps(weights_dir(run)) == [1, 2]


# --------------------------------------------------------------------------- damaged checkpoint files

RNG_DAMAGE = {
    "garbage": lambda path: path.write_bytes(b"\x00not a safetensors file"),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:40]),
    "empty": lambda path: path.write_bytes(b""),
    "wrong-tensors": lambda path: save_file({"cpu": torch.zeros(3)}, str(path)),
    "short-state": lambda path: save_file({"cpu": torch.zeros(5, dtype=torch.uint8)}, str(path)),
}
META_DAMAGE = {
    "a-list": ([1, 2], "holds a JSON list, expected an object"),
    "step-string": ({"step": "1"}, "step is '1', expected a whole number"),
    "other-step": ({"step": 7}, "says step 7, expected 1"),
    "lora-string": ({"lora": "yes"}, "lora is 'yes', expected true or false"),
    "scheduler-list": ({"scheduler": []}, "scheduler is [], expected the LR schedule's state"),
    "lrs-strings": ({"scheduler": {"last_epoch": 1, "base_lrs": ["x"]}}, "scheduler.base_lrs is ['x'], expected a list"),
    "not-json": (b"{\xff", "cannot read"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "cannot read"),
}


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("saved")
    save_checkpoint(*fresh(tiny_model), run, step=1, keep_last=1)
    return run


def damaged_copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run", checkpoint_step_dir(tmp_path / "run", 1)


@pytest.mark.parametrize("damage", RNG_DAMAGE)
def test_a_damaged_rng_file_is_one_line_naming_it(tiny_model, saved_checkpoint, tmp_path, damage):
    run, folder = damaged_copy(saved_checkpoint, tmp_path)
    RNG_DAMAGE[damage](folder / "rng_rank_0.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(*fresh(tiny_model), run, step=1)
    message = str(error.value)
    assert message.startswith(f"cannot load checkpoint {folder}: rng_rank_0.safetensors is not an RNG state file: "), message
    assert "\n" not in message


@pytest.mark.parametrize("damage", META_DAMAGE)
def test_a_damaged_trainer_json_is_one_line_naming_it(tiny_model, saved_checkpoint, tmp_path, damage):
    run, folder = damaged_copy(saved_checkpoint, tmp_path)
    change, expected = META_DAMAGE[damage]
    meta = folder / "trainer.json"
    if isinstance(change, bytes):
        meta.write_bytes(change)
    elif isinstance(change, dict):
        meta.write_text(json.dumps(json.loads(meta.read_text()) | change))
    else:
        meta.write_text(json.dumps(change))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(*fresh(tiny_model), run, step=1)
    message = str(error.value)
    assert str(meta) in message and expected in message and "\n" not in message and len(message) < 300, message
