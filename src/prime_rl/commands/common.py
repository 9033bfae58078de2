"""Glue the commands share: output folders, placement, `--resume-step`, help generated from
the config fields, and the options of `prime-rl eval` and `prime-rl gepa` (a short flag per
setting; the help of each is its field's documentation and default)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from prime_rl.config import EvalRunConfig, GepaRunConfig, RLConfig, check_env_args
from prime_rl.launch.deployment import QUIET, Placement, PlacementError, plan_single_node, server_spec, write_config
from prime_rl.launch.launcher import ProcessSpec
from prime_rl.rundir import output_dir_problem
from prime_rl.settings import ConfigError, deep_merge, format_validation_error, help_text, parse_flags, read_config_file


def planned(config: RLConfig, gpus: int) -> Placement:
    try:
        return plan_single_node(config, gpus)
    except PlacementError as e:
        raise ConfigError(str(e)) from None


def take_resume_step(argv: list[str]) -> tuple[list[str], int | None]:
    """Remove `--resume-step N` (or `--resume-step=N`) from argv; returns the rest and N."""
    rest, step = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--resume-step" or arg.startswith("--resume-step="):
            value = arg.partition("=")[2] if "=" in arg else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--resume-step: expected a checkpoint step (an integer >= 1), got {value!r}")
            step = int(value)
        else:
            rest.append(arg)
    return rest, step


RL_OUTPUT_DIR = "trainer.output_dir (--output-dir)"


OUTPUT_DIR = "output_dir (--output-dir)"


def checked_output_dir(path: Path, field: str, may_clean: bool = False) -> Path:
    """``path`` if it can hold a run: not a file, not under /proc, /sys or /dev, not `/`; with
    ``may_clean`` (an RL run's, which `--clean` empties) not the home folder, the project root
    or a folder above them either."""
    problem = output_dir_problem(path, may_clean)
    if problem is not None:
        raise ConfigError(f"{field}: {problem}")
    return Path(path)


def make_dir(path: Path, field: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{field}: cannot create the folder {str(path)!r} ({e.strerror or e})") from None


def new_run_dir(config: EvalRunConfig | GepaRunConfig) -> Path:
    """OUTPUT_DIR/runs/<run_id>, created (a fresh id unless `run_id` names one); a run id already
    used is refused. ``prime_rl.launch.resolve.in_run_dir`` then names the run by it."""
    output_dir = checked_output_dir(config.output_dir, OUTPUT_DIR)
    run_id = config.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = output_dir / "runs" / run_id
    if run_dir.exists():
        raise ConfigError(f"run_id: {str(run_dir)!r} exists already; choose another run_id or leave it unset")
    make_dir(run_dir, OUTPUT_DIR)
    return run_dir


def load_run_config(cls, argv: list[str], options: dict, entries: str, usage: str):
    """`prime-rl eval` and `prime-rl gepa`: CONFIG.toml, or ENV_ID as the one ``entries``
    entry, then the command's options and dotted flags."""
    first = argv[0]
    if first.startswith("-"):
        raise ConfigError(f"expected an environment id or a config file first, got {first!r}: {usage}")
    flags, entry = option_flags(argv[1:], options)
    if Path(first).suffix in (".toml", ".json"):
        data, source = read_config_file(Path(first)), first
    else:
        data, source = {entries: [{"id": first}]}, "command line"
    data = deep_merge(data, parse_flags(flags))
    if entry:
        merge_into_entry(data, entry, source, entries, entry_options(options, entry))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def option_flags(args: list[str], options: dict) -> tuple[list[str], dict[str, Any]]:
    """Options (`-n 4`, `--max-tokens 64`, `-s`) -> dotted flags; options of the environment
    entry (`entry.*`: `-a JSON`, `--system-prompt-file F`) -> that entry's fields. Other dotted
    flags (`--inference.port 8123`) pass through."""
    names = {name: setting for option, setting in options.items() for name in option.split("/")}
    flags: list[str] = []
    entry: dict[str, Any] = {}
    args = iter(args)
    for arg in args:
        name, eq, inline = arg.partition("=")
        if name not in names:
            flags.append(arg)
            continue
        setting = names[name]
        if setting == "save-results":  # a switch: never takes the next argument as its value
            flags.append(f"--save-results={inline or 'true'}")
            continue
        value = inline if eq else next(args, None)
        if value is None:
            raise ConfigError(f"{name}: expected a value")
        if setting == "entry.args":
            entry["args"] = parse_env_args(value)
        elif setting.startswith("entry."):
            entry[entry_field(setting)] = value
        else:
            flags += [f"--{setting}", value]
    return flags, entry


def parse_env_args(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"-a/--env-args: not valid JSON ({e}): {value[:200]!r}") from None
    except RecursionError:  # json recurses once per level of nesting
        raise ConfigError("-a/--env-args: not valid JSON: objects or arrays nested too deeply") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"-a/--env-args: expected a JSON object of load_environment() arguments, got {value!r}")
    try:  # Python's json takes NaN and Infinity (and 1e999 becomes inf): refused here, naming the key
        return check_env_args(parsed)
    except ValueError as e:
        raise ConfigError(f"-a/--env-args: {e}") from None


def entry_options(options: dict, entry: dict[str, Any]) -> str:
    """The options that set ``entry``'s fields, for messages (`-a/--env-args`)."""
    return ", ".join(o for o, setting in options.items() if setting.startswith("entry.") and entry_field(setting) in entry)


def entry_field(setting: str) -> str:
    """`entry.system-prompt-file` -> `system_prompt_file`."""
    return setting.removeprefix("entry.").replace("-", "_")


def merge_into_entry(data: dict[str, Any], entry: dict[str, Any], source: str, entries_key: str, options: str) -> None:
    """The entry options (`-a`, `--system-prompt-file`) go to the only [[eval]] / [[env]] entry
    (with several, it would be ambiguous); `-a` merges into its args."""
    entries = data.get(entries_key)
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        count = len(entries) if isinstance(entries, list) else 0
        raise ConfigError(f"{options}: {source} has {count} [[{entries_key}]] entries; set them in each entry instead")
    target = entries[0]
    for field, value in entry.items():
        if field == "args":
            key = "env_args" if "env_args" in target else "args"
            target[key] = {**(target.get(key) or {}), **value}
        else:
            target[field] = value


def served_process_specs(config: EvalRunConfig | GepaRunConfig, run_dir: Path, name: str, module: str) -> list[ProcessSpec]:
    """The command's process on the terminal; for a local model, vLLM (logged) beside it."""
    python = sys.executable
    quiet = {**QUIET, "OMP_NUM_THREADS": "1"}
    specs = []
    if config.target.type == "local":  # no CUDA_VISIBLE_DEVICES of its own: the devices the command sees
        specs.append(server_spec(run_dir, "inference", config.inference, (), python))
    path = write_config(run_dir, name, config.model_dump(mode="json"))
    specs.append(ProcessSpec(name, [python, "-m", module, "--config", str(path)], env=quiet, terminal=True))
    return specs


def print_options_help(usage: str, description: str, options: dict[str, str], cls: type[BaseModel], entries: str) -> None:
    """The command's options, each with its setting's documentation and default (so the help
    follows the config), then every setting as a flag."""
    print(f"usage: {usage}\n")
    print(textwrap.fill(description, width=100))
    print("\noptions:")
    for option, setting in options.items():
        field = setting_field(cls, setting.replace("entry.", f"{entries}.", 1))
        default = "" if field.is_required() or field.default in (None, {}, []) else f" (default: {field.default!r})"
        sets = f"the [[{entries}]] entry's {entry_field(setting)}" if setting.startswith("entry.") else f"--{setting}"
        print(f"  {option}  ({sets})\n      {field.description or ''}{default}")
    print("\nEvery setting is a TOML key and a flag (kebab-case, dotted by section):\n")
    print("\n".join(help_text(cls)))


def setting_field(cls: type[BaseModel], setting: str) -> FieldInfo:
    """The field a dotted setting names (`gepa.max-calls`; `eval.args`, a list's entries)."""
    *sections, name = setting.replace("-", "_").split(".")
    for section in sections:
        annotation = cls.model_fields[section].annotation
        if get_origin(annotation) is list:
            (annotation,) = get_args(annotation)
        cls = annotation
    return cls.model_fields[name]


def print_help(usage: str, cls, extra: dict[str, str]) -> None:
    print(f"usage: {usage}\n\nEvery setting is a TOML key and a flag (kebab-case, dotted by section):\n")
    print("\n".join(help_text(cls)))
    for flag, doc in extra.items():
        print(f"  {flag}\n      {doc}")
