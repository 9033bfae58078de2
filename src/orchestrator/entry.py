"""Glue the orchestrator's entry points share: `orchestrator.main` (RL), `orchestrator.eval`
and `orchestrator.gepa`. An entry point imports this module, never another entry point.

- ``load_tokenizer``: a model's tokenizer, or a one-line ``ConfigError``;
  ``start_loading_tokenizer``: the same in the background, while the environments load;
- ``make_client`` / ``make_sampler``: the client of a resolved model (``EvalTarget``: an
  endpoint of the endpoints file, or a local vLLM server the command started) and the
  environments' ``ModelClient`` over it (exact tokens locally, text from an endpoint);
  ``make_chat_client``: a model asked in text only, wherever it runs (GEPA's reflection);
- ``progress_bar``: rollouts done of the total, one bar per task;
- ``run_entry``: how an entry point ends, as an exit code (``prime_rl.settings.run_entry``
  with the failures every orchestrator process expects: a peer missing or misbehaving, a
  disk full), SIGTERM taken as Ctrl-C where the process must unwind (a progress bar gives
  the terminal its cursor back, a search saves what it found).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

import prime_rl.tokenizer
from prime_rl.config import ClientConfig, EvalRunConfig, EvalTarget, GepaRunConfig, SamplingConfig, check_model_path
from prime_rl.envs import Environment, ModelClient
from prime_rl.registry import tool_parser_problem
from prime_rl.settings import ConfigError
from prime_rl.settings import run_entry as run_settings_entry
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.client import ChatClient, InferenceClient, InferenceError
from orchestrator.envworker import EnvironmentWorkerError
from orchestrator.sampler import ChatSampler, TokenSampler

EXPECTED_ERRORS: tuple[type[BaseException], ...] = (OSError, InferenceError, EnvironmentWorkerError)
"""Failures of a peer or the machine (an unreachable server, a timeout, a dead worker, a full
disk): reported in one line, without a traceback. TimeoutError is an OSError."""


def run_entry(
    name: str, body: Callable[[], int | None], expected: tuple[type[BaseException], ...] = (),
    usage_errors: tuple[type[BaseException], ...] = (), sigterm_interrupts: bool = False,
) -> int:
    """``body``'s exit code (``prime_rl.settings.run_entry``), with ``EXPECTED_ERRORS`` and
    ``expected`` as one-line failures; ``sigterm_interrupts``: the launcher's SIGTERM unwinds
    like Ctrl-C (exit 130)."""
    if sigterm_interrupts:
        signal.signal(signal.SIGTERM, _interrupt)
    return run_settings_entry(name, body, EXPECTED_ERRORS + expected, usage_errors)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def load_tokenizer(name: str):
    try:
        check_model_path(name, "tokenizer")  # a missing local path fails now, not after hub retries
        return prime_rl.tokenizer.load_tokenizer(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the tokenizer of {name!r}: {e}") from None


def start_loading_tokenizer(name: str | None) -> Callable[[], object]:
    """``load_tokenizer(name)`` begun now in a daemon thread, so that it overlaps what the
    process does next (its environments load, a verifiers environment's in a worker process
    of its own): importing transformers and torch for a tokenizer takes ~3 s here, as long as
    a worker's start. Returns the call that waits for it (raising its ConfigError); ``None``
    (no tokenizer) gives None. A daemon: a process that fails first does not wait for it.
    Imports in both threads are safe: Python locks each module while it is imported."""
    if name is None:
        return lambda: None
    loaded: Future = Future()

    def load() -> None:
        try:
            loaded.set_result(load_tokenizer(name))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the tokenizer
            loaded.set_exception(e)

    threading.Thread(target=load, name="load-tokenizer", daemon=True).start()
    return loaded.result


def with_api_key(client_cfg: ClientConfig, target: EvalTarget) -> ClientConfig:
    """An endpoint's key comes from its environment variable, read only here (never stored)."""
    if target.api_key_var is None:
        return client_cfg
    key = os.environ.get(target.api_key_var) or None
    if key is None:
        print(f"[prime-rl] {target.api_key_var} is not set: sending no API key", file=sys.stderr, flush=True)
    return client_cfg.model_copy(update={"api_key": key})


def make_client(client_cfg: ClientConfig, target: EvalTarget) -> InferenceClient | ChatClient:
    """A local vLLM server's (one this run started: exact tokens, and the key only once it
    proved it holds it), or an endpoint's chat API (its key is meant for whoever answers at
    the endpoint's URL)."""
    if target.type == "local":
        return InferenceClient(with_api_key(client_cfg, target), target.model)
    return make_chat_client(client_cfg, target)


def make_chat_client(client_cfg: ClientConfig, target: EvalTarget) -> ChatClient:
    """Text only, from a local server or an endpoint (the key as in ``make_client``)."""
    return ChatClient(with_api_key(client_cfg, target), target.model, own_server=target.type == "local")


def make_sampler(cfg: EvalRunConfig | GepaRunConfig, client: InferenceClient | ChatClient, tokenizer) -> ModelClient:
    """Exact tokens through the local vLLM server, as RL samples them, or text through an
    endpoint's chat completions API (nothing sampled from it can be trained on)."""
    if isinstance(client, ChatClient):
        return ChatSampler(client, cfg.sampling)
    seq_len = cfg.inference.seq_len
    # model_construct: evaluation allows temperature 0 (greedy), which RL's SamplingConfig
    # refuses because the trainer divides by it; nothing here trains. vLLM's default is 1.
    sampling = SamplingConfig.model_construct(
        max_tokens=cfg.sampling.max_tokens or seq_len,
        temperature=1.0 if cfg.sampling.temperature is None else cfg.sampling.temperature,
    )
    # per_turn: each turn's prompt is the template's rendering of the whole chat, as a chat
    # API does; nothing is trained on, so no template has to render turns as extensions.
    return TokenSampler(client, tokenizer, sampling, seq_len, per_turn=True, tool_call_parser=cfg.inference.tool_call_parser)


def check_tool_parser(envs: list[tuple[str, Environment]], parser: str | None, setting: str) -> None:
    """(environment id, environment) pairs: one that defines tool schemas needs vLLM's
    tool-call parser (``prime_rl.registry.tool_parser_problem``); ConfigError otherwise."""
    for env_id, env in envs:
        if problem := tool_parser_problem(env_id, bool(env.tool_defs), parser, setting):
            raise ConfigError(problem)


def progress_bar(console: Console) -> Progress:
    """Rollouts done / total, one bar per task."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rollouts"), TimeElapsedColumn(),
        console=console,
    )
