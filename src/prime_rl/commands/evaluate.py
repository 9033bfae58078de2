"""`prime-rl eval ENV_ID|CONFIG.toml`: a model's scores on environments' eval splits."""

from __future__ import annotations

from pathlib import Path

from prime_rl.commands.common import load_run_config, new_run_dir, print_options_help, served_process_specs
from prime_rl.config import EvalRunConfig
from prime_rl.launch.launcher import ProcessSpec, run
from prime_rl.launch.resolve import in_run_dir, resolve_eval

EVAL_OPTIONS: dict[str, str] = {
    # option -> the setting it sets (its help is that field's documentation and default);
    # `entry.*` sets the field of the one [[eval]] entry
    "-m/--model": "model",
    "-n/--num-examples": "num-examples",
    "-r/--rollouts-per-example": "rollouts-per-example",
    "-a/--env-args": "entry.args",
    "--system-prompt-file": "entry.system-prompt-file",
    "--python": "entry.python",
    "-t/--max-tokens": "sampling.max-tokens",
    "-T/--temperature": "sampling.temperature",
    "-s/--save-results": "save-results",
}
EVAL_USAGE = "prime-rl eval ENV_ID|CONFIG.toml [options] [--dotted.flags ...]"


def main(argv: list[str]) -> int:
    """`prime-rl eval`: validate, resolve the model, then run the eval process (and, for a local
    model, a vLLM server beside it) under the launcher, the eval process on the terminal."""
    if not argv or "--help" in argv or "-h" in argv:
        print_eval_help()
        return 0
    config = resolve_eval(load_eval_config(argv))
    run_dir = new_run_dir(config)
    config = in_run_dir(config, run_dir)
    return run(run_dir, eval_process_specs(config, run_dir), use_tmux=False, session_name="", exit_code_from="eval")


def load_eval_config(argv: list[str]) -> EvalRunConfig:
    """Defaults < CONFIG.toml (or one [[eval]] entry of ENV_ID) < options and dotted flags."""
    return load_run_config(EvalRunConfig, argv, EVAL_OPTIONS, "eval", EVAL_USAGE)


def eval_process_specs(config: EvalRunConfig, run_dir: Path) -> list[ProcessSpec]:
    return served_process_specs(config, run_dir, "eval", "orchestrator.eval")


def print_eval_help() -> None:
    print_options_help(
        EVAL_USAGE,
        "Evaluates a model on the eval splits of environments: ENV_ID (e.g. reverse-text) or a config with [[eval]] "
        "entries (configs/eval/*.toml). Prints a table per environment; exit code 0, 2 for a config error, 1 for a "
        "runtime failure.",
        EVAL_OPTIONS, EvalRunConfig, "eval",
    )
