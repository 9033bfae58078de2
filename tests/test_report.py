"""`prime-rl report`: one PNG from hand-written metrics.jsonl files, whatever state they are in.

The PNG's `panels` and `labels` text chunks say what was drawn, so no test reads pixels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from prime_rl.commands.report import main
from prime_rl.observe.report import write_report
from prime_rl.rundir import append_jsonl, metrics_path
from prime_rl.settings import ConfigError

BASE_PANELS = ["reward", "reward vs wall-clock", "mismatch KL", "staleness", "completion length", "time per phase"]
ALL_PANELS = BASE_PANELS[:4] + ["entropy"] + BASE_PANELS[4:]


def write_run(run: Path, steps: int = 4, entropy: bool = False, envs: tuple[str, ...] = ("reverse-text",),
              evals: bool = False) -> Path:
    """A run's metrics.jsonl as the launcher, orchestrator and trainer write it."""
    run.mkdir(parents=True, exist_ok=True)
    path = metrics_path(run)
    append_jsonl(path, {"process": "launcher", "event": "started", "time": 0.0, "wall": 1000.0})
    for step in range(steps):
        wall = 1000.0 + 30 * step
        orch = {"process": "orchestrator", "step": step, "time": 30.0 * step, "wall": wall, "reward/mean": 0.1 * step,
                "staleness/mean": min(step, 1), "staleness/max": min(step, 1), "seq/completion_len_mean": 20 + step,
                "time/generate": 2.0, "time/wait_weights": 0.5, "time/reload": 0.1, "time/step": 2.6}
        orch |= {f"reward/{env}/mean": 0.1 * step + i for i, env in enumerate(envs)}
        trainer = {"process": "trainer", "step": step, "time": 30.0 * step + 1, "wall": wall + 1, "loss/policy": 0.3,
                   "loss/mismatch_kl": 1e-6 * (step + 1), "loss/masked_frac": 0.0, "time/train": 1.0,
                   "time/wait_batch": 1.5, "time/save_weights": 0.2, "time/step": 2.7}
        trainer |= {"loss/entropy": 1.0 - 0.1 * step} if entropy else {}
        append_jsonl(path, orch)
        append_jsonl(path, trainer)
        if evals and step % 2 == 1:
            append_jsonl(path, {"process": "orchestrator", "step": step, "time": 30.0 * step + 2, "wall": wall + 2,
                                "eval/reward/mean": 0.5})
    return run


def chunks(png: Path) -> tuple[list[str], list[str]]:
    """The panel titles and legend labels the PNG says it holds."""
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG")
    with Image.open(png) as image:
        return json.loads(image.text["panels"]), json.loads(image.text["labels"])


def test_one_run_gives_its_report_png(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main([str(run)]) == 0
    png = run / "report.png"
    assert chunks(png) == (BASE_PANELS, ["run"])
    assert capsys.readouterr().out.strip() == f"[prime-rl] report: {png} ({', '.join(BASE_PANELS)})"


def test_runs_with_other_metrics_share_one_png(tmp_path):
    """The entropy panel is drawn because one run logged it; the other simply has no line there."""
    rich = write_run(tmp_path / "rich", entropy=True, envs=("gsm8k", "wordle"), evals=True)
    plain = write_run(tmp_path / "plain", steps=2)
    result = write_report([rich, plain])
    assert result.output == rich / "report-compare.png"
    assert result.panels == ALL_PANELS and result.labels == ["rich", "plain"]
    assert chunks(result.output) == (ALL_PANELS, ["rich", "plain"])


def test_labels_name_the_runs_and_stay_unique(tmp_path):
    first, second = write_run(tmp_path / "a" / "run"), write_run(tmp_path / "b" / "run")
    output = tmp_path / "out" / "cmp.png"
    assert write_report([first, second], output).labels == ["run", "run (2)"]
    main([str(first), str(second), "--output", str(output), "--label", "topk", "--label", "base"])
    assert chunks(output)[1] == ["topk", "base"]
    with pytest.raises(ConfigError, match="1 label"):
        main([str(first), str(second), "--label", "topk"])


def test_damaged_lines_are_notes(tmp_path):
    run = write_run(tmp_path / "run")
    with open(metrics_path(run), "a") as f:
        f.write('not json\n{"process": "orchestrator", "step": 4, "rew')
    result = write_report([run])
    assert chunks(result.output)[0] == BASE_PANELS
    assert result.notes == [f"{run}: 1 malformed line(s) skipped", f"{run}: last line incomplete (ignored)"]


def test_runs_without_rows_are_skipped_with_a_note(tmp_path, capsys):
    good = write_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    launched = tmp_path / "launched"
    launched.mkdir()
    append_jsonl(metrics_path(launched), {"process": "launcher", "event": "started", "time": 0.0, "wall": 1000.0})
    result = write_report([tmp_path / "missing", tmp_path / "empty", good, launched])
    assert result.labels == ["good"] and result.output == good / "report-compare.png"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"prime-rl report: {tmp_path / 'missing'}: no such directory",
        f"prime-rl report: {tmp_path / 'empty'}: no metrics.jsonl (is it a run's output_dir?)",
        f"prime-rl report: {launched}: no step rows in metrics.jsonl (did the run reach its first step?)",
    ]


def test_no_run_to_report_is_a_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="nothing to report") as error:
        main([str(tmp_path / "missing"), str(tmp_path / "empty")])
    assert "\n" not in str(error.value)
    assert not (tmp_path / "empty" / "report-compare.png").exists()


def test_lines_and_values_no_parser_or_axis_can_hold_are_skipped_with_notes(tmp_path):
    """Lines: nested 100k deep (json's RecursionError), step 10**400 (a float overflow once
    drawn), a float step, a non-UTF-8 byte, not an object. Values: NaN, inf, ±1e308 (matplotlib's
    range arithmetic overflows on them), 10**400. The report skips them, says how many, draws the rest."""
    run = write_run(tmp_path / "run", entropy=True)
    lines = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
             b'{"process": "orchestrator", "step": 1' + b"0" * 400 + b', "reward/mean": 1.0}',
             b'{"process": "orchestrator", "step": 1e300, "reward/mean": 1.0}',
             b'{"process": "orchestrator", "step": 9, "reward/mean": 1.0, "x": "\xff"}', b"[]"]
    with open(metrics_path(run), "ab") as f:
        f.write(b"\n".join(lines) + b"\n")
    odd = [float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 10**400]
    for step, value in enumerate(odd, start=4):
        append_jsonl(metrics_path(run), {"process": "orchestrator", "step": step, "wall": value, "reward/mean": value,
                                         "staleness/mean": value, "time/generate": value})
        append_jsonl(metrics_path(run), {"process": "trainer", "step": step, "wall": 1e308, "loss/policy": value,
                                         "loss/mismatch_kl": value, "loss/entropy": value})
    result = write_report([run])
    assert chunks(result.output) == (ALL_PANELS, ["run"])
    assert result.notes == [f"{run}: {len(lines)} malformed line(s) skipped",
                            f"{run}: {len(odd) * 8} value(s) not drawn (NaN, inf, or beyond ±1e300)"]
