"""Metrics sinks: JSONL in the run directory, a one-line console summary, optional W&B.

Monitoring never crashes training: a failing sink is reported once and switched off.
Keys are prefixed (`loss/`, `reward/`, `perf/`, `time/`, ...). Secrets stay out: W&B gets
the settings redacted (`prime_rl.keys.redact`: API keys, tokens, transport keys), and rows
are metrics, never settings.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Protocol

from prime_rl.config import WandbConfig
from prime_rl.keys import redact
from prime_rl.rundir import append_jsonl, metrics_path


class Sink(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, row: dict[str, Any]) -> None:
        append_jsonl(self.path, row)

    def close(self) -> None:
        pass


class ConsoleSink:
    """One line per row, only the keys named in ``keys`` (in that order)."""

    def __init__(self, process: str, keys: tuple[str, ...]):
        self.process, self.keys = process, keys

    def log(self, row: dict[str, Any]) -> None:
        parts = [f"step {row.get('step', '?')}"]
        for key in self.keys:
            if key in row:
                value = row[key]
                parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        if len(parts) > 1:  # rows of other kinds (eval, preflight) print their own summary
            print(f"[{self.process}] " + " | ".join(parts), flush=True)

    def close(self) -> None:
        pass


class WandbSink:
    """One W&B run per process. Its id is kept in ``RUN/wandb/<process>.id``, so a resumed
    run (``prime-rl --resume``) goes on logging into the same W&B run."""

    def __init__(self, config: WandbConfig, process: str, run_dir: Path, settings: dict[str, Any]):
        import wandb  # optional dependency: only imported when configured

        id_file = Path(run_dir) / "wandb" / f"{process}.id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=f"{config.name or Path(run_dir).name}-{process}",
            mode=config.mode,
            config=redact(settings),  # the process's config, without its keys
            id=run_id,
            resume="allow" if run_id else None,
            reinit=True,
        )
        if run_id is None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(f"{self.run.id}\n")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=row.get("step"))

    def close(self) -> None:
        self.run.finish()


class Metrics:
    """Fan a row out to every sink; a sink that raises is disabled with one warning."""

    def __init__(self, process: str, sinks: list[Sink]):
        self.process = process
        self.sinks = sinks
        self._start = time.time()

    def log(self, step: int, values: dict[str, Any], process: str | None = None) -> None:
        """One row; ``process`` labels rows of another kind (e.g. `eval`) than the process's own."""
        now = time.time()
        # `time`: seconds since this process started; `wall`: Unix time, to line processes up
        row = {"process": process or self.process, "step": step, "time": round(now - self._start, 3), "wall": round(now, 3), **values}
        for sink in list(self.sinks):
            try:
                sink.log(row)
            except Exception as e:  # noqa: BLE001 - monitoring must never stop training
                print(f"[{self.process}] metrics sink {type(sink).__name__} failed and is disabled: {e}", file=sys.stderr)
                self.sinks.remove(sink)

    @property
    def wandb_run(self):
        """The W&B run of this process's sink (for tables), or None without one."""
        return next((sink.run for sink in self.sinks if isinstance(sink, WandbSink)), None)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001
                pass


def make_metrics(
    process: str,
    run_dir: Path,
    console_keys: tuple[str, ...],
    wandb: WandbConfig | None = None,
    settings: dict[str, Any] | None = None,
) -> Metrics:
    sinks: list[Sink] = [JsonlSink(metrics_path(run_dir)), ConsoleSink(process, console_keys)]
    if wandb is not None and wandb.mode != "disabled":
        try:
            sinks.append(WandbSink(wandb, process, run_dir, settings or {}))
        except Exception as e:  # noqa: BLE001 - W&B is never needed
            print(f"[{process}] W&B disabled: {e}", file=sys.stderr)
    return Metrics(process, sinks)
