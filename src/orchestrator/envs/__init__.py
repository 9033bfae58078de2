"""The built-in environments and how an `[[env]]` entry becomes an environment.

Every id goes through one path: ``prime_rl.registry.resolve`` names the module (a built-in's
from ``registry.toml``, a user's by the id: ``my-env`` -> ``my_env``), and the module's
``load_environment(**args)`` builds the environment. What it returns decides where it runs:

- a ``prime_rl.envs.Environment``: in the orchestrator itself (the built-ins, and users'
  modules written against ``prime_rl.envs``);
- a verifiers environment (classic ``vf.Environment``, or a module exporting a v1
  ``vf.Taskset``): in a worker process (``orchestrator.envworker``), in the Python the entry
  names with ``python``, or this one when verifiers is installed here.
"""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path

from prime_rl.config import EnvConfig
from prime_rl.envs import DatasetUnavailable, Environment
from prime_rl.envs.sandbox import SandboxUnavailable
from prime_rl.keys import redact, scrub
from prime_rl.registry import ProbeError, builtins, check_worker_python, resolve, verifiers_api
from prime_rl.settings import one_line

from orchestrator.envworker import EnvironmentWorkerError, WorkerEnvironment, start_worker_env

REGISTRY: dict[str, str] = {env_id: entry.module for env_id, entry in builtins().items()}
"""Built-in id -> module, as `prime_rl/registry.toml` lists them."""

LOAD_TIMEOUT_S = 900.0
"""Longest a worker may take to load its environment (datasets are built at load time)."""


def load_env(env_cfg: EnvConfig, run_dir: Path | None = None, tokenizer: str | None = None) -> Environment:
    """Built-in id (``primeintellect/`` prefix allowed) or a user's module, in this Python or in
    a worker (its log: ``run_dir``/logs/env-<name>.log); any problem is a ValueError naming the environment
    and what was expected. ``tokenizer`` (the policy's) is what a v1 taskset renders prompts with.
    No message quotes a secret of the entry's args (echoed back, or in the environment's own
    error): it goes to orchestrator.log (``prime_rl.keys.scrub``)."""
    try:
        if env_cfg.python is not None:
            env = worker_env(env_cfg, str(Path(env_cfg.python).expanduser()), run_dir, tokenizer)
        else:
            env = local_env(env_cfg, run_dir, tokenizer)
    except Exception as e:
        said = "\n".join(str(x) for x in causes(e))
        if scrub(said, env_cfg.args) == said:
            raise
        # the traceback would quote the secret: one line, without the chain that holds it
        what = str(e) if isinstance(e, ValueError) else \
            f"environment {env_cfg.id!r}: load_environment() raised {type(e).__name__}: {one_line(e)}"
        raise ValueError(scrub(what, env_cfg.args)) from None
    if not env.dataset and not env.eval_dataset:
        env.close()
        raise ValueError(f"environment {env_cfg.id!r}: load_environment() returned an environment with no examples")
    if env_cfg.system_prompt_file is not None:
        env.use_system_prompt(Path(env_cfg.system_prompt_file).read_text().strip())
    return env


def local_env(env_cfg: EnvConfig, run_dir: Path | None, tokenizer: str | None) -> Environment:
    module_path = resolve(env_cfg.id)
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        if (e.name or "").split(".")[0] == "verifiers":
            raise ValueError(
                f"environment {env_cfg.id!r}: module {module_path!r} imports verifiers, which prime-rl's own Python does "
                "not have: make a virtual environment with the environment and its verifiers version, and name its "
                "Python in the entry: `python = \"/path/to/venv/bin/python\"` (docs/environments.md)"
            ) from e
        raise ValueError(f"environment {env_cfg.id!r}: cannot import module {module_path!r}: {e}") from e
    if is_verifiers(module):  # verifiers is installed here: it still runs in a worker, not in this process
        return worker_env(env_cfg, sys.executable, run_dir, tokenizer)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"environment {env_cfg.id!r}: module {module_path!r} has no load_environment()")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = load(**env_cfg.args)
    except TypeError as e:  # usually a wrong keyword in [[env]] args
        raise ValueError(f"environment {env_cfg.id!r}: load_environment(**{redact(env_cfg.args)!r}) failed: {e}") from e
    except (DatasetUnavailable, SandboxUnavailable) as e:
        raise ValueError(f"environment {env_cfg.id!r}: {e}") from e
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if not isinstance(env, Environment):
        raise ValueError(
            f"environment {env_cfg.id!r}: load_environment() returned {type(env).__name__}, expected a "
            "prime_rl.envs.Environment (SingleTurnEnv, MultiTurnEnv or a subclass) or a verifiers environment"
        )
    return env


def causes(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or during (a traceback shows them all)."""
    chain: list[BaseException] = []
    while error is not None and error not in chain and len(chain) < 32:
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def is_verifiers(module) -> bool:
    """The module is written against verifiers (it imported it; prime_rl.envs modules do not)."""
    return any(getattr(value, "__name__", "").split(".")[0] == "verifiers" or
               (getattr(value, "__module__", None) or "").split(".")[0] == "verifiers"
               for value in vars(module).values())


def worker_env(env_cfg: EnvConfig, python: str, run_dir: Path | None, tokenizer: str | None) -> WorkerEnvironment:
    name = env_cfg.metric_name
    log = (run_dir or Path("outputs/run")) / "logs" / f"env-{name}.log"
    try:
        # the launcher's probe of that Python (cached here): its verifiers decides the API
        api = verifiers_api(check_worker_python(env_cfg.id, python).verifiers)
        env = start_worker_env(name, env_cfg.id, resolve(env_cfg.id), dict(env_cfg.args), api, python, log,
                               env_cfg.max_concurrent, LOAD_TIMEOUT_S, env_cfg.worker_timeout_s, tokenizer)
    except (EnvironmentWorkerError, ProbeError) as e:
        raise ValueError(str(e)) from None
    print(f"[orchestrator] environment {name!r}: {env.describe()}", flush=True)
    return env
