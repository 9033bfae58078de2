"""Writing environments for prime-rl: the one import users need.

    from prime_rl.envs import SingleTurnEnv, MultiTurnEnv, ToolEnv, Rubric, XMLParser

    def load_environment(**args) -> Environment: ...

Modelled on the classic verifiers API (datasets of `prompt`/`question` + `answer` rows, a
rubric of reward functions that receive the arguments they name, `env_response` and
`is_completed` for multi-turn). This package imports neither torch, vLLM nor the
orchestrator: the orchestrator drives environments through ``ModelClient``.
See docs/environments.md.
"""

from prime_rl.envs.data import DatasetUnavailable, load_rows
from prime_rl.envs.env import Environment, MultiTurnEnv, SingleTurnEnv
from prime_rl.envs.parser import Parser, ThinkParser, XMLParser
from prime_rl.envs.rubric import Rubric, Score
from prime_rl.envs.tools import StatefulToolEnv, ToolEnv, tool_schema
from prime_rl.envs.types import (
    Example,
    Messages,
    ModelClient,
    ModelReply,
    PromptTooLong,
    Rollout,
    State,
    ToolCall,
    Turn,
)

__all__ = [
    "DatasetUnavailable",
    "Environment",
    "Example",
    "Messages",
    "ModelClient",
    "ModelReply",
    "MultiTurnEnv",
    "Parser",
    "PromptTooLong",
    "Rollout",
    "Rubric",
    "Score",
    "SingleTurnEnv",
    "State",
    "StatefulToolEnv",
    "ThinkParser",
    "ToolCall",
    "ToolEnv",
    "Turn",
    "XMLParser",
    "load_rows",
    "tool_schema",
]
