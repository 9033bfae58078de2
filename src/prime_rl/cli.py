"""The `prime-rl` command.

    prime-rl CONFIG.toml [--dotted.flags ...] [--no-tmux] [--dry-run] [--clean]   RL run (the trio)
    prime-rl CONFIG.toml --resume | --resume-step N [...]                        continue a run
    prime-rl inference CONFIG.toml [--dotted.flags ...] [--no-tmux]               a warm vLLM server that runs attach to
    prime-rl sft CONFIG.toml [--dotted.flags ...]                                 supervised fine-tuning
    prime-rl eval ENV_ID|CONFIG.toml [-m MODEL] [-n N] [-r R] [-s] [...]          evaluate a model
    prime-rl gepa ENV_ID|CONFIG.toml [-m MODEL] [-M REFLECTION_MODEL] [...]       optimize a system prompt (GEPA)
    prime-rl export RUN_DIR [--step N] [--merge] [--output DIR]                   a run's weights, standalone
    prime-rl report RUN [RUN ...] [--output FILE] [--label NAME ...]              a run's curves as a PNG, runs overlaid
    prime-rl dashboard [RUN ...] [--port N] [--host H]                           a live web page of runs and their rollouts
    prime-rl [inference|sft|eval|gepa] --help                                     every setting, with its doc

Configs are validated, and model paths checked, before any process starts; a bad
config exits with code 2 and one line per problem. The resolved config of each
process is written to RUN/configs/ and is what that process reads.

Each command is a module of ``prime_rl.commands`` with ``main(argv) -> exit code``; this
module only picks it (``COMMANDS``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from prime_rl.commands import evaluate
from prime_rl.commands import dashboard, export, gepa, inference, report, rl, sft
from prime_rl.commands.evaluate import load_eval_config  # noqa: F401 - the eval command's config, for tests and scripts
from prime_rl.launch.resolve import resolve_eval  # noqa: F401 - likewise
from prime_rl.settings import ConfigError


def slurm_node(argv: list[str]) -> int:
    """`prime-rl slurm-node RUN/slurm/rl.json`: one node of a SLURM job (the job script runs it)."""
    from prime_rl.launch.slurm import node_main

    return node_main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "rl": rl.main,  # also the default: `prime-rl CONFIG.toml`
    "inference": inference.main,
    "sft": sft.main,
    "eval": evaluate.main,
    "gepa": gepa.main,
    "export": export.main,
    "report": report.main,
    "dashboard": dashboard.main,
    "slurm-node": slurm_node,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = COMMANDS.get(argv[0]) if argv else None
    try:
        sys.exit(command(argv[1:]) if command is not None else rl.main(argv))
    except ConfigError as e:
        print(f"prime-rl: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
