"""Warm inference servers: `prime-rl inference CONFIG` keeps a run's vLLM servers up, and a
run of the same kind of model attaches to them instead of paying vLLM's start-up (35-60 s on
CPU, docs/machine_facts.md), loading its own weights into them first.

State files. One JSON file per server, ``SERVERS_DIR/<host>-<port>.json`` (``SERVERS_DIR`` is
``$PRIME_RL_SERVERS_DIR``, else ``~/.cache/prime-rl/servers``), written atomically once the
server answers /health and removed when it stops. It names the server (url, the launcher's
pid and start time), what it serves (model path, served name, the model's config.json without
the fields that do not shape it, a digest of its tokenizer files, dtype, seq_len,
max_lora_rank, tool_call_parser, how many replicas were started together), whether it
requires an API key (never the key) and the config files it was started from. The servers'
logs and resolved configs live in ``SERVERS_DIR/<host>-<first port>/``, never in a run's
directory (a run's `--clean` would delete them).

The key. Every warm server requires one: without `inference.api_key`, `prime-rl inference`
draws one and writes it to ``SERVERS_DIR/<host>-<first port>/api_key`` (0600, the state
file names it); a run of the same user that attaches reads it there (``run_key``), others
cannot, so they can neither pause the server nor load other weights into it. Beyond loopback
a key must be given (``beyond_loopback``): runs on other machines cannot read that file.

Detection. A state file speaks for a live server when its launcher is alive (the same
process: started no later than the file says) and the port is held; a file whose launcher
is gone (SIGKILL) is stale and ignored, and the next server on that port overwrites it.
While a run uses a server it holds a lease, ``SERVERS_DIR/<host>-<port>.lease.json`` (its
launcher's pid and run directory, and a random token): a second run would overwrite the first
one's weights, so it is refused while the lease's launcher lives. Taking a lease and removing
one each happen under an exclusive lock (``flock`` on ``<host>-<port>.lease.lock``), so of
two runs attaching at once exactly one gets it, and a run removes the lease only while it
still holds its own token (``take_leases``).

What attaching checks is pure (``attach_decision``, ``refusals``) and tested with hand-made
states; the rest reads files, processes and ports. This module knows no vLLM and no httpx:
it speaks HTTP with urllib (the health route, and the identity proof of ``prime_rl.keys``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict, ValidationError

from prime_rl.config import InferenceConfig, RLConfig, _is_loopback
from prime_rl.registry import declares_tools
from prime_rl.launch.deployment import Replica
from prime_rl.keys import IDENTITY_PATH, new_nonce, proves_identity
from prime_rl.launch.ports import try_bind
from prime_rl.launch.resolve import attached
from prime_rl.rundir import weights_step_dir, write_json_atomic
from prime_rl.settings import ConfigError
from prime_rl.tokenizer import TOKENIZER_FILES, tokenizer_digest

SERVERS_DIR_ENV = "PRIME_RL_SERVERS_DIR"

# config.json fields that do not shape the model: where and by what it was saved, its saved
# dtype (the server's dtype is compared instead), the generation cache switch.
UNSHAPING_FIELDS = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype", "use_cache"})



class ServerState(BaseModel):
    """One warm server, as its state file holds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    host: str
    port: int
    replica: int
    replicas: int
    """Servers started together by one `prime-rl inference` (its [deployment]'s replicas)."""
    pid: int
    """The `prime-rl inference` launcher's pid; its children are the server's process group."""
    started_unix: float
    model: str
    served_model_name: str
    """The name requests use."""
    architecture: dict[str, Any]
    tokenizer_sha256: str
    dtype: str
    seq_len: int
    max_lora_rank: int | None
    tool_call_parser: str | None
    api_key_set: bool
    weight_transfer: str = "directory"
    """`weight_transfer.mode` it was started with: `memory` runs the transfer engine (state files
    written before it existed are of servers without it)."""
    config: list[str]
    """The config files the server was started from, resolved."""
    log: str
    key_file: str | None = None
    """Where the key `prime-rl inference` drew lies (no `inference.api_key` given), readable by
    its user only; None: the key came from the config, and runs bring it in theirs."""


@dataclass(frozen=True)
class Found:
    """What holds one of the run's inference ports: a live warm server, or why not."""

    port: int
    state: ServerState | None
    why_not: str = ""
    """Empty for a live server; else `no state file ...`, `its launcher (pid N) is gone`, ..."""

    @property
    def live(self) -> bool:
        return self.state is not None and not self.why_not


@dataclass(frozen=True)
class RunNeeds:
    """What a run needs of a server it attaches to (``run_needs`` builds it from the config)."""

    model: str
    architecture: dict[str, Any]
    tokenizer_sha256: str
    dtype: str
    seq_len: int
    lora: bool
    tool_call_parser: str | None
    tool_env: str | None
    api_key_set: bool
    weight_transfer: str = "directory"


# --------------------------------------------------------------------------- where, and the model's fingerprint


def servers_dir() -> Path:
    return Path(os.environ.get(SERVERS_DIR_ENV) or Path.home() / ".cache" / "prime-rl" / "servers").expanduser()


def state_path(host: str, port: int, directory: Path | None = None) -> Path:
    return (directory or servers_dir()) / f"{host}-{port}.json"


def lease_path(host: str, port: int, directory: Path | None = None) -> Path:
    return (directory or servers_dir()) / f"{host}-{port}.lease.json"


def server_dir(host: str, port: int, directory: Path | None = None) -> Path:
    """The logs and resolved configs of the servers started together, by their first port."""
    return (directory or servers_dir()) / f"{host}-{port}"


def lease_lock_path(host: str, port: int, directory: Path | None = None) -> Path:
    return (directory or servers_dir()) / f"{host}-{port}.lease.lock"


def model_folder(model: str) -> Path:
    """A local model folder, or an HF id's snapshot (config and tokenizer files only, fetched
    if not cached: the trainer and vLLM fetch the rest)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["config.json", *TOKENIZER_FILES]))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, ...: one line either way
        raise ConfigError(f"model {model!r}: cannot read its config.json to compare it with a warm server's ({type(e).__name__}: {e})") from None


def architecture(folder: Path) -> dict[str, Any]:
    """config.json without the fields that do not shape the model."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder / 'config.json'}: unreadable ({e})") from None
    return {k: v for k, v in config.items() if k not in UNSHAPING_FIELDS}


# --------------------------------------------------------------------------- state files


def server_states(config: RLConfig, replicas: list[Replica], config_files: list[str], pid: int, log_dir: Path,
                  key_file: Path | None = None) -> list[ServerState]:
    """The state of each server `prime-rl inference` is about to start (written once healthy);
    ``key_file``: where its drawn key lies (``draw_key``)."""
    inference = config.inference
    folder = model_folder(inference.model)
    shape, tokenizer = architecture(folder), tokenizer_digest(folder)
    multi = len(replicas) > 1
    return [
        ServerState(
            url=r.url, host=r.host, port=r.port, replica=r.index, replicas=len(replicas), pid=pid, started_unix=time.time(),
            model=inference.model, served_model_name=inference.served_model_name or inference.model,
            architecture=shape, tokenizer_sha256=tokenizer, dtype=inference.dtype, seq_len=inference.seq_len,
            max_lora_rank=inference.max_lora_rank, tool_call_parser=inference.tool_call_parser,
            api_key_set=bool(inference.api_key), weight_transfer=inference.weight_transfer.mode,
            config=[str(Path(f).resolve()) for f in config_files],
            log=str(log_dir / f"{f'inference-{r.index}' if multi else 'inference'}.log"),
            key_file=str(key_file) if key_file is not None else None,
        )
        for r in replicas
    ]


def write_state(state: ServerState, directory: Path | None = None) -> Path:
    path = state_path(state.host, state.port, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, state.model_dump(mode="json"))
    return path


def read_state(path: Path) -> ServerState:
    """The state file at ``path``; ConfigError naming the file when it is unreadable."""
    try:
        return ServerState.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path}: not a warm server's state file ({first}); delete it if no server runs there") from None


def remove_state(state: ServerState, directory: Path | None = None) -> None:
    """Remove the state file, if it is still this server's (a later server may own the port now)."""
    path = state_path(state.host, state.port, directory)
    with contextlib.suppress(ConfigError, OSError):
        if read_state(path).pid == state.pid:
            path.unlink()


def process_alive(pid: int, started_by_unix: float) -> bool:
    """Whether ``pid`` runs and is the process that started by then (not a reused pid)."""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and process.create_time() <= started_by_unix + 1.0
    except psutil.Error:
        return False


def find_servers(replicas: list[Replica], directory: Path | None = None) -> list[Found]:
    """For each of the run's replicas (in order): the live warm server on its port, or why none."""
    found = []
    for r in replicas:
        path = state_path(r.host, r.port, directory)
        if not path.is_file():
            found.append(Found(r.port, None, f"no state file {path}"))
            continue
        state = read_state(path)
        if not process_alive(state.pid, state.started_unix):
            found.append(Found(r.port, state, f"its launcher (pid {state.pid}) is gone: {path} is stale"))
        elif try_bind(r.host, r.port) is None:
            found.append(Found(r.port, state, f"port {r.port} is free: the server of {path} is not up (yet)"))
        else:
            found.append(Found(r.port, state))
    return found


# --------------------------------------------------------------------------- the key

KEY_FILE = "api_key"


def beyond_loopback(inference: InferenceConfig) -> str | None:
    """The address beyond loopback a warm server would bind without a key (`inference.host`,
    or a `--host` in `extra_args`, which vLLM reads last); None when it has a key or stays on
    loopback. A drawn key cannot serve there: runs on other machines cannot read its file."""
    if inference.api_key:
        return None
    args, hosts = list(inference.extra_args), [inference.host]
    for arg, following in zip(args, [*args[1:], None]):
        if arg == "--host" and following is not None:
            hosts.append(following)
        elif arg.startswith("--host="):
            hosts.append(arg.partition("=")[2])
    return next((host for host in hosts if not _is_loopback(host)), None)


def draw_key(folder: Path) -> tuple[str, Path]:
    """A fresh key for a warm server started without one, written to ``folder/api_key``:
    created readable by its user only (0600 from the start, then renamed into place, so no
    moment exists when another user could open it)."""
    key, path = secrets.token_urlsafe(32), Path(folder) / KEY_FILE
    tmp = path.with_name(f".{KEY_FILE}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the warm server's drawn API key ({e.strerror or e})") from None
    return key, path


def read_key(path: Path) -> str:
    """The key in a warm server's key file; ConfigError naming the file when it is not a plain
    file of this user that only this user can read (anyone else may have planted it), or empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the API key the warm server drew ({e.strerror or e}); "
                          "set inference.api_key to the server's key") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigError(f"{path}: a warm server's key file must be a plain file of yours that only you can read "
                              "(mode 0600); restart `prime-rl inference`, or set inference.api_key")
        key = f.read(4096).strip()
    if not key:
        raise ConfigError(f"{path}: the warm server's key file is empty; restart `prime-rl inference`")
    return key


def run_key(config: RLConfig, states: list[ServerState]) -> str | None:
    """The key the run sends to the warm servers: its own (`inference.api_key`), else the one
    `prime-rl inference` drew for them (``draw_key``); None when neither exists."""
    own = config.orchestrator.client.api_key
    if own or not states or states[0].key_file is None:
        return own
    return read_key(Path(states[0].key_file))


# --------------------------------------------------------------------------- the decision (pure)


def attach_decision(setting: bool | None, found: list[Found], host: str) -> bool:
    """Whether the run attaches to warm servers (``setting`` is `inference.attach`, ``found``
    one entry per replica of the run); ConfigError when neither attaching nor starting our own
    can work."""
    live = [f for f in found if f.live]
    if setting is False:
        if live:
            f = live[0]
            raise ConfigError(
                f"inference.attach = false, but a warm server (`prime-rl inference`, pid {f.state.pid}) holds port {f.port} "
                f"on {host}: stop it, or drop `attach = false` to use it"
            )
        return False
    if not live:
        if setting:
            raise ConfigError(f"inference.attach = true, but no warm server serves {host}:{found[0].port} ({found[0].why_not}); "
                              "start one with `prime-rl inference CONFIG`")
        return False
    if len(live) < len(found):
        missing = [f for f in found if not f.live]
        raise ConfigError(
            f"[deployment] asks for {len(found)} inference replica(s) on ports {found[0].port}-{found[-1].port}, but no warm server "
            f"serves port {missing[0].port} ({missing[0].why_not}); start `prime-rl inference` with this run's [deployment]"
        )
    started = live[0].state.replicas
    if started != len(found):
        raise ConfigError(
            f"[deployment] asks for {len(found)} inference replica(s), but the warm servers on port {found[0].port} were "
            f"started as {started} (by `prime-rl inference {' '.join(live[0].state.config)}`): use the same [deployment]"
        )
    return True


def refusals(need: RunNeeds, state: ServerState) -> list[str]:
    """One line per reason the run cannot use the warm server ``state``; empty when it can.
    Other weights of the same architecture are fine: the run loads its own before sampling."""
    at = f"the warm server at {state.url}"
    lines = []
    if need.lora:
        lines.append(
            f"trainer.lora: a LoRA run cannot attach to {at}: its adapter needs its own base weights, and the server's "
            "may be another run's (it reloads no base weights under an adapter); stop the server or set inference.attach = false on other ports"
        )
    differ = sorted(k for k in need.architecture.keys() | state.architecture.keys()
                    if need.architecture.get(k) != state.architecture.get(k))
    if differ:
        shown = ", ".join(f"{k} {need.architecture.get(k)!r} vs {state.architecture.get(k)!r}" for k in differ[:4])
        lines.append(f"model {need.model!r} is another architecture than {state.model!r} of {at} (config.json: {shown})")
    if need.tokenizer_sha256 != state.tokenizer_sha256:
        lines.append(f"model {need.model!r} has another tokenizer than {state.model!r} of {at} (its tokenizer files differ)")
    if need.seq_len > state.seq_len:
        lines.append(f"seq_len {need.seq_len} exceeds the {state.seq_len} tokens of {at} (its --max-model-len)")
    if need.dtype != state.dtype:
        lines.append(f"inference.dtype {need.dtype!r} differs from the {state.dtype!r} of {at} (keep it equal to the trainer's)")
    if need.tool_call_parser is not None and need.tool_call_parser != state.tool_call_parser:
        what = f"environment {need.tool_env!r} calls tools with" if need.tool_env else "inference.tool_call_parser is"
        lines.append(f"{what} the {need.tool_call_parser!r} parser, but {at} runs {state.tool_call_parser or 'no tool-call parser'}")
    if state.api_key_set and not need.api_key_set:
        lines.append(f"{at} requires an API key and this run has none (set inference.api_key)")
    if need.weight_transfer == "memory" and state.weight_transfer != "memory":
        lines.append(f'weight_transfer.mode = "memory": {at} was started without the transfer engine; '
                     "start it with the same [weight_transfer] (a folder-mode run may use a memory-mode server)")
    if need.api_key_set and not state.api_key_set:
        lines.append(f"this run has an inference.api_key, but {at} runs without one: it cannot prove the key, so it is not sent there")
    return lines


# --------------------------------------------------------------------------- attaching


def run_needs(config: RLConfig, key: str | None) -> RunNeeds:
    """What the run needs of a server; ``key``: the one it would send (``run_key``)."""
    folder = model_folder(config.trainer.model.name)
    tool_envs = [env.id for env in config.orchestrator.env if declares_tools(env.id)]
    return RunNeeds(
        model=config.trainer.model.name, architecture=architecture(folder), tokenizer_sha256=tokenizer_digest(folder),
        dtype=config.inference.dtype, seq_len=config.inference.seq_len, lora=config.trainer.lora is not None,
        tool_call_parser=config.orchestrator.tool_call_parser, tool_env=tool_envs[0] if tool_envs else None,
        api_key_set=bool(key), weight_transfer=config.trainer.weight_transfer.mode,
    )


def check_attachable(config: RLConfig, states: list[ServerState], directory: Path | None = None, timeout_s: float = 10.0) -> None:
    """Every refusal of every server, one line each (ConfigError); then no other live run may
    hold a server, and each must prove it holds the run's API key before the run sends it. The
    lease is checked here to refuse early (a dry run too); ``take_leases`` takes it atomically."""
    key = run_key(config, states)
    need = run_needs(config, key)
    lines = [line for state in states for line in refusals(need, state)]
    for state in states:
        lease = read_lease(state, directory)
        if lease is not None and process_alive(lease["pid"], lease["started_unix"]):
            lines.append(in_use(state, lease))
    if key and not lines:
        lines += [f"the warm server at {s.url}: {why}" for s in states if (why := key_not_proven(s.url, key, timeout_s))]
    if lines:
        raise ConfigError("\n".join(lines))


def key_not_proven(url: str, key: str, timeout_s: float) -> str | None:
    """None when the server at ``url`` proves it holds ``key`` (the key itself is not sent),
    else why not."""
    nonce = new_nonce()
    try:
        with urllib.request.urlopen(f"{url}{IDENTITY_PATH}?nonce={nonce}", timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as e:
        return f"it answers the identity check with status {e.code}, so it does not hold this run's API key"
    except (OSError, ValueError) as e:
        return f"no identity proof ({type(e).__name__}: {e})"
    return None if proves_identity(key, nonce, answer) else "its identity proof is wrong: it holds another API key"


def attach(config: RLConfig, states: list[ServerState], run_dir: Path, resume_step: int | None) -> tuple[RLConfig, Path]:
    """The run pointed at the warm servers (the same URLs as the run's own would have; a copy,
    ``prime_rl.launch.resolve.attached``): requests name the served model, prompts use the run's
    tokenizer, and the run's starting weights are loaded first (its model, or `weights/step_N`
    on a resume), which it returns too."""
    key = run_key(config, states) if config.orchestrator.client.api_key is None else None  # the server's, when the run has none
    weights = Path(weights_step_dir(run_dir, resume_step) if resume_step is not None else model_folder(config.trainer.model.name))
    return attached(config, states[0].served_model_name, weights, key), weights


def in_use(state: ServerState, lease: dict[str, Any]) -> str:
    return (f"the warm server at {state.url} is in use by the run in {lease['run_dir']} (pid {lease['pid']}): "
            "two runs would overwrite each other's weights")


def read_lease(state: ServerState, directory: Path | None = None) -> dict[str, Any] | None:
    return _read_lease_file(lease_path(state.host, state.port, directory))


def _read_lease_file(path: Path) -> dict[str, Any] | None:
    """The lease at ``path``; None when there is none or it is damaged (then it counts as stale)."""
    try:
        lease = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(lease, dict) or not {"pid", "started_unix", "run_dir"} <= lease.keys():
        return None
    if type(lease["pid"]) is not int or not isinstance(lease["started_unix"], int | float):
        return None
    return lease


LEASE_LOCK_WAIT_S = 10.0
"""Most seconds to wait for another run's turn at a lease: each holds the lock for one small
read and write, so a longer wait means a stuck process."""


@contextlib.contextmanager
def _lease_lock(path: Path) -> Iterator[None]:
    """Hold ``path`` (flock, exclusive) while a lease is read and then written or removed:
    check-then-act on the lease file is then one step. The kernel drops the lock when its
    holder dies. Opened read-only: a lock file another user created still locks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ConfigError(f"{path}: cannot open the warm server's lease lock ({e.strerror or e})") from None
    try:
        deadline = time.monotonic() + LEASE_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"{path}: another process held the warm server's lease lock for "
                                      f"{LEASE_LOCK_WAIT_S:g} s; is a run stuck attaching?") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass(frozen=True)
class Lease:
    """One server's lease as this run took it; ``token`` tells it from any later run's."""

    path: Path
    lock: Path
    token: str

    def release(self) -> None:
        """Remove the lease if it is still this run's (it may have been taken over meanwhile:
        deleted or damaged by hand, then taken by another run); never fails the run's exit."""
        try:
            with _lease_lock(self.lock):
                holder = _read_lease_file(self.path)
                if holder is not None and holder.get("token") == self.token:
                    self.path.unlink()
        except (OSError, ConfigError) as e:
            print(f"[prime-rl] warning: the lease {self.path} was left in place ({e}); it lapses once this run's "
                  "launcher is gone", file=sys.stderr, flush=True)


class Leases:
    """The leases of every server a run attached to; a context manager that releases them."""

    def __init__(self, leases: list[Lease]):
        self.leases = leases

    def release(self) -> None:
        for lease in self.leases:
            lease.release()

    def __enter__(self) -> Leases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take_leases(states: list[ServerState], run_dir: Path, directory: Path | None = None) -> Leases:
    """Take each server's lease for this launcher (its pid, the run directory, a fresh token),
    or refuse in one line naming the live run that holds one (those taken are given back). A
    lease whose launcher is gone (or that cannot be read) is stale and taken over."""
    record = {"pid": os.getpid(), "started_unix": time.time(), "run_dir": str(Path(run_dir).resolve()),
              "token": secrets.token_hex(16)}
    taken = Leases([])
    try:
        for state in states:
            lease = Lease(lease_path(state.host, state.port, directory), lease_lock_path(state.host, state.port, directory),
                          record["token"])
            with _lease_lock(lease.lock):
                holder = _read_lease_file(lease.path)
                if holder is not None and process_alive(holder["pid"], holder["started_unix"]):
                    raise ConfigError(in_use(state, holder))
                try:
                    write_json_atomic(lease.path, record)
                except OSError as e:
                    raise ConfigError(f"{lease.path}: cannot write the warm server's lease ({e.strerror or e})") from None
            taken.leases.append(lease)
    except BaseException:
        taken.release()
        raise
    return taken


# --------------------------------------------------------------------------- serving


def healthy(state: ServerState, key: str | None, timeout_s: float = 5.0) -> bool:
    """Whether the server answers /health; with a key, only after proving it holds it."""
    if key and key_not_proven(state.url, key, timeout_s) is not None:
        return False
    request = urllib.request.Request(f"{state.url}/health", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


class ServerWatch:
    """Beside the launcher of `prime-rl inference`: writes each server's state file once it
    is healthy (``on_ready`` is told), and removes them all at ``stop``, after the servers
    stopped. A thread: the launcher's loop owns the main one."""

    def __init__(self, states: list[ServerState], key: str | None, on_ready: Callable[[ServerState, Path], None],
                 directory: Path | None = None, poll_s: float = 0.5):
        self.states, self.key, self.on_ready, self.directory, self.poll_s = states, key, on_ready, directory, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="warm-server-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        waiting = list(self.states)
        while waiting and not self._stop.wait(self.poll_s):
            for state in [s for s in waiting if healthy(s, self.key)]:
                if self._stop.is_set():
                    return
                self.on_ready(state, write_state(state, self.directory))
                waiting.remove(state)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for state in self.states:
            remove_state(state, self.directory)
        for key_file in {state.key_file for state in self.states if state.key_file}:
            with contextlib.suppress(OSError):  # the key goes with its servers
                Path(key_file).unlink()
