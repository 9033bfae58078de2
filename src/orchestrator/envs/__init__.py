"""Environments: a plain registry of shipped ids, plus users' own modules.

``REGISTRY`` maps an environment id to the module that defines ``load_environment``;
its keys must equal ``prime_rl.config.KNOWN_ENVIRONMENTS`` (tested), so the launcher
can validate ids without importing this package.
"""

from __future__ import annotations

import importlib

from prime_rl.config import EnvConfig, environment_name

from orchestrator.envs.base import Environment, Example, Rollout, SingleTurnEnv, Turn

__all__ = ["REGISTRY", "Environment", "Example", "Rollout", "SingleTurnEnv", "Turn", "load_env"]

REGISTRY: dict[str, str] = {
    "reverse-text": "orchestrator.envs.reverse_text",
}


def load_env(env_cfg: EnvConfig) -> Environment:
    """Known id (``primeintellect/`` prefix allowed) or an importable module path."""
    module_path = REGISTRY.get(environment_name(env_cfg.id), env_cfg.id)
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
    if not isinstance(env, Environment) or len(env.dataset) == 0:
        raise ValueError(
            f"environment {env_cfg.id!r}: load_environment() must return an object with a non-empty "
            "`dataset` and an async `rollout(client, example, sampling)`"
        )
    return env
