"""`prime-rl gepa ENV_ID|CONFIG.toml`: a system prompt optimized with GEPA."""

from __future__ import annotations

from prime_rl.commands.common import load_run_config, new_run_dir, print_options_help, served_process_specs
from prime_rl.config import GepaRunConfig
from prime_rl.extras import import_extra
from prime_rl.launch.launcher import run
from prime_rl.launch.resolve import in_run_dir, resolve_gepa

GEPA_OPTIONS: dict[str, str] = {
    # option -> the setting it sets (its help is that field's documentation and default);
    # `entry.*` sets the field of the one [[env]] entry
    "-m/--model": "model",
    "-M/--reflection-model": "reflection-model",
    "-B/--max-calls": "gepa.max-calls",
    "-n/--num-train": "gepa.num-train",
    "-N/--num-val": "gepa.num-val",
    "--minibatch-size": "gepa.minibatch-size",
    "--perfect-score": "gepa.perfect-score",
    "--state-columns": "gepa.state-columns",
    "-a/--env-args": "entry.args",
    "--system-prompt-file": "entry.system-prompt-file",
    "--python": "entry.python",
    "-t/--max-tokens": "sampling.max-tokens",
    "-T/--temperature": "sampling.temperature",
}
GEPA_USAGE = "prime-rl gepa ENV_ID|CONFIG.toml [options] [--dotted.flags ...]"


def main(argv: list[str]) -> int:
    """`prime-rl gepa`: resolve both models, then run the gepa process (and, for a local model,
    a vLLM server beside it) under the launcher, the gepa process on the terminal."""
    if not argv or "--help" in argv or "-h" in argv:
        print_options_help(GEPA_USAGE, "Optimizes an environment's system prompt with GEPA: a teacher model reads evaluation "
                           "results and proposes prompts; a Pareto frontier is kept over validation examples.",
                           GEPA_OPTIONS, GepaRunConfig, "env")
        return 0
    import_extra("gepa", "prime-rl gepa")  # before any server starts
    config = resolve_gepa(load_run_config(GepaRunConfig, argv, GEPA_OPTIONS, "env", GEPA_USAGE))
    run_dir = new_run_dir(config)
    config = in_run_dir(config, run_dir)
    return run(run_dir, served_process_specs(config, run_dir, "gepa", "orchestrator.gepa"), use_tmux=False,
               session_name="", exit_code_from="gepa")
