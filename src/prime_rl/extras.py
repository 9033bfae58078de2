"""The optional extras: libraries only one feature uses, left out of a plain `uv sync`
(pyproject.toml's `[project.optional-dependencies]`).

A feature imports its library through ``import_extra``, which turns the library's absence into
one line naming the extra to install (``wiki-search needs bm25s: uv sync --extra wiki-search``;
a CUDA machine passes the same flag to ``scripts/setup_cuda.sh``, which hands it to uv sync).
The error is a ``ConfigError``: every process's entry point prints it as it is and exits 2, and
the orchestrator's environment loading passes it on as a load error of that environment.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from prime_rl.settings import ConfigError

EXTRAS: dict[str, tuple[str, str]] = {
    # import name -> (distribution, the extra that installs it)
    "math_verify": ("math-verify", "math"),
    "wordfreq": ("wordfreq", "wordle"),
    "bm25s": ("bm25s", "wiki-search"),
    "gepa": ("gepa", "gepa"),
    "peft": ("peft", "lora"),
}


class MissingExtra(ConfigError):
    """A feature's library is not installed; the message names the extra that installs it."""


def import_extra(module: str, feature: str) -> ModuleType:
    """``module`` (a key of ``EXTRAS``) imported, or ``MissingExtra`` saying that ``feature``
    needs it and which extra to sync. An ImportError from inside an installed library (a
    broken install) is left as it is: naming the extra would not fix it."""
    distribution, extra = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name != module:
            raise
        raise MissingExtra(f"{feature} needs {distribution}: uv sync --extra {extra} "
                           f"(a CUDA machine: bash scripts/setup_cuda.sh --extra {extra})") from None
