"""The built-in environments and how an `[[env]]` entry becomes an environment.

``REGISTRY`` maps each built-in id to its module; its keys must equal
``prime_rl.config.KNOWN_ENVIRONMENTS`` (tested), so the launcher can validate ids without
importing this package. Any other id names a user's module (``my-env`` -> ``my_env``),
which must define ``load_environment(**args)`` returning a ``prime_rl.envs.Environment``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from prime_rl.config import EnvConfig, environment_module, environment_name
from prime_rl.envs import DatasetUnavailable, Environment
from prime_rl.envs.sandbox import SandboxUnavailable

REGISTRY: dict[str, str] = {
    "reverse-text": "orchestrator.envs.reverse_text",
    "alphabet-sort": "orchestrator.envs.alphabet_sort",
    "gsm8k": "orchestrator.envs.gsm8k",
    "wordle": "orchestrator.envs.wordle",
    "wiki-search": "orchestrator.envs.wiki_search",
    "math-python": "orchestrator.envs.math_python",
}


def load_env(env_cfg: EnvConfig) -> Environment:
    """Built-in id (``primeintellect/`` prefix allowed) or a user's module; any problem is a
    ValueError naming the environment and what was expected."""
    module_path = REGISTRY.get(environment_name(env_cfg.id)) or environment_module(env_cfg.id)
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"environment {env_cfg.id!r}: cannot import module {module_path!r}: {e}") from e
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"environment {env_cfg.id!r}: module {module_path!r} has no load_environment()")
    try:
        env = load(**env_cfg.args)
    except TypeError as e:  # usually a wrong keyword in [[env]] args
        raise ValueError(f"environment {env_cfg.id!r}: load_environment(**{env_cfg.args!r}) failed: {e}") from e
    except (DatasetUnavailable, SandboxUnavailable) as e:
        raise ValueError(f"environment {env_cfg.id!r}: {e}") from e
    if not isinstance(env, Environment):
        raise ValueError(
            f"environment {env_cfg.id!r}: load_environment() returned {type(env).__name__}, expected a "
            "prime_rl.envs.Environment (SingleTurnEnv, MultiTurnEnv or a subclass)"
        )
    if not env.dataset and not env.eval_dataset:
        raise ValueError(f"environment {env_cfg.id!r}: load_environment() returned an environment with no examples")
    if env_cfg.system_prompt_file is not None:
        env.use_system_prompt(Path(env_cfg.system_prompt_file).read_text().strip())
    return env
