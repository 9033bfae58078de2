"""`prime-rl --resume`: choosing the checkpoint, refusing what cannot be resumed, rewinding."""

import json

import pytest

from helpers import crashed_run
from prime_rl.cli import main
from prime_rl.resume import rewind
from prime_rl.rundir import (
    MARKER,
    checkpoints_dir,
    complete_steps,
    config_path,
    metrics_path,
    read_jsonl,
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
