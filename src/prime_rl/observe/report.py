"""A run's curves, or several runs' overlaid, as one PNG drawn from `RUN/metrics.jsonl` alone:
what a finished, crashed or running run did, judged without a dashboard or a notebook.

The rows are read with ``prime_rl.observe.status.read_metrics``, so a half-written last line or a
malformed one (not JSON, nested too deeply, a step that is not a whole number) is a note,
never a traceback, and so is a value no axis can hold (NaN, inf, 10**400). A panel is drawn when at least one run has its
data; a run without a metric simply has no line there. The PNG's text chunks `panels` and
`labels` (JSON lists) name what was drawn, so a script can check a report without reading
pixels. matplotlib is imported only to draw: importing this module stays cheap.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.rundir import metrics_path
from prime_rl.settings import ConfigError
from prime_rl.observe.status import ORCHESTRATOR_PHASES, TRAINER_PHASES, environments, read_metrics, step_rows

PHASE_WINDOW = 10  # steps of the time-per-phase panel's running mean

COLORS = tuple(f"C{i}" for i in range(10))
STYLES = (("-", ""), ("--", ""), (":", ""), ("-.", ""), ("-", "."), ("--", "."), (":", "."))  # (line, marker) per series


@dataclass
class Run:
    """One run's rows that panels draw: one row per step (the newest row of a step wins)."""

    label: str
    orch: list[dict]  # orchestrator rows with `reward/mean`
    trainer: list[dict]  # trainer rows with `loss/policy`
    evals: list[dict]  # orchestrator rows with `eval/reward/mean`
    start_wall: float | None  # unix time of the file's first row: the zero of the wall-clock axis


@dataclass
class Line:
    run: str  # the run's label
    name: str  # the series within its panel ("" when the panel has one)
    x: list[float]
    y: list[float]
    points: bool = False  # markers only (eval rewards), not a line


@dataclass
class ReportResult:
    output: Path
    panels: list[str]  # titles, in the order drawn
    labels: list[str]  # the runs drawn, as the legend names them
    notes: list[str] = field(default_factory=list)  # "RUN: why it was skipped / what was ignored"


# --------------------------------------------------------------------------- reading


DRAWABLE = 1e300
"""The largest magnitude drawn: no metric comes near it, and beyond it matplotlib's own axis
arithmetic (a range's width, its margins) overflows and fails the whole PNG."""


def number(value) -> bool:
    """A value a panel can draw: a number (not a bool) within ``DRAWABLE``; NaN, inf and an
    integer beyond any float (``10**400``, compared exactly, never converted) are left out."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return -DRAWABLE <= value <= DRAWABLE  # False for NaN


def read_rows(run_dir: Path, note: Callable[[str], None]) -> list[dict] | None:
    """The run's rows; None (the reason noted) when there is no metrics file to read."""
    path = metrics_path(run_dir)
    if not run_dir.is_dir():
        note("not a directory" if run_dir.exists() else "no such directory")
        return None
    if not path.is_file():
        note("no metrics.jsonl (is it a run's output_dir?)")
        return None
    try:
        metrics = read_metrics(path)
    except OSError as e:
        note(f"cannot read metrics.jsonl: {e.strerror or e}")
        return None
    if metrics.bad_lines:
        note(f"{metrics.bad_lines} malformed line(s) skipped")
    if metrics.partial:
        note("last line incomplete (ignored)")
    numbers = [v for row in metrics.rows for v in row.values() if isinstance(v, int | float) and not isinstance(v, bool)]
    if undrawable := sum(not number(v) for v in numbers):
        note(f"{undrawable} value(s) not drawn (NaN, inf, or beyond ±1e300)")
    return metrics.rows


def load_run(run_dir: Path, label: str, note: Callable[[str], None]) -> Run | None:
    """The run's step rows; None (the reason noted) when it has none to draw."""
    rows = read_rows(run_dir, note)
    if rows is None:
        return None
    orch, trainer = step_rows(rows, "orchestrator", "reward/mean"), step_rows(rows, "trainer", "loss/policy")
    if not orch and not trainer:
        note("no step rows in metrics.jsonl (did the run reach its first step?)")
        return None
    walls = [r["wall"] for r in rows if number(r.get("wall"))]
    return Run(label, orch, trainer, step_rows(rows, "orchestrator", "eval/reward/mean"), walls[0] if walls else None)


def unique(labels: list[str]) -> list[str]:
    """The labels, a repeated one numbered ("run (2)"), so each legend entry names one run."""
    out: list[str] = []
    for label in labels:
        new, n = label, 1
        while new in out:
            n += 1
            new = f"{label} ({n})"
        out.append(new)
    return out


# --------------------------------------------------------------------------- the panels' series


def series(run: Run, name: str, rows: list[dict], key: str, x: Callable[[dict], float | None] = lambda r: r["step"],
           points: bool = False) -> list[Line]:
    """The rows' numbers under `key` against `x`, as one line; none when no row has one."""
    pairs = [(x(r), r[key]) for r in rows if number(r.get(key)) and x(r) is not None]
    return [Line(run.label, name, [p[0] for p in pairs], [p[1] for p in pairs], points)] if pairs else []


def reward_lines(run: Run) -> list[Line]:
    """The mean reward, each environment's when there are several, and eval rewards as points."""
    envs = environments(run.orch)
    lines = series(run, "mean", run.orch, "reward/mean")
    for env in envs if len(envs) > 1 else ():
        lines += series(run, env, run.orch, f"reward/{env}/mean")
    return lines + series(run, "eval", run.evals, "eval/reward/mean", points=True)


def wall_lines(run: Run) -> list[Line]:
    """The reward against minutes since the run's first row: which run learns faster in time."""
    def minutes(row: dict) -> float | None:
        return (row["wall"] - run.start_wall) / 60 if run.start_wall is not None and number(row.get("wall")) else None

    return series(run, "mean", run.orch, "reward/mean", x=minutes)


def staleness_lines(run: Run) -> list[Line]:
    return series(run, "mean", run.orch, "staleness/mean") + series(run, "max", run.orch, "staleness/max")


def phase_lines(run: Run) -> list[Line]:
    """Seconds per step of each phase: where a step's time goes, on either side of the weights
    (a running mean over ``PHASE_WINDOW`` steps: one step's are too noisy to read), from step 1
    on: step 0's waits hold the start-up."""
    orch = [line for name, key in ORCHESTRATOR_PHASES for line in series(run, name, run.orch, key)]
    lines = orch + [line for name, key in TRAINER_PHASES for line in series(run, name, run.trainer, key)]
    for line in lines:
        if len(line.x) > 1 and line.x[0] == 0:
            line.x, line.y = line.x[1:], line.y[1:]
        line.y = running_mean(line.y, PHASE_WINDOW)
    return lines


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to ``window - 1`` before it."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


@dataclass(frozen=True)
class Panel:
    title: str
    lines: Callable[[Run], list[Line]]
    xlabel: str = "step"
    ylabel: str = ""
    log_if_positive: bool = False  # a log y-scale, when every value is above 0


PANELS = (
    Panel("reward", reward_lines, ylabel="reward"),
    Panel("reward vs wall-clock", wall_lines, xlabel="minutes", ylabel="reward"),
    Panel("mismatch KL", lambda run: series(run, "", run.trainer, "loss/mismatch_kl"), log_if_positive=True),
    Panel("staleness", staleness_lines, ylabel="steps"),
    Panel("entropy", lambda run: series(run, "", run.trainer, "loss/entropy")),
    Panel("completion length", lambda run: series(run, "", run.orch, "seq/completion_len_mean"), ylabel="tokens"),
    Panel("time per phase", phase_lines, ylabel="seconds per step (10-step mean)"),
)


# --------------------------------------------------------------------------- drawing


def style(k: int, points: bool) -> dict:
    """The k-th series' look: lines tell series apart when colors tell runs apart."""
    if points:
        return {"linestyle": "none", "marker": "o", "markersize": 4}
    line, marker = STYLES[k % len(STYLES)]
    return {"linestyle": line, "marker": marker, "markersize": 3}


def draw_panel(ax, panel: Panel, lines: list[Line], labels: list[str]) -> None:
    """One color per run with several runs, else one per series; a legend when series are several."""
    from matplotlib.lines import Line2D

    kinds = {line.name: line.points for line in lines}  # series name -> drawn as points
    names, several = list(kinds), len(labels) > 1
    for line in lines:
        k = names.index(line.name)
        color = COLORS[labels.index(line.run) % len(COLORS)] if several else COLORS[k % len(COLORS)]
        ax.plot(line.x, line.y, color=color, **style(k, line.points or len(line.x) == 1))
    ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
    if panel.log_if_positive and all(v > 0 for line in lines for v in line.y):
        ax.set_yscale("log")
    if len(names) > 1:
        handles = [Line2D([], [], color="gray" if several else COLORS[k % len(COLORS)], **style(k, kinds[name]))
                   for k, name in enumerate(names)]
        ax.legend(handles, names, fontsize="small")


def save_png(drawn: list[tuple[Panel, list[Line]]], labels: list[str], output: Path) -> None:
    """The panels as a grid, with the runs' legend on top, saved with `panels`/`labels` text chunks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cols = min(3, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    figure, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows + 0.6), squeeze=False, layout="constrained")
    try:
        for ax, (panel, lines) in zip(axes.flat, drawn):
            draw_panel(ax, panel, lines, labels)
        for ax in axes.flat[len(drawn):]:
            ax.remove()
        if len(labels) > 1:
            handles = [Line2D([], [], color=COLORS[i % len(COLORS)]) for i in range(len(labels))]
            figure.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), 4))
        else:
            figure.suptitle(labels[0])
        metadata = {"panels": json.dumps([panel.title for panel, _ in drawn]), "labels": json.dumps(labels)}
        output.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(output, format="png", dpi=100, metadata=metadata)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {output}: {e.strerror or e}") from None
    finally:
        plt.close(figure)


# --------------------------------------------------------------------------- the report


def write_report(runs: list[Path], output: Path | None = None, labels: list[str] | None = None) -> ReportResult:
    """One PNG of the runs that have step rows; the others are skipped with a note on stderr.
    Default output: `RUN/report.png` for one run, `<first RUN>/report-compare.png` for several."""
    if labels is not None and len(labels) != len(runs):
        raise ConfigError(f"{len(labels)} label(s) for {len(runs)} run(s): give one --label per run, in the runs' order")
    notes: list[str] = []

    def noter(run_dir: Path) -> Callable[[str], None]:
        def note(message: str) -> None:
            notes.append(f"{run_dir}: {message}")
            print(f"prime-rl report: {run_dir}: {message}", file=sys.stderr)
        return note

    names = labels or [Path(d).resolve().name or str(d) for d in runs]
    loaded = [(Path(d), load_run(Path(d), name, noter(d))) for d, name in zip(runs, names)]
    usable = [(d, run) for d, run in loaded if run is not None]
    for (_, run), label in zip(usable, unique([run.label for _, run in usable])):
        run.label = label
    drawn = [(panel, lines) for panel in PANELS if (lines := [line for _, run in usable for line in panel.lines(run)])]
    if not drawn:
        raise ConfigError(f"nothing to report: no step rows in the metrics.jsonl of {', '.join(map(str, runs))}")
    output = Path(output) if output else usable[0][0] / ("report.png" if len(runs) == 1 else "report-compare.png")
    save_png(drawn, [run.label for _, run in usable], output)
    return ReportResult(output, [panel.title for panel, _ in drawn], [run.label for _, run in usable], notes)
