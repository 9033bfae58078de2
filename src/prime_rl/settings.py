"""Config layering: model defaults, then TOML/JSON files, then dotted CLI flags.

Every config field is a flag: `max_steps` -> `--max-steps 10`, `trainer.optim.lr` ->
`--trainer.optim.lr 1e-5`, booleans also as `--flag` / `--no-flag`. Values stay strings
and pydantic converts them (so `--max-steps ten` fails naming the field). Errors come
out as one line per problem naming the key and its section.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import tomllib
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, get_args, get_origin

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that must not start a run; the message is ready for the user."""


MAX_CONFIG_DEPTH = 64
"""Most levels of tables and arrays inside each other a config may have. Real configs go about
five deep; far deeper input breaks what walks it recursively further on (tomllib's parser and
pydantic's serializer after a few hundred levels, ``repr`` near 1,000) with a traceback instead
of this one-line error."""


def read_config_file(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        data = json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid {kind}: {e}") from None
    except RecursionError:  # both parsers recurse once per level of nesting
        raise ConfigError(f"{path}: not valid {kind}: {_too_deep()}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a {kind} object of settings at the top level, got {type(data).__name__}")
    check_nesting(data, str(path))
    return data


def check_nesting(data: Any, source: str) -> None:
    """ConfigError when tables or arrays in ``data`` nest more than ``MAX_CONFIG_DEPTH`` deep."""
    problem = nesting_problem(data)
    if problem:
        raise ConfigError(f"{source}: {problem}")


def nesting_problem(data: Any) -> str | None:
    """What is wrong when tables or arrays in ``data`` nest more than ``MAX_CONFIG_DEPTH``
    levels deep (naming the first keys above the deep part, e.g. `env.0.args`), else None.
    Walks iteratively: it must not recurse itself."""
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(data, 0, ())]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            return f"`{'.'.join(where)}`: {_too_deep()}" if where else _too_deep()
        named = (lambda key: (*where, str(key))) if len(where) < 3 else (lambda key: where)
        if isinstance(value, dict):
            stack.extend((v, depth + 1, named(k)) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((v, depth + 1, named(i)) for i, v in enumerate(value))
    return None


def _too_deep() -> str:
    return f"tables or arrays nested more than {MAX_CONFIG_DEPTH} levels deep"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_flags(args: list[str]) -> dict[str, Any]:
    """`--a.b-c 1 --flag --no-other` -> {"a": {"b_c": "1"}, "flag": True, "other": False}."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r} (flags look like --section.key value)")
        key, eq, inline = arg[2:].partition("=")
        if eq:
            value: Any = inline
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 1
        elif key.startswith("no-"):
            key, value = key[3:], False
        else:
            value = True
        if isinstance(value, str) and value[:1] in "[{":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
            except RecursionError:
                raise ConfigError(f"flag --{key}: {_too_deep()}") from None
        parts = [p.replace("-", "_") for p in key.split(".")]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"flag --{key} conflicts with an earlier flag")
        node[parts[-1]] = value
        i += 1
    check_nesting(tree, "flags")  # `--a.a.a...` and JSON values alike
    return tree


def format_validation_error(error: ValidationError, source: str = "config") -> str:
    lines = []
    seen: set[tuple[str, str]] = set()  # a shared field copied into sections fails once per copy
    for err in error.errors():
        signature = (err["msg"], _input_repr(err.get("input")))
        if signature in seen:
            continue
        seen.add(signature)
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc)
        section = ".".join(loc[:-1]) or "top level"
        if err["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key `{loc[-1]}` in [{section}]")
        elif err["type"] == "missing":
            lines.append(f"{source}: missing required key `{key}`")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            shown = "" if isinstance(given, dict | list) or not loc else f" (got {given!r})"
            lines.append(f"{source}: {key or 'config'}: {msg}{shown}")
    return "\n".join(lines)


def _input_repr(given: Any) -> str:
    try:
        return repr(given)
    except RecursionError:  # input nested too deeply to show: compare it by identity
        return f"<{type(given).__name__} at {id(given):#x}>"


def load_config(cls: type[M], files: list[Path], flags: list[str]) -> M:
    """Defaults < files (in order) < flags; raises ConfigError with one line per problem."""
    data: dict[str, Any] = {}
    for path in files:
        data = deep_merge(data, read_config_file(path))
    data = deep_merge(data, parse_flags(flags))
    source = " + ".join([str(f) for f in files] + (["flags"] if flags else [])) or "defaults"
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    except ValueError as e:  # raised outside field validation (e.g. shared-field conflicts)
        raise ConfigError(f"{source}: {e}") from None


def split_argv(argv: list[str]) -> tuple[list[Path], list[str]]:
    """Leading positional arguments are config files; the rest are flags."""
    files = []
    i = 0
    while i < len(argv) and not argv[i].startswith("--"):
        files.append(Path(argv[i]))
        i += 1
    return files, argv[i:]


def help_text(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per field: `--dotted.flag  TYPE  default  docstring`."""
    lines = []
    for name, field in cls.model_fields.items():
        flag = f"{prefix}{name}".replace("_", "-")
        nested = _model_type(field.annotation)
        if nested is not None:
            if field.description:
                lines.append(f"[{flag}] {field.description}")
            lines.extend(help_text(nested, prefix=f"{prefix}{name}."))
            continue
        default = "" if field.is_required() else f" (default: {field.default!r})"
        lines.append(f"  --{flag}{default}\n      {field.description or ''}")
    return lines


def _model_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None and get_origin(annotation) is not list:
        for arg in get_args(annotation):
            found = _model_type(arg)
            if found is not None:
                return found
    return None


def process_config(cls: type[M], argv: list[str]) -> M:
    """Entry of a single process: `python -m trainer.rl [CONFIG...] [--flags]` (JSON or TOML)."""
    files, flags = split_argv(argv)
    rest, args = [], iter(flags)
    for arg in args:  # also accept `--config PATH` and `--config=PATH`, anywhere among the flags
        name, eq, inline = arg.partition("=")
        if name != "--config":
            rest.append(arg)
            continue
        path = inline if eq else next(args, "")
        if not path or (not eq and path.startswith("--")):
            raise ConfigError("--config: expected the path of a config file (JSON or TOML)")
        files.append(Path(path))
    return load_config(cls, files, rest)


def run_process(
    name: str, cls: type[M], body: Callable[[M], None], argv: list[str] | None = None,
    expected: tuple[type[BaseException], ...] = (),
) -> int:
    """Entry point of a process: parse its config, run ``body``, map the outcome to an exit
    code (``run_entry``; ``expected`` failures end in one line, no traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    return run_entry(name, lambda: body(process_config(cls, argv)), expected)


def run_entry(
    name: str,
    body: Callable[[], int | None],
    expected: tuple[type[BaseException], ...] = (),
    usage_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Run an entry point's ``body`` and map how it ended to the process's exit code, the same
    way for every process (trainer, orchestrator, eval, gepa, sft):

    - its own code when it returns one (e.g. 130 from a search that saved its results), else 0;
    - 2, its message on stderr, when it fails with a ``ConfigError`` or one of ``usage_errors``
      (what the user must fix first), also inside exception groups;
    - 130 on Ctrl-C (and SIGTERM, where the entry point turns it into KeyboardInterrupt);
    - 1 for ``expected`` failures (a peer missing or misbehaving, a disk full): each message
      once, one line, no traceback;
    - 1 for anything else: the traceback, then one line saying why.
    """
    try:
        return body() or 0
    except KeyboardInterrupt:
        print(f"[{name}] interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - the process ends here; say why
        errors = leaf_errors(e)
        usage = (ConfigError, *usage_errors)
        if all(isinstance(err, usage + expected) for err in errors):
            for message in dict.fromkeys(str(err) if isinstance(err, ConfigError) else f"error: {one_line(err)}"
                                         for err in errors):
                print(f"[{name}] {message}", file=sys.stderr, flush=True)
            return 2 if all(isinstance(err, usage) for err in errors) else 1
        traceback.print_exc()
        print(f"[{name}] failed: {type(e).__name__}: {one_line(e)}", file=sys.stderr, flush=True)
        return 1


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` the way the interpreter would, minus its module teardown:
    the interpreter's own first steps (``threading._shutdown``: thread pools told to stop,
    other threads but daemons joined; then the atexit handlers), output flushed, then
    ``os._exit``. Freeing every module of torch and transformers one object at a time takes
    0.5-1.3 s here (docs/machine_facts.md, "process exit"), which every run's end and every
    test of a process would wait for, for memory the kernel takes back at once anyway."""
    threading._shutdown()  # what Py_FinalizeEx calls first; joining threads by hand would hang on live pools
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    os._exit(code)


def leaf_errors(error: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, e.g. from a TaskGroup of rollouts."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaf_errors(inner)]
    return [error]


def one_line(error: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__
