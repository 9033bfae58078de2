"""`prime-rl --clean` deletes only a run's own state, and only once every check passed; output
directories that cannot hold a run (a file, /proc, `/`, the home folder, the project root)
are refused in one line before anything is written."""

import json
import os
import socket
from pathlib import Path

import pytest

from helpers import REPO, crashed_run, free_port_pair
from prime_rl.cli import main
from prime_rl.rundir import RUN_MARKER, write_run_marker

STATE = ("logs", "weights", "wandb", "traces", "metrics.jsonl")


def write_config(tmp_path: Path, tiny_model: Path, run: Path) -> Path:
    config = tmp_path / "rl.toml"
    config.write_text(
        f'model = "{tiny_model}"\noutput_dir = "{run}"\nmax_steps = 10\n[ckpt]\ninterval = 2\n'
        f"[transport]\nport = {free_port_pair()}\n[inference]\nport = {free_port_pair()}\n"
    )
    return config


def someone_elses_folder(folder: Path) -> None:
    """A folder that merely looks like a run: what a user keeps there, under a run's names."""
    for name in ("logs", "weights", "wandb", "traces"):
        (folder / name).mkdir(parents=True)
        (folder / name / "precious.txt").write_text("keep me")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')


def state_left(folder: Path) -> list[str]:
    return [name for name in STATE if (folder / name).exists()]


@pytest.fixture
def launches(monkeypatch):
    """Replaces the launcher: records each launch (and what the run dir held then) instead."""
    seen = []

    def fake_run(run_dir, specs, *args, **kwargs):
        seen.append(state_left(Path(run_dir)))
        return 0

    monkeypatch.setattr("prime_rl.commands.rl.run", fake_run)
    return seen


def cli(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    return exit_info.value.code, capsys.readouterr().err.strip()


def test_clean_refuses_a_folder_no_run_marked_and_deletes_nothing(tmp_path, tiny_model, capsys, launches):
    run = tmp_path / "run"
    someone_elses_folder(run)
    code, err = cli(capsys, write_config(tmp_path, tiny_model, run), "--no-tmux", "--clean")
    assert code == 2
    assert f"was not made by a prime-rl run (no {RUN_MARKER} marker)" in err, err
    assert "before prime-rl wrote that marker" in err and "--resume" in err, "an old run is told what to do"
    assert len(err.splitlines()) == 1, err
    assert state_left(run) == list(STATE), "nothing deleted"
    assert (run / "logs" / "precious.txt").read_text() == "keep me"
    assert launches == []


@pytest.mark.parametrize("failing", ["placement", "port", "slurm section"])
def test_a_check_failing_after_the_run_dir_check_deletes_nothing(tmp_path, tiny_model, capsys, launches, monkeypatch, failing):
    run = tmp_path / "run"
    someone_elses_folder(run)
    write_run_marker(run)
    config = write_config(tmp_path, tiny_model, run)
    flags = []
    if failing == "placement":  # one GPU visible, five asked for
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        flags = ["--deployment.inference-gpus", "4"]
    if failing == "slurm section":
        flags = ["--slurm"]
    with socket.socket() as held:
        if failing == "port":
            port = int(config.read_text().split("[inference]\nport = ")[1].split()[0])
            held.bind(("127.0.0.1", port))
            held.listen()
        code, err = cli(capsys, config, "--no-tmux", "--clean", *flags)
    assert code == 2, err
    expected = {"placement": "deployment: needs 5 GPUs", "port": f"port {port if failing == 'port' else ''}",
                "slurm section": "the config has no [slurm] section"}[failing]
    assert expected in err, err
    assert state_left(run) == list(STATE), "nothing deleted before every check passed"
    assert launches == []


def test_clean_empties_a_marked_run_just_before_launch_and_marks_the_new_one(tmp_path, tiny_model, capsys, launches):
    run = tmp_path / "run"
    someone_elses_folder(run)
    write_run_marker(run)
    config = write_config(tmp_path, tiny_model, run)

    code, err = cli(capsys, config, "--no-tmux", "--clean", "--dry-run")
    assert code == 0, err
    assert state_left(run) == list(STATE), "a dry run deletes nothing"

    code, err = cli(capsys, config, "--no-tmux", "--clean")
    assert code == 0, err
    assert launches == [[]], "launched once, after the old state was gone"
    assert state_left(run) == []
    marker = json.loads((run / RUN_MARKER).read_text())
    assert marker["kind"] == "rl" and marker["pid"] == os.getpid() and marker["hostname"] == socket.gethostname()
    assert marker["created"]


def test_a_fresh_run_is_marked_and_can_be_cleaned_later(tmp_path, tiny_model, capsys, launches):
    run = tmp_path / "run"
    config = write_config(tmp_path, tiny_model, run)
    assert cli(capsys, config, "--no-tmux", "--dry-run")[0] == 0
    assert not (run / RUN_MARKER).exists(), "a dry run starts no run"
    assert cli(capsys, config, "--no-tmux")[0] == 0
    assert (run / RUN_MARKER).is_file()
    (run / "logs").mkdir()  # what the run left
    assert cli(capsys, config, "--no-tmux", "--clean")[0] == 0
    assert state_left(run) == [] and len(launches) == 2


def test_resume_of_a_run_made_before_the_marker_still_works_and_marks_it(tmp_path, tiny_model, capsys, launches):
    run = tmp_path / "run"
    crashed_run(run)
    config = write_config(tmp_path, tiny_model, run)
    code, err = cli(capsys, config, "--no-tmux", "--resume", "--dry-run")
    assert code == 0, err
    assert not (run / RUN_MARKER).exists(), "a dry run changes nothing"
    code, err = cli(capsys, config, "--no-tmux", "--resume")
    assert code == 0, err
    assert len(launches) == 1
    assert (run / RUN_MARKER).is_file(), "its complete checkpoint shows a prime-rl run made it: now it is marked"
    assert not (run / "weights" / "step_5").exists(), "rewound to checkpoint 4"


def refused_dirs(tmp_path: Path) -> list[tuple[str, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    return [
        ("/", "is the filesystem root"),
        (str(Path.home()), "is the home folder"),
        (str(REPO), "is the project root"),
        *([(str(REPO.parent), "is a folder above the project root")] if REPO.parent != Path.home() else []),
        ("/proc/prime-rl-run", "is under /proc"),
        ("/sys/prime-rl-run", "is under /sys"),
        ("/dev/prime-rl-run", "is under /dev"),
        (str(a_file), "is a file; expected a folder"),
        (str(a_file / "run"), "which is a file; expected a folder"),
    ]


def test_output_dirs_that_cannot_hold_a_run_are_refused_in_one_line(tmp_path, tiny_model, capsys, launches, monkeypatch):
    def must_not_write(*args, **kwargs):
        raise AssertionError("configs written into a refused output_dir")

    # Dry runs only, and no config written: were the refusal ever lost, this test must not
    # be what empties or litters `/`, the home folder or the checkout.
    monkeypatch.setattr("prime_rl.commands.rl.process_specs", must_not_write)
    config = write_config(tmp_path, tiny_model, tmp_path / "run")
    for output_dir, expected in refused_dirs(tmp_path):
        for flags in (["--dry-run"], ["--dry-run", "--clean"]):
            code, err = cli(capsys, config, "--no-tmux", "--output-dir", output_dir, *flags)
            assert code == 2, (output_dir, err)
            assert err.startswith("prime-rl: trainer.output_dir (--output-dir): ") and expected in err, (output_dir, err)
            assert len(err.splitlines()) == 1, err
    assert launches == []


def test_sft_eval_and_gepa_refuse_a_file_or_proc_as_output_dir(tmp_path, tiny_model, capsys, launches):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    sft_config = tmp_path / "sft.toml"
    sft_config.write_text(f'[model]\nname = "{tiny_model}"\n[data]\npath = "{data}"\n')
    local = ["-m", tiny_model, "--endpoints-path", tmp_path / "none.toml"]
    commands = {
        "sft": ["sft", sft_config],
        "eval": ["eval", "reverse-text", *local],
        "gepa": ["gepa", "reverse-text", *local],
    }
    for name, argv in commands.items():
        for output_dir, expected in ((a_file, "is a file; expected a folder"), ("/proc/prime-rl", "is under /proc")):
            code, err = cli(capsys, *argv, "--output-dir", output_dir)
            assert code == 2, (name, err)
            assert err.startswith("prime-rl: output_dir (--output-dir): ") and expected in err, (name, err)
            assert len(err.splitlines()) == 1, (name, err)
    assert launches == []


def fifo(path: Path) -> None:
    os.mkfifo(path)


def bad_markers(tmp_path: Path) -> dict[str, tuple]:
    """Markers `--clean` must not trust: (how to make it at PATH, what the refusal says)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    write_run_marker(elsewhere)  # a real marker, reached through a link
    return {
        "empty": (lambda p: p.write_text(""), "has an empty .prime-rl-run marker"),
        "blank lines": (lambda p: p.write_text("\n \n"), "has an empty .prime-rl-run marker"),
        "text": (lambda p: p.write_text("mine"), "whose content is not a prime-rl run's"),
        "empty object": (lambda p: p.write_text("{}"), "whose content is not a prime-rl run's"),
        "other format": (lambda p: p.write_text('{"format": "x", "kind": "rl", "run_id": "1"}'), "content is not"),
        "format, no run id": (lambda p: p.write_text('{"format": "prime-rl-run", "kind": "rl"}'), "content is not"),
        "old form, pid missing": (lambda p: p.write_text('{"kind": "rl", "created": "x", "hostname": "h"}'), "content is not"),
        "a list": (lambda p: p.write_text('[{"kind": "rl"}]'), "whose content is not a prime-rl run's"),
        "binary": (lambda p: p.write_bytes(b"\xff\xfe{"), "whose content is not a prime-rl run's"),
        "huge": (lambda p: p.write_text('{"kind": "rl", "pad": "' + "x" * 10_000 + '"}'), "content is not"),
        "link to a real marker": (lambda p: p.symlink_to(elsewhere / RUN_MARKER), "has a link as its .prime-rl-run marker"),
        "dangling link": (lambda p: p.symlink_to(tmp_path / "nowhere"), "has a link as its .prime-rl-run marker"),
        "folder": (lambda p: p.mkdir(), "that is not a regular file"),
        "fifo": (fifo, "that is not a regular file"),
    }


def test_clean_refuses_a_marker_no_run_wrote_and_deletes_nothing(tmp_path, tiny_model, capsys, launches):
    for name, (make, expected) in bad_markers(tmp_path).items():
        run = tmp_path / f"run-{name.replace(' ', '-')}"
        someone_elses_folder(run)
        make(run / RUN_MARKER)
        code, err = cli(capsys, write_config(tmp_path, tiny_model, run), "--no-tmux", "--clean")
        assert code == 2, (name, err)
        assert err.startswith(f"prime-rl: --clean: output_dir {str(run)!r} ") and expected in err, (name, err)
        assert "delete them yourself" in err and len(err.splitlines()) == 1, (name, err)
        assert state_left(run) == list(STATE), f"{name}: nothing deleted"
        assert (run / "logs" / "precious.txt").read_text() == "keep me"
    assert launches == []
    assert (tmp_path / "elsewhere" / RUN_MARKER).is_file(), "a marker behind a link is left alone"


def test_clean_trusts_the_marker_of_a_run_from_before_the_format_tag(tmp_path, tiny_model, capsys, launches):
    """Markers the first marking version wrote (kind, created, hostname, pid; no format, no run id)."""
    run = tmp_path / "run"
    someone_elses_folder(run)
    (run / RUN_MARKER).write_text('{"kind": "rl", "created": "2026-11-30T10:00:00+0000", "hostname": "h", "pid": 7}\n')
    code, err = cli(capsys, write_config(tmp_path, tiny_model, run), "--no-tmux", "--clean")
    assert code == 0, err
    assert state_left(run) == [] and launches == [[]]
    marker = json.loads((run / RUN_MARKER).read_text())
    assert marker["format"] == "prime-rl-run" and len(marker["run_id"]) == 32, "rewritten in today's form"


def test_the_marker_is_never_written_through_a_link(tmp_path, tiny_model, capsys, launches):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's")
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_MARKER).symlink_to(outside)
    (run / f"{RUN_MARKER}.tmp").symlink_to(tmp_path / "outside-tmp.txt")  # where the atomic write starts
    code, err = cli(capsys, write_config(tmp_path, tiny_model, run), "--no-tmux")
    assert code == 0, err
    assert outside.read_text() == "not the run's" and not (tmp_path / "outside-tmp.txt").exists()
    marker = run / RUN_MARKER
    assert not marker.is_symlink() and json.loads(marker.read_text())["format"] == "prime-rl-run"


def test_clean_removes_a_link_in_the_run_never_what_it_points_at(tmp_path, tiny_model, capsys, launches):
    kept = tmp_path / "shared-logs"
    kept.mkdir()
    (kept / "other-run.log").write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    write_run_marker(run)
    (run / "logs").symlink_to(kept, target_is_directory=True)
    (run / "metrics.jsonl").symlink_to(tmp_path / "shared-metrics.jsonl")
    (tmp_path / "shared-metrics.jsonl").write_text('{"step": 0}\n')
    code, err = cli(capsys, write_config(tmp_path, tiny_model, run), "--no-tmux", "--clean")
    assert code == 0, err
    assert not (run / "logs").exists() and not (run / "metrics.jsonl").is_symlink()
    assert (kept / "other-run.log").read_text() == "keep me"
    assert (tmp_path / "shared-metrics.jsonl").read_text() == '{"step": 0}\n'


def test_clean_checks_the_marker_again_just_before_it_deletes(tmp_path, tiny_model, capsys, monkeypatch):
    """The marker is read when the checks run and again right before the deletion: a marker
    that became empty meanwhile (another process, a user) stops it."""
    run = tmp_path / "run"
    someone_elses_folder(run)
    write_run_marker(run)

    def port_check_that_takes_a_while(*args, **kwargs):
        (run / RUN_MARKER).write_text("")

    monkeypatch.setattr("prime_rl.commands.rl.check_ports", port_check_that_takes_a_while)
    monkeypatch.setattr("prime_rl.commands.rl.run", lambda *a, **k: pytest.fail("launched"))
    code, err = cli(capsys, write_config(tmp_path, tiny_model, run), "--no-tmux", "--clean")
    assert code == 2 and "has an empty .prime-rl-run marker" in err, err
    assert state_left(run) == list(STATE)
