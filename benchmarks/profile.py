"""Where a prime-rl run's time goes: per-process CPU, work against waiting, start-up phases.

``CpuSampler`` samples the CPU seconds of a command's process tree every half second
(psutil), labelled by role: the trainer, the orchestrator, and vLLM's three processes
(API server, engine core, worker). ``run_profile`` combines that with the run's own
metrics rows (each process times its phases per step) into one flat dict of figures:

- ``cores/<process>``: cores busy in the steady state (trainer step 1 to the last step);
- ``trainer/<phase>_s``, ``orchestrator/<phase>_s``: median seconds per step of each
  phase (trainer: waiting for its batch, training, writing weights; orchestrator:
  generating, waiting for weights, reloading them, the rest), and the orchestrator's
  generated tokens per second while generating;
- ``startup/<phase>_s``: seconds since the command started when inference answered
  /health, when the trainer was ready for its first batch, when the first batch was sent,
  and when the first step was trained;
- ``handoff_share``: weight handoff (trainer write + inference reload) over seconds per step.

``pin_tree`` keeps each process of a run on cores chosen by its role (``DISJOINT``: vLLM on
core 0, the trainer and the orchestrator on core 1, as generation and training would be on
two GPUs).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import psutil

ROLES = (("trainer.rl", "trainer"), ("orchestrator", "orchestrator"), ("api_server", "vllm_api"),
         ("inference.vllm_cpu", "vllm_api"), ("EngineCore", "vllm_engine"), ("Worker", "vllm_worker"))
"""A process's role by its command line or title (vLLM's server is `inference.vllm_cpu` on CPU)."""


def role(proc: psutil.Process) -> str | None:
    try:
        text = " ".join(proc.cmdline()) + " " + proc.name()
    except psutil.Error:
        return None
    return next((name for key, name in ROLES if key in text), None)


DISJOINT = {"vllm_worker": [0], "vllm_api": [0], "vllm_engine": [0], "trainer": [1], "orchestrator": [1]}
"""Generation and training on cores of their own: all of vLLM on core 0 (its worker's OpenMP
threads bound there too: ``inference.cpu_threads_bind = "0"``), the trainer (one thread) and
the orchestrator on core 1."""
DISJOINT_FLAGS = ("--inference.cpu-threads-bind", "0", "--trainer.num-threads", "1")
"""With ``DISJOINT`` pinning: vLLM's worker binds its one OpenMP thread to core 0, the trainer
runs one thread on core 1."""


def pin_tree(pid: int, pin: dict[str, list[int]], stop: threading.Event) -> None:
    """Pin each process of ``pid``'s tree by role (``pin``: role -> cores) as it appears,
    until ``stop``."""
    done: set[int] = set()
    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            procs = root.children(recursive=True)
        except psutil.Error:
            procs = []
        for proc in procs:
            if proc.pid in done:
                continue
            name = role(proc)
            if name in pin:
                try:
                    # every thread: a process's affinity is per thread, and threads already
                    # started (torch's, vLLM's) would keep their old mask
                    for thread in proc.threads():
                        os.sched_setaffinity(thread.id, pin[name])
                    done.add(proc.pid)
                except (psutil.Error, OSError):
                    pass
        stop.wait(0.2)


class CpuSampler:
    """Samples (seconds since ``t0``, {role: CPU seconds}) of ``pid``'s process tree in a thread."""

    def __init__(self, pid: int, t0: float, interval_s: float = 0.5):
        self.root, self.t0, self.interval_s = psutil.Process(pid), t0, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}  # a process's last reading survives its exit
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for proc in procs:
                name = role(proc)
                if name is None:
                    continue
                try:
                    cpu = proc.cpu_times()
                    last[proc.pid] = (name, cpu.user + cpu.system)
                except psutil.Error:
                    pass
            totals: dict[str, float] = {}
            for name, seconds in last.values():
                totals[name] = totals.get(name, 0.0) + seconds
            self.samples.append((time.time() - self.t0, totals))
            self._stop.wait(self.interval_s)


def cores_between(samples: list[tuple[float, dict[str, float]]], start: float, end: float) -> dict[str, float]:
    """Mean cores each role kept busy between two times (seconds since the command started)."""
    if not samples or end <= start:
        return {}
    a = min(samples, key=lambda s: abs(s[0] - start))
    b = min(samples, key=lambda s: abs(s[0] - end))
    if b[0] <= a[0]:
        return {}
    return {name: (b[1].get(name, 0.0) - a[1].get(name, 0.0)) / (b[0] - a[0]) for name in b[1]}


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def run_profile(rows: list[dict], t0: float, samples: list[tuple[float, dict[str, float]]]) -> dict[str, float | None]:
    """The figures above from a run's metrics rows (``metrics.jsonl``) and CPU samples."""
    trainer = sorted((r for r in rows if r["process"] == "trainer"), key=lambda r: r["step"])
    orch = sorted((r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r), key=lambda r: r["step"])
    steady_t, steady_o = trainer[1:], orch[1:]  # step 0 carries start-up
    out: dict[str, float | None] = {}
    for phase in ("wait_batch", "train", "save_weights"):
        out[f"trainer/{phase}_s"] = median_of(steady_t, f"time/{phase}")
    for phase in ("generate", "wait_weights", "reload"):
        out[f"orchestrator/{phase}_s"] = median_of(steady_o, f"time/{phase}")
    out["orchestrator/tokens_per_s"] = median_of(steady_o, "perf/tokens_per_s")
    rest = [r["time/step"] - r["time/generate"] - r["time/wait_weights"] - r["time/reload"] for r in steady_o]
    out["orchestrator/rest_s"] = statistics.median(rest) if rest else None
    ready = orch[0].get("startup/server_ready_unix") if orch else None
    out["startup/inference_ready_s"] = ready - t0 if ready else None
    if trainer:
        first = trainer[0]
        out["startup/trainer_ready_s"] = first["wall"] - t0 - first["time/step"]
        out["startup/first_batch_s"] = first["wall"] - t0 - first["time/step"] + first["time/wait_batch"]
        out["startup/first_step_s"] = first["wall"] - t0
    if len(trainer) > 2:
        span = trainer[-1]["wall"] - trainer[1]["wall"]
        s_per_step = out["mean_s_per_step"] = span / (len(trainer) - 2)
        handoff = (out["trainer/save_weights_s"] or 0.0) + (out["orchestrator/reload_s"] or 0.0)
        out["handoff_share"] = handoff / s_per_step if s_per_step > 0 else None
        for name, cores in cores_between(samples, trainer[1]["wall"] - t0, trainer[-1]["wall"] - t0).items():
            out[f"cores/{name}"] = cores
    return out
