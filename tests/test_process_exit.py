"""How a process of the run ends (``prime_rl.settings.exit_process`` and the verifiers
worker's copy of it) and the orchestrator's tokenizer loaded beside its environments."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prime_rl.settings import ConfigError

from helpers import REPO

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
sys.path[:0] = [{src!r}, {worker!r}]
from {module} import exit_process

class Teardown:  # a module-level object: freed only by the interpreter's module teardown
    def __del__(self, open=open):  # its own reference: the teardown may have cleared builtins
        open({marks!r} + "/teardown", "w").close()

KEPT = Teardown()
atexit.register(lambda: open({marks!r} + "/atexit", "w").close())
started = threading.Event()
def work():
    print("thread started", flush=True)
    started.set()
    time.sleep(0.3)
    open({marks!r} + "/thread", "w").close()
threading.Thread(target=work).start()
pool = ThreadPoolExecutor(1)  # never shut down: its idle thread must not hold the exit
pool.submit(time.sleep, 0.1)
started.wait()
print("buffered, not flushed")  # a pipe: block-buffered, written only by the exit's flush
{end}
"""


def run_program(tmp_path, module: str, end: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    marks = tmp_path / "marks"
    marks.mkdir()
    code = PROGRAM.format(src=str(REPO / "src"), worker=str(REPO / "src" / "orchestrator" / "worker"),
                          module=module, marks=str(marks), end=end)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return proc, {p.name for p in marks.iterdir()}


@pytest.mark.parametrize("module", ["prime_rl.settings", "vfworker_util"])
def test_exit_process_ends_as_the_interpreter_would_but_skips_the_module_teardown(tmp_path, module):
    """The exit code, other threads finished, atexit handlers run, buffered output written,
    an idle thread pool no obstacle; only the module teardown (which frees torch's and
    transformers' objects one by one, ~1 s) does not happen."""
    proc, marks = run_program(tmp_path, module, "exit_process(3)")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["thread started", "buffered, not flushed"], proc.stdout
    assert marks == {"thread", "atexit"}, "the thread finished, atexit handlers ran; the module teardown did not"


def test_the_interpreters_own_exit_runs_the_teardown_the_helper_skips(tmp_path):
    """The control for the test above: the same program ending with sys.exit tears the
    modules down (so the marker of the skipped teardown can be seen at all)."""
    proc, marks = run_program(tmp_path, "prime_rl.settings", "sys.exit(3)")
    assert proc.returncode == 3 and proc.stdout.splitlines() == ["thread started", "buffered, not flushed"]
    assert marks == {"thread", "atexit", "teardown"}


def test_the_tokenizer_loads_beside_the_environments_and_its_error_comes_when_awaited(tmp_path, tiny_model):
    from orchestrator.entry import start_loading_tokenizer

    assert start_loading_tokenizer(None)() is None
    tokenizer = start_loading_tokenizer(str(tiny_model))()
    assert tokenizer.decode(tokenizer.encode("abc")) == "abc"
    missing = start_loading_tokenizer(str(tmp_path / "no-model"))  # started; nothing raised yet
    with pytest.raises(ConfigError, match="no-model"):
        missing()
