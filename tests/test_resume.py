"""`prime-rl --resume`: choosing the checkpoint, refusing what cannot be resumed, rewinding."""

import json

import pytest

from helpers import crashed_run
from prime_rl.cli import main
from prime_rl.launch.resume import ResumeRefused, check_resumable, rewind
from prime_rl.rundir import (
    MARKER,
    checkpoint_step_dir,
    checkpoints_dir,
    complete_steps,
    config_path,
    metrics_path,
    read_jsonl,
    remove_step_dir,
    rollouts_dir,
    rollouts_step_dir,
    weights_dir,
    weights_step_dir,
)


def test_rewind_undoes_everything_after_the_checkpoint(tmp_path):
    crashed_run(tmp_path)
    removed = rewind(tmp_path, 4)
    assert complete_steps(weights_dir(tmp_path)) == [1, 2, 3, 4]
    assert sorted(p.name for p in weights_dir(tmp_path).iterdir()) == [f"step_{s}" for s in (1, 2, 3, 4)]
    assert sorted(p.name for p in checkpoints_dir(tmp_path).iterdir()) == ["step_2", "step_4"]
    assert [(r["process"], r["step"]) for r in read_jsonl(metrics_path(tmp_path))] == [
        (p, s) for s in range(4) for p in ("orchestrator", "trainer")
    ]
    assert "weights/step_7 (incomplete)" in removed and "checkpoints/step_6 (incomplete)" in removed
    assert "4 metrics rows of steps >= 4" in removed
    # rollouts are the orchestrator's to sort out (it re-sends some of them)
    assert rollouts_step_dir(tmp_path, 5).is_dir()


def test_rewind_survives_a_row_cut_mid_write_by_the_crash(tmp_path):
    """A process killed while appending leaves half a row: the rewind drops it (it crashed
    with a JSONDecodeError before), and the launcher's rows without a step stay."""
    crashed_run(tmp_path)
    with open(metrics_path(tmp_path), "a") as f:
        f.write('{"process": "launcher", "event": "failed", "failed": "trainer"}\n{"process": "trainer", "st')
    removed = rewind(tmp_path, 4)
    assert "5 metrics rows of steps >= 4" in removed
    rows = read_jsonl(metrics_path(tmp_path))
    assert [(r["process"], r.get("step")) for r in rows][-2:] == [("trainer", 3), ("launcher", None)]


def write_config(tmp_path, tiny_model, max_steps=10):
    run = tmp_path / "run"
    config = tmp_path / "rl.toml"
    config.write_text(f'model = "{tiny_model}"\noutput_dir = "{run}"\nmax_steps = {max_steps}\n[ckpt]\ninterval = 2\n')
    return run, config


def resume_dry_run(config, capsys, *flags):
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--dry-run", *flags])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err.strip()


def test_resume_points_every_process_at_the_newest_complete_checkpoint(tmp_path, tiny_model, capsys):
    run, config = write_config(tmp_path, tiny_model)
    crashed_run(run)
    code, out, err = resume_dry_run(config, capsys, "--resume")
    assert code == 0, err
    assert f"resuming {run} from checkpoint step 4" in out
    trainer, orchestrator, inference = (json.loads(config_path(run, p).read_text()) for p in ("trainer", "orchestrator", "inference"))
    assert trainer["ckpt"]["resume_step"] == orchestrator["ckpt"]["resume_step"] == 4
    assert inference["model"] == str(weights_step_dir(run, 4))  # inference starts on the checkpoint's weights
    assert inference["served_model_name"] == orchestrator["model"] == str(tiny_model)
    assert complete_steps(weights_dir(run)) == list(range(1, 7)), "a dry run changes nothing"

    code, out, err = resume_dry_run(config, capsys, "--resume-step", "2")
    assert code == 0, err
    assert json.loads(config_path(run, "trainer").read_text())["ckpt"]["resume_step"] == 2


@pytest.mark.parametrize(
    "flags, damage, expected",
    [
        (["--resume-step", "6"], None, "checkpoints/step_6 is not a complete checkpoint; complete ones: 2, 4"),
        (["--resume-step=3"], None, "checkpoints/step_3 is not a complete checkpoint; complete ones: 2, 4"),
        (["--resume"], "weights", "resume from step 4: {run}/weights/step_4 (with its STABLE marker) is missing"),
        (["--resume"], "rollouts", "resume from step 4: no orchestrator progress (step_3 or step_4"),
        (["--resume", "--max-steps", "4"], None, "checkpoint step 4 is already the end of the run (max_steps = 4)"),
        (["--resume-step", "2"], "metrics", "--resume: {run}/metrics.jsonl line 13 is not a metrics row: not UTF-8 text;"),
    ],
)
def test_what_cannot_be_resumed_is_refused_in_one_line(tmp_path, tiny_model, capsys, flags, damage, expected):
    run, config = write_config(tmp_path, tiny_model)
    crashed_run(run)
    if damage == "weights":
        (weights_step_dir(run, 4) / MARKER).unlink()
    if damage == "rollouts":
        for step in (3, 4):
            (rollouts_step_dir(run, step) / MARKER).unlink()
    if damage == "metrics":
        with open(metrics_path(run), "ab") as f:
            f.write(b'{"process": "trainer", "step": 6, "x": "\xff"}\n')
    code, _, err = resume_dry_run(config, capsys, *flags)
    assert code == 2
    assert expected.replace("{run}", str(run)) in err, err
    assert len(err.splitlines()) == 1, err
    assert complete_steps(checkpoints_dir(run)) == [2, 4]


def test_a_fresh_run_in_a_used_directory_suggests_resume(tmp_path, tiny_model, capsys):
    run, config = write_config(tmp_path, tiny_model)
    crashed_run(run)
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--no-tmux"])
    assert exit_info.value.code == 2
    assert "pass --resume to continue it, --clean to start over" in capsys.readouterr().err


# --------------------------------------------------------------------------- damaged metrics, links out of the run

DAMAGED_LINES = {
    "step-string": b'{"process": "trainer", "step": "3"}',
    "step-float": b'{"process": "trainer", "step": 3.0}',
    "step-bool": b'{"process": "trainer", "step": true}',
    "step-huge": b'{"process": "trainer", "step": 1' + b"0" * 400 + b"}",
    "step-nan": b'{"process": "trainer", "step": NaN}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "deep-object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "not-utf8": b'{"process": "trainer", "step": 2, "note": "\xff\xfe"}',
    "array": b"[1, 2]",
    "garbage": b"not json",
}


def snapshot(run):
    """Every path under ``run`` (links as links), and the metrics file's bytes."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*")), metrics_path(run).read_bytes()


@pytest.mark.parametrize("damage", DAMAGED_LINES)
@pytest.mark.parametrize("where", ["middle", "before-the-last-row"])
def test_a_damaged_metrics_line_refuses_the_rewind_before_anything_is_deleted(tmp_path, damage, where):
    crashed_run(tmp_path)
    lines = metrics_path(tmp_path).read_bytes().splitlines()
    at = 5 if where == "middle" else len(lines) - 1
    lines.insert(at, DAMAGED_LINES[damage])
    metrics_path(tmp_path).write_bytes(b"\n".join(lines) + b"\n")
    before = snapshot(tmp_path)
    with pytest.raises(ResumeRefused) as refusal:
        rewind(tmp_path, 4)
    message = str(refusal.value)
    assert message.startswith(f"--resume: {metrics_path(tmp_path)} line {at + 1} is not a metrics row: "), message
    assert message.endswith("fix or delete that line, then resume again") and "\n" not in message and len(message) < 300
    assert snapshot(tmp_path) == before, "nothing was deleted or rewritten"
    with pytest.raises(ResumeRefused, match=f"line {at + 1} is not a metrics row"):
        check_resumable(tmp_path, 4, max_steps=10)  # what the CLI checks before the rewind


@pytest.mark.parametrize("torn", [b'{"process": "trainer", "st', b"[" * 100_000, b'{"step": 5, "x": "\xff', b'{"step": 1.5}'])
def test_a_torn_last_line_is_dropped_whatever_it_holds(tmp_path, torn):
    """A crash mid-write leaves a last line without its newline: the rewind drops it, as before."""
    crashed_run(tmp_path)
    with open(metrics_path(tmp_path), "ab") as f:
        f.write(torn)
    check_resumable(tmp_path, 4, max_steps=10)
    assert "5 metrics rows of steps >= 4" in rewind(tmp_path, 4)
    assert metrics_path(tmp_path).read_bytes().endswith(b'"step":3}\n')


def test_the_rewind_never_deletes_through_a_link_out_of_the_run(tmp_path):
    """A `step_N` (or `step_N.tmp`) that links outside the run directory goes as a link; what
    it points at, its STABLE marker included, stays."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    crashed_run(run)
    for name in ("weights", "checkpoints", "elsewhere", "twin"):
        (outside / name).mkdir(parents=True)
        (outside / name / MARKER).write_text("7\n")
        (outside / name / "model.safetensors").write_text("precious")
    (outside / "file").write_text("precious")
    weights_step_dir(run, 7).symlink_to(outside / "weights")  # a complete-looking later step
    (weights_dir(run) / "step_8.tmp").symlink_to(outside / "elsewhere")
    (weights_dir(run) / "step_3.tmp").symlink_to(outside / "twin")  # beside a kept step
    checkpoint_step_dir(run, 9).symlink_to(outside / "checkpoints")
    (checkpoints_dir(run) / "step_10").symlink_to(outside / "file")
    (checkpoints_dir(run) / "step_11").symlink_to(outside / "missing")  # dangling
    outside_before = sorted((str(p), p.read_text()) for p in outside.rglob("*") if p.is_file())

    removed = rewind(run, 4)

    assert sorted((str(p), p.read_text()) for p in outside.rglob("*") if p.is_file()) == outside_before
    assert sorted(p.name for p in weights_dir(run).iterdir()) == [f"step_{s}" for s in (1, 2, 3, 4)]
    assert sorted(p.name for p in checkpoints_dir(run).iterdir()) == ["step_2", "step_4"]
    assert {"weights/step_7", "weights/step_8 (incomplete)", "weights/step_3.tmp", "checkpoints/step_9"} <= set(removed), removed


def test_removing_a_rollout_record_that_is_a_link_leaves_its_target(tmp_path):
    """The orchestrator's resume and pruning remove records with the same function."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / MARKER).write_text("1\n")
    rollouts_dir(tmp_path).mkdir()
    rollouts_step_dir(tmp_path, 9).symlink_to(outside)
    (rollouts_dir(tmp_path) / "step_9.tmp").symlink_to(outside)
    remove_step_dir(rollouts_dir(tmp_path), 9)
    assert list(rollouts_dir(tmp_path).iterdir()) == [] and (outside / MARKER).read_text() == "1\n"
