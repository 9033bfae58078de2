"""What a run is doing, from `RUN/metrics.jsonl` alone (no socket into the processes):

- ``read_metrics`` / ``MetricsFollower``: the rows, read whole or as they are appended, where
  a half-written last line waits for its end and a malformed line (``prime_rl.rundir.parse_row``:
  not JSON, nested too deeply, a step that is not a whole number) is counted, never raised;
- ``summarize`` + ``render``: the status the tmux session's `status` pane redraws
  (`python -m prime_rl.observe.status RUN --follow`) and a headless run prints every
  `status.every_steps` steps: step / max_steps and ETA, the reward (per environment when
  several) as a sparkline with its 10-step mean, mismatch KL, staleness, masked fraction,
  tokens/s, where a step's time goes, and any process that failed;
- ``record_event``: the launcher's own rows (`"process": "launcher"`: the run started,
  finished, or a process failed), so the file tells how the run ended.

A view never takes the run down: values that are not finite numbers (NaN, inf, a string where
a number belongs) are left out of what is drawn, and a view that fails anyway says so in one
line and stops (the headless printer) or keeps redrawing (the pane).

Imports neither torch nor vLLM, nor anything that draws: it runs beside the trio.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from prime_rl.rundir import BadRow, append_jsonl, is_step, metrics_path, parse_row

if TYPE_CHECKING:
    from prime_rl.config import RLConfig

MEAN_WINDOW = 10  # steps of the reward's running mean
CHECK_S = 0.25  # how often the pane looks for new rows (it reads only the bytes appended since)
ORCHESTRATOR_PHASES = (("generate", "time/generate"), ("wait weights", "time/wait_weights"), ("reload", "time/reload"))
TRAINER_PHASES = (("train", "time/train"), ("wait batch", "time/wait_batch"), ("save weights", "time/save_weights"))
SPARK = "▁▂▃▄▅▆▇█"


# --------------------------------------------------------------------------- reading


@dataclass
class Metrics:
    rows: list[dict] = field(default_factory=list)
    bad_lines: int = 0  # lines that are not a JSON object (skipped)
    partial: bool = False  # the last line has no end yet (a row being written, or a crash mid-write)


def read_metrics(path: Path) -> Metrics:
    """Every complete row of a metrics file; a missing file is an empty one."""
    follower = MetricsFollower(path)
    follower.poll()
    return follower.metrics


class MetricsFollower:
    """Reads the rows appended since the last ``poll``; starts over when the file was rewritten
    (a resumed run drops the rows of the steps it repeats)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics = Metrics()
        self._offset = 0
        self._pending = b""
        self._inode: int | None = None

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:
                    self.metrics, self._offset, self._pending, self._inode = Metrics(), 0, b"", stat.st_ino
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._pending = (self._pending + data).split(b"\n")
        new = []
        for line in lines:
            if not line.strip():
                continue
            try:
                new.append(parse_row(line))
            except BadRow:
                self.metrics.bad_lines += 1
        self.metrics.rows.extend(new)
        self.metrics.partial = bool(self._pending.strip())
        return new


def one_line(error: BaseException) -> str:
    """An error's message on one line (``prime_rl.settings.one_line``, whose pydantic import
    this module, run as the tmux pane, avoids)."""
    return " ".join(str(error).split()) or type(error).__name__


def record_event(run_dir: Path, event: str, started_unix: float, **fields) -> None:
    """One launcher row (`started`, `finished`, `failed`, `stalled`, `interrupted`, `out_of_memory`); never
    raises: the run's outcome does not depend on it."""
    now = time.time()
    row = {"process": "launcher", "event": event, "time": round(now - started_unix, 3), "wall": round(now, 3), **fields}
    try:
        append_jsonl(metrics_path(run_dir), row)
    except OSError:
        pass


# --------------------------------------------------------------------------- the summary


@dataclass
class Status:
    step: int | None = None  # the newest step the orchestrator logged
    trained: int | None = None  # the newest step the trainer logged
    max_steps: int | None = None
    eta_s: float | None = None
    rewards: dict[str, list[float]] = field(default_factory=dict)  # "all", or per environment
    eval_reward: float | None = None
    mismatch_kl: float | None = None
    staleness: tuple[float, float] | None = None  # (mean, max) of the newest step
    masked_frac: float | None = None
    sampled_tokens_s: float | None = None
    trained_tokens_s: float | None = None
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # process -> phase -> seconds per step (recent mean)
    failed: list[str] = field(default_factory=list)  # "trainer: exited with code 1"
    ended: str | None = None  # "finished", "failed", ... once the launcher said so
    notes: list[str] = field(default_factory=list)


def last_run(rows: list[dict]) -> list[dict]:
    """The rows since the launcher's last `started` (a resumed run keeps its earlier rows but
    not its earlier endings); all rows when the launcher wrote none."""
    starts = [i for i, r in enumerate(rows) if r.get("process") == "launcher" and r.get("event") == "started"]
    if not starts:
        return rows
    begin = starts[-1]
    return [r for i, r in enumerate(rows) if i >= begin or r.get("process") != "launcher"]


def summarize(metrics: Metrics, max_steps: int | None = None, window: int = MEAN_WINDOW) -> Status:
    rows = last_run(metrics.rows)
    status = Status(max_steps=max_steps)
    orch, trainer = step_rows(rows, "orchestrator", "reward/mean"), step_rows(rows, "trainer", "loss/policy")
    if orch:
        status.step = orch[-1]["step"]
        envs = environments(orch)
        for name, key in [("all", "reward/mean")] + [(env, f"reward/{env}/mean") for env in envs if len(envs) > 1]:
            values = [r[key] for r in orch if key in r]
            if drawn := [float(v) for v in values if finite(v)]:
                status.rewards[name] = drawn
            if skipped := len(values) - len(drawn):
                status.notes.append(f"{skipped} {key} value(s) not a finite number (not drawn)")
        newest = orch[-1]
        if (mean := real(newest.get("staleness/mean"))) is not None:
            most = real(newest.get("staleness/max"))
            status.staleness = (mean, mean if most is None else most)
        status.sampled_tokens_s = real(newest.get("perf/tokens_per_s"))
        status.phases["orchestrator"] = phase_means(orch[-window:], ORCHESTRATOR_PHASES)
    if trainer:
        newest = trainer[-1]
        status.trained = newest["step"]
        status.mismatch_kl = real(newest.get("loss/mismatch_kl"))
        status.masked_frac = real(newest.get("loss/masked_frac"))
        status.trained_tokens_s = real(newest.get("perf/tokens_per_s"))
        status.phases["trainer"] = phase_means(trainer[-window:], TRAINER_PHASES)
    evals = [r for r in rows if r.get("process") == "orchestrator" and "eval/reward/mean" in r]
    if evals:
        status.eval_reward = real(evals[-1]["eval/reward/mean"])
    status.eta_s = eta(orch, trainer, max_steps)
    launcher_events(rows, status)
    if metrics.bad_lines:
        status.notes.append(f"{metrics.bad_lines} malformed line(s) skipped")
    return status


def launcher_events(rows: list[dict], status: Status) -> None:
    """The failures and the ending the launcher recorded (only its own string fields are shown)."""
    for row in rows:
        if row.get("process") != "launcher":
            continue
        if row.get("event") == "failed":
            failed, reason = (v if isinstance(v, str) else None for v in (row.get("failed"), row.get("reason")))
            status.failed.append(f"{failed or '?'}: {reason or 'failed'}")
        if row.get("event") in ("finished", "failed", "stalled", "interrupted", "out_of_memory"):
            status.ended = row["event"]


def real(value) -> float | None:
    """``value`` as a float when it is a number (NaN and inf included: shown as such), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float, e.g. 10**400
        return None


def finite(value) -> bool:
    """A number that can be drawn, averaged, and subtracted from: not NaN, not inf."""
    return (number := real(value)) is not None and math.isfinite(number)


def phase_means(rows: list[dict], phases: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """Seconds per step of each phase some row logged, averaged over ``rows`` (finite values only)."""
    means = {}
    for name, key in phases:
        if values := [float(r[key]) for r in rows if finite(r.get(key))]:
            means[name] = sum(values) / len(values)
    return means


def step_rows(rows: list[dict], process: str, key: str) -> list[dict]:
    """``process``'s rows that carry ``key``, one per step, in step order."""
    return by_step(r for r in rows if r.get("process") == process and key in r)


def environments(rows: list[dict]) -> list[str]:
    """The environments whose mean reward (`reward/<env>/mean`) the rows carry."""
    return sorted({k.split("/")[1] for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2})


def by_step(rows) -> list[dict]:
    """Rows with a step (``is_step``), in step order (the newest row of a step wins)."""
    latest = {r["step"]: r for r in rows if is_step(r.get("step"))}
    return [latest[step] for step in sorted(latest)]


def eta(orch: list[dict], trainer: list[dict], max_steps: int | None) -> float | None:
    """Seconds left: the steps still to train at the pace of the last ones (wall clock)."""
    rows = trainer or orch
    if max_steps is None or len(rows) < 2:
        return None
    recent = rows[-(MEAN_WINDOW + 1):]
    first, last = recent[0].get("wall"), recent[-1].get("wall")
    span = float(last) - float(first) if finite(first) and finite(last) else 0.0
    per_step = span / (recent[-1]["step"] - recent[0]["step"]) if recent[-1]["step"] > recent[0]["step"] else 0
    left = max_steps - 1 - rows[-1]["step"]
    seconds = left * per_step if per_step > 0 and left > 0 else None
    return seconds if seconds is not None and math.isfinite(seconds) else None


# --------------------------------------------------------------------------- drawing in text


def sparkline(values: list[float], width: int = 40) -> str:
    """The newest ``width`` values as block characters, scaled to their own min..max."""
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(values)
    # halved: the difference of two finite floats (1e308 and -1e308) may itself overflow to inf
    return "".join(SPARK[min(len(SPARK) - 1, int((v / 2 - lo / 2) / (hi / 2 - lo / 2) * len(SPARK)))] for v in values)


def short(value: float) -> str:
    """A reward as text: three decimals, or three digits for one too large to print that way."""
    return f"{value:.3f}" if abs(value) < 1e6 else f"{value:.3g}"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


def joined(*parts: tuple[object, str]) -> str:
    """The parts whose value is known, each formatted, on one line ("" when none is)."""
    return " · ".join(text.format(value) for value, text in parts if value is not None)


def render(status: Status, width: int = 30) -> list[str]:
    """The status as text lines (the pane, or a headless run's periodic summary)."""
    if status.step is None and status.trained is None:
        lines = ["waiting for the first step (no orchestrator row in metrics.jsonl yet)"]
    else:
        total = f" / {status.max_steps}" if status.max_steps is not None else ""
        done = (status.trained if status.trained is not None else status.step) + 1
        progress = f"step {done}{total}"
        if status.trained is not None and status.step is not None and status.step != status.trained:
            progress += f" (sampled {status.step + 1}, async)"
        if status.eta_s is not None and status.ended is None:
            progress += f" · ETA {duration(status.eta_s)}"
        lines = [progress]
        for name, values in status.rewards.items():
            window = values[-MEAN_WINDOW:]
            label = "reward" if name == "all" else f"  {name}"
            lines.append(f"{label:<12} {sparkline(values, width)}  {short(values[-1])} (mean of last {len(window)}: "
                         f"{short(sum(window) / len(window))})")
        if status.eval_reward is not None:
            lines.append(f"{'eval reward':<12} {status.eval_reward:.3f}")
        lines.append(joined((status.mismatch_kl, "mismatch KL {:.2e}"), (status.staleness, "staleness {0[0]:.2f} (max {0[1]:g})"),
                            (status.masked_frac, "masked {:.1%}")))
        lines.append(joined((status.sampled_tokens_s, "sampled {:,.0f} tok/s"), (status.trained_tokens_s, "trained {:,.0f} tok/s")))
        for process, phases in status.phases.items():
            if phases:
                lines.append(f"{process + ' s/step':<19} " + " · ".join(f"{name} {value:.2f}" for name, value in phases.items()))
    lines = [line for line in lines if line]
    for failure in status.failed:
        lines.append(f"FAILED {failure}")
    if status.ended is not None and not status.failed:
        lines.append(f"run {status.ended}")
    lines += [f"note: {note}" for note in status.notes]
    return lines


# --------------------------------------------------------------------------- the launcher's views


@dataclass(frozen=True)
class StatusOptions:
    """How the launcher shows an RL run: the pane's redraw interval, the headless summary's
    period in steps (0 = never), the steps the run trains for (for the ETA)."""

    max_steps: int | None
    every_steps: int
    interval_s: float

    @classmethod
    def of(cls, config: RLConfig, quiet: bool = False) -> StatusOptions:
        """An RL run's (`[status]`; `--quiet` turns the headless summary off)."""
        every = 0 if quiet else config.status.every_steps
        return cls(max_steps=config.orchestrator.max_steps, every_steps=every, interval_s=config.status.interval_s)

    def pane_command(self, run_dir: Path, launcher_pid: int) -> str:
        """The tmux `status` pane: redraws until the launcher is gone."""
        steps = ["--max-steps", str(self.max_steps)] if self.max_steps is not None else []
        # tmux runs this through a shell: shlex quotes every word (repr would let a run
        # directory named `'$(cmd)'` close the quote and run cmd).
        return shlex.join([sys.executable, "-m", "prime_rl.observe.status", "--follow", "--pid", str(launcher_pid),
                           "--interval", f"{self.interval_s:g}", *steps, "--", str(run_dir)])  # `--`: a dir named `-x`


class StatusPrinter:
    """A headless run's summary on the launcher's stdout, each time the trainer has logged
    another ``every_steps`` steps, and once at the end. It runs inside the launcher, so it never
    raises: a failure (an unreadable file, a bug meeting odd rows) is said once on stderr and
    turns the summary off; the run goes on, and still records how it ends."""

    def __init__(self, run_dir: Path, options: StatusOptions, out=None):
        self.follower = MetricsFollower(metrics_path(run_dir))
        self.options, self.out = options, out
        self.next_at: int | None = None
        if options.every_steps:
            self._safely(self._start)

    def _start(self) -> None:
        self.follower.poll()  # a resumed run's earlier steps are not news
        self.next_at = self._after(self.done())

    def _after(self, done: int) -> int:
        return (done // self.options.every_steps + 1) * self.options.every_steps

    def done(self) -> int:
        trained = summarize(self.follower.metrics).trained
        return 0 if trained is None else trained + 1

    def poll(self) -> None:
        if self.next_at is not None:
            self._safely(self._poll)

    def _poll(self) -> None:
        if self.follower.poll() and (done := self.done()) >= self.next_at:
            self._print()
            self.next_at = self._after(done)

    def print(self) -> None:
        if self.next_at is not None:
            self._safely(self._print)

    def _print(self) -> None:
        self.follower.poll()
        lines = render(summarize(self.follower.metrics, self.options.max_steps))
        out = self.out or sys.stdout
        out.write("".join(f"[prime-rl] {'status: ' if i == 0 else '  '}{line}\n" for i, line in enumerate(lines)))
        out.flush()

    def _safely(self, action) -> None:
        try:
            action()
        except Exception as e:  # noqa: BLE001 - a view must never stop the run it shows
            self.next_at = None
            print(f"[prime-rl] status summary failed and is off (the run goes on): {one_line(e)}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the pane


def follow(run_dir: Path, max_steps: int | None, interval_s: float, pid: int | None, out=sys.stdout) -> int:
    """Redraw the status when new rows arrive (looked for every ``CHECK_S``) and at least every
    ``interval_s`` (the clock and the ETA), until process ``pid`` (the launcher) is gone."""
    follower = MetricsFollower(metrics_path(run_dir))
    drawn_at = -math.inf
    while pid is None or psutil.pid_exists(pid):
        try:
            new, problem = follower.poll(), None
        except OSError as e:  # the file replaced by a folder, its permissions changed: say so, look again
            new, problem = [], f"cannot read {follower.path}: {e.strerror or e}"
        if new or problem or time.monotonic() - drawn_at >= interval_s:
            try:
                lines = [problem] if problem else render(summarize(follower.metrics, max_steps))
            except Exception as e:  # noqa: BLE001 - the pane outlives whatever the rows hold
                lines = [f"status unavailable: {one_line(e)}"]
            out.write("\x1b[H\x1b[2J" + f"prime-rl status · {run_dir} · {time.strftime('%H:%M:%S')}\n" + "\n".join(lines) + "\n")
            out.flush()
            drawn_at = time.monotonic()
        time.sleep(min(CHECK_S, interval_s))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_rl.observe.status", description="A run's status from RUN/metrics.jsonl.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--follow", action="store_true", help="redraw until --pid exits (the tmux pane)")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between redraws")
    parser.add_argument("--pid", type=int, default=None, help="stop following when this process (the launcher) exits")
    args = parser.parse_args(argv)
    if args.follow:
        try:
            return follow(args.run_dir, args.max_steps, args.interval, args.pid)
        except KeyboardInterrupt:
            return 0
    path = metrics_path(args.run_dir)
    if not path.is_file():
        print(f"{path}: no metrics yet (is it a run's output_dir?)", file=sys.stderr)
        return 2
    try:
        metrics = read_metrics(path)
    except OSError as e:
        print(f"{path}: cannot read it: {e.strerror or e}", file=sys.stderr)
        return 2
    print("\n".join(render(summarize(metrics, args.max_steps))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
