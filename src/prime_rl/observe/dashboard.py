"""`prime-rl dashboard [RUN ...] [--port N] [--host H]`: a web page of runs, live while they write.

One page (``dashboard.html``, plotly's JavaScript served from the plotly package: nothing is
fetched from the internet) polls these routes, which read the run directories and never write
to them:

    /api/runs                     the runs: label, path, and what each holds
    /api/metrics?run=I&since=K    metrics.jsonl rows from the K-th on (``reset`` when the file
                                  was rewritten, as a resume does)
    /api/status?run=I             the status the tmux pane draws (``observe.status``): step,
                                  ETA, rewards, failed processes
    /api/traces?run=I&...         the traced rollouts (``prime_rl.traces``), newest first,
                                  filtered by kind, step, environment and reward
    /api/trace?run=I&id=X         one rollout whole, with the trainer's rows of its samples
    /api/results?run=I            GEPA's Pareto frontier and `prime-rl eval` summaries found
                                  beside the run (OUTPUT_DIR/*/<run id>/)

It binds 127.0.0.1 by default. On another address every request must carry the token printed
in its URL (``?token=``): a page that shows completions (and the prompts of users' tasks) is
not for whoever can reach the port.

Trace files are indexed as they grow (an entry per row: its offset and the fields the list
filters by), so a long run's traces are not held in memory; a row is read again when opened.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import os
import socket
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from prime_rl.observe.status import MetricsFollower, render, summarize
from prime_rl.rundir import BadRow, config_path, metrics_path, parse_row
from prime_rl.traces import rollout_traces_path, trace_row, trainer_traces_path

DEFAULT_PORT = 8265
DASHBOARD_TOKEN_ENV = "PRIME_RL_DASHBOARD_TOKEN"
"""The token of a page on another address than loopback, as the launcher hands it over."""
MAX_LIST = 500
"""Most traces one list answer holds (the newest first)."""

MAX_READ_BYTES = 64 * 2**20
"""Most bytes of a trace file indexed per request; the rest on the next (the page polls)."""

PUBLIC_PATHS = ("/", "/static/plotly.min.js")
"""Served without the token: the page's shell and plotly.js hold no run's data; the page then
sends the token of its own URL with every data request."""

SUMMARY_FIELDS = ("id", "kind", "step", "env", "example_id", "group", "sample", "reward", "advantage", "stop_condition",
                  "finish_reason", "truncated")


class DashboardError(ValueError):
    """What the user must fix before the page can start (one line)."""


# --------------------------------------------------------------------------- reading a run


@dataclass
class TraceIndex:
    """The rows of one trace file: where each is, and what the list shows of it. Rebuilt when
    the file was rewritten (a resume drops the rows of the steps it repeats)."""

    path: Path
    entries: list[dict] = field(default_factory=list)
    skipped: int = 0
    offset: int = 0
    inode: int | None = None

    def poll(self) -> None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return
        if stat.st_ino != self.inode or stat.st_size < self.offset:
            self.entries, self.skipped, self.offset, self.inode = [], 0, 0, stat.st_ino
        if stat.st_size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(MAX_READ_BYTES)
        start = self.offset
        for line in data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]:
            where, start = start, start + len(line) + 1
            if not line.strip():
                continue
            if (row := trace_row(line)) is None:
                self.skipped += 1
                continue
            entry = {k: row[k] for k in SUMMARY_FIELDS if k in row}
            entry.update(offset=where, length=len(line), part=row.get("part", 0), preview=preview(row))
            self.entries.append(entry)
        self.offset = start

    def read(self, entry: dict) -> dict | None:
        """The whole row of an entry (None when the file changed under it)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(entry["offset"])
                return parse_row(f.read(entry["length"]))
        except (OSError, BadRow):
            return None


def preview(row: dict, chars: int = 120) -> str:
    """The last model reply's text, on one line, for the list."""
    replies = [m for m in row.get("completion") or [] if isinstance(m, dict) and m.get("role") == "assistant"]
    content = replies[-1].get("content") if replies else ""
    text = " ".join(str(content or "").split())
    return text[:chars] + ("…" if len(text) > chars else "")


@dataclass
class RunView:
    path: Path
    label: str
    metrics: MetricsFollower
    rollouts: TraceIndex
    trainer: TraceIndex
    generation: int = 0
    """Counts the metrics file's rewrites: the page drops its rows when this changes."""

    @classmethod
    def of(cls, path: Path, label: str) -> RunView:
        return cls(path, label, MetricsFollower(metrics_path(path)), TraceIndex(rollout_traces_path(path)),
                   TraceIndex(trainer_traces_path(path)))

    def poll_metrics(self) -> None:
        before = self.metrics.metrics
        self.metrics.poll()
        if self.metrics.metrics is not before and before.rows:
            self.generation += 1

    def max_steps(self) -> int | None:
        try:
            value = json.loads(config_path(self.path, "orchestrator").read_text()).get("max_steps")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) else None


def run_views(paths: list[Path]) -> tuple[list[RunView], list[str]]:
    """A view of every run folder that exists, labelled by its name (made unique), and a line
    for each that does not."""
    views, problems = [], []
    for path in paths:
        if not path.is_dir():
            problems.append(f"{path}: no such run folder (skipped)")
            continue
        label, n = path.name or str(path), 2
        while label in {v.label for v in views}:
            label, n = f"{path.name} ({n})", n + 1
        views.append(RunView.of(path, label))
    return views, problems


def result_files(run: Path) -> dict:
    """GEPA's frontier and `prime-rl eval`'s summaries of this run: in the folder itself, or in
    OUTPUT_DIR/*/<run id>/ when the folder is OUTPUT_DIR/runs/<run id>."""
    folders = [run]
    if run.parent.name == "runs":
        folders += sorted(p / run.name for p in run.parent.parent.iterdir() if p.name != "runs" and (p / run.name).is_dir())
    frontier, summaries, metadata = [], [], None
    for folder in folders:
        frontier += read_jsonl_rows(folder / "pareto_frontier.jsonl")
        if (folder / "metadata.json").is_file():
            metadata = read_json(folder / "metadata.json")
        if (folder / "summary.json").is_file() and (summary := read_json(folder / "summary.json")) is not None:
            summaries.append(summary)
    return {"frontier": frontier, "gepa": metadata, "evals": summaries}


def read_jsonl_rows(path: Path) -> list[dict]:
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(parse_row(line)) if line.strip() else None
        except BadRow:
            pass
    return rows


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --------------------------------------------------------------------------- the app


def json_safe(value):
    """NaN and infinities become null (a browser's JSON parser refuses them)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def plotly_js() -> bytes:
    """plotly.js as the plotly package ships it (no CDN)."""
    return resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()


def page_html() -> str:
    return resources.files("prime_rl.observe").joinpath("dashboard.html").read_text()


def make_app(views: list[RunView], token: str | None = None):
    """The FastAPI app over ``views``; with ``token``, every request must carry it (``?token=``
    or the ``X-Dashboard-Token`` header)."""
    from fastapi import FastAPI, HTTPException, Query, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    app = FastAPI(title="prime-rl dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if token is not None and request.url.path not in PUBLIC_PATHS:
            given = request.query_params.get("token") or request.headers.get("x-dashboard-token") or ""
            if not hmac.compare_digest(given.encode(), token.encode()):
                return JSONResponse({"error": "this dashboard needs the token of its URL (?token=...)"}, status_code=403)
        response = await call_next(request)
        response.headers["Cache-Control"] = "no-store"
        return response

    # Every route is async: they all run on the event loop's one thread, so the followers and
    # indexes (not thread-safe) are never read by two requests at once.
    def view(run: int) -> RunView:
        if not 0 <= run < len(views):
            raise HTTPException(404, f"no run {run}: there are {len(views)}")
        return views[run]

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page_html()

    @app.get("/static/plotly.min.js")
    async def plotly() -> Response:
        return Response(plotly_js(), media_type="application/javascript")

    @app.get("/api/runs")
    async def runs() -> list[dict]:
        return [{"index": i, "label": v.label, "path": str(v.path), "max_steps": v.max_steps()} for i, v in enumerate(views)]

    @app.get("/api/metrics")
    async def metrics(run: int, since: int = Query(0, ge=0), generation: int = -1) -> JSONResponse:
        v = view(run)
        v.poll_metrics()
        reset = generation != v.generation
        rows = v.metrics.metrics.rows[0 if reset else since:]
        return JSONResponse(json_safe({"rows": rows, "next": len(v.metrics.metrics.rows), "generation": v.generation,
                                       "reset": reset, "bad_lines": v.metrics.metrics.bad_lines}))

    @app.get("/api/status")
    async def status(run: int) -> JSONResponse:
        v = view(run)
        v.poll_metrics()
        summary = summarize(v.metrics.metrics, v.max_steps())
        return JSONResponse(json_safe({**dataclasses.asdict(summary), "lines": render(summary)}))

    @app.get("/api/traces")
    async def traces(run: int, kind: str | None = None, step: int | None = None, env: str | None = None,
               min_reward: float | None = None, max_reward: float | None = None,
               limit: int = Query(200, ge=1, le=MAX_LIST)) -> JSONResponse:
        v = view(run)
        v.rollouts.poll()
        v.trainer.poll()
        entries = v.rollouts.entries
        trained = {e["id"] for e in v.trainer.entries}

        def keep(e: dict) -> bool:
            reward = e.get("reward")
            return ((kind is None or e.get("kind") == kind) and (step is None or e.get("step") == step)
                    and (env is None or e.get("env") == env)
                    and (min_reward is None or (isinstance(reward, int | float) and reward >= min_reward))
                    and (max_reward is None or (isinstance(reward, int | float) and reward <= max_reward)))

        kept = [e for e in entries if keep(e)]
        shown = [{**{k: e.get(k) for k in (*SUMMARY_FIELDS, "preview")}, "trained": e["id"] in trained}
                 for e in reversed(kept[-limit:])]
        return JSONResponse(json_safe({
            "traces": shown, "matched": len(kept), "total": len(entries),
            "kinds": sorted({str(e.get("kind")) for e in entries}), "envs": sorted({str(e.get("env")) for e in entries}),
            "steps": sorted({e["step"] for e in entries if isinstance(e.get("step"), int)}),
            "skipped": v.rollouts.skipped + v.trainer.skipped,
        }))

    @app.get("/api/trace")
    async def trace(run: int, id: str) -> JSONResponse:  # noqa: A002 - the trace's id, as the files call it
        v = view(run)
        v.rollouts.poll()
        v.trainer.poll()
        found = [e for e in v.rollouts.entries if e["id"] == id]
        row = v.rollouts.read(found[-1]) if found else None
        if row is None:
            raise HTTPException(404, f"no trace {id!r} in {v.rollouts.path}")
        parts: dict[int, dict] = {}
        for entry in (e for e in v.trainer.entries if e["id"] == id):
            if (trained := v.trainer.read(entry)) is not None:
                parts[int(trained.get("part", 0))] = trained  # the newest row of a part (a resumed step trains again)
        return JSONResponse(json_safe({"rollout": row, "trainer": [parts[k] for k in sorted(parts)]}))

    @app.get("/api/results")
    async def results(run: int) -> JSONResponse:
        return JSONResponse(json_safe(result_files(view(run).path)))

    return app


# --------------------------------------------------------------------------- command line


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_port(host: str, port: int) -> None:
    """Refuse a port another program holds, in one line (uvicorn would log a traceback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise DashboardError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another with --port)") from None


def page_url(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def serve(views: list[RunView], host: str, port: int, token: str | None) -> None:
    """Serve the page until interrupted (the port checked first: ``check_port``)."""
    import uvicorn

    check_port(host, port)
    print(f"[dashboard] {', '.join(str(v.path) for v in views)}: {page_url(host, port, token)}", flush=True)
    uvicorn.run(make_app(views, token), host=host, port=port, log_level="warning")
