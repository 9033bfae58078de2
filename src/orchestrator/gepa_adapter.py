"""GEPA's adapter for an environment: a candidate is a system prompt, scored by the rubric.

The search itself (Pareto frontier over validation examples, reflective mutation by a
teacher model, the evaluation budget) is the maintained ``gepa`` package's. This module
supplies what it cannot know:

- ``evaluate``: run the environment's rollouts of a batch of examples with the candidate's
  system prompt in place of the environment's, score each with its rubric (the reward);
- ``make_reflective_dataset``: per rollout, what the teacher reads to propose a better
  prompt: the query, the completion, the expected answer, the reward, each rubric
  function's value, the functions that raised, and any extra state columns asked for.

GEPA calls both synchronously; the rollouts are async (the environments' protocol), so the
adapter owns one event loop and runs them there, all of a batch at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from gepa import EvaluationBatch
from prime_rl.envs import Environment, Example, ModelClient, Rollout
from prime_rl.envs.env import with_system_prompt

from orchestrator.traces import TraceWriter

COMPONENT = "system_prompt"
"""The one component GEPA evolves."""


class NoSystemPrompt(ValueError):
    """The environment has no system prompt to optimize."""


def seed_prompt(env: Environment, env_id: str) -> str:
    """The environment's own system prompt: GEPA's seed candidate."""
    if not env.system_prompt:
        raise NoSystemPrompt(
            f"environment {env_id!r} has no system prompt to optimize (its load_environment() sets none); "
            "give a seed prompt with --system-prompt-file (`[[env]] system_prompt_file`)"
        )
    return env.system_prompt


class EnvironmentAdapter:
    """``gepa.GEPAAdapter`` over one environment and one model client (a sampler)."""

    propose_new_texts = None
    """No proposer of our own: GEPA's reflective one asks the teacher model."""

    def __init__(self, env: Environment, client: ModelClient, state_columns: Sequence[str] = (), traces: TraceWriter | None = None,
                 env_name: str = ""):
        self.env = env
        self.client = client
        self.state_columns = tuple(state_columns)
        self.loop = asyncio.new_event_loop()
        self.metric_calls = 0
        """Rollouts run so far (GEPA's budget counts the same)."""
        self.traces, self.env_name = traces, env_name
        """Every evaluation's rollouts are traced (kind `gepa`, its ``step`` the evaluation's
        number, its ``candidate`` the prompt it tried); None = not traced."""
        self.evaluations = 0

    def close(self) -> None:
        self.loop.close()

    def evaluate(self, batch: list[Example], candidate: dict[str, str], capture_traces: bool = False) -> EvaluationBatch:
        prompt = candidate[COMPONENT]
        rollouts = self.loop.run_until_complete(self._rollouts([with_system_prompt(e, prompt) for e in batch]))
        self.metric_calls += len(batch)
        if self.traces is not None:
            self.traces.write(self.traces.lines(self.traces.group_rows(
                "gepa", self.evaluations, self.env_name, [[r] for r in rollouts], tag=self.env_name, candidate=prompt)))
        self.evaluations += 1
        traces = [self.trace(e, r) for e, r in zip(batch, rollouts)] if capture_traces else None
        return EvaluationBatch(outputs=rollouts, scores=[r.reward for r in rollouts], trajectories=traces)

    async def _rollouts(self, examples: list[Example]) -> list[Rollout]:
        return list(await asyncio.gather(*(self.env.rollout(self.client, e) for e in examples)))

    def trace(self, example: Example, rollout: Rollout) -> dict[str, Any]:
        """What the teacher may see of one rollout: the default columns, then the state columns."""
        row: dict[str, Any] = {
            "query": last_user_message(example.prompt),
            "completion": render_messages(rollout.completion),
            "answer": example.answer,
            "reward": rollout.reward,
            "metrics": dict(rollout.metrics),
            "error": ", ".join(rollout.errors),
        }
        for column in self.state_columns:
            row[column] = rollout.state.get(column)
        return row

    def make_reflective_dataset(
        self, candidate: dict[str, str], eval_batch: EvaluationBatch, components_to_update: list[str]
    ) -> dict[str, list[dict[str, Any]]]:
        """One record per rollout, in GEPA's default proposer's shape (Inputs, Generated
        Outputs, Feedback): the reward, the expected answer, every rubric value and error."""
        records = []
        for trace in eval_batch.trajectories or []:
            feedback = [f"reward {trace['reward']:.3f}"]
            if trace["answer"]:
                feedback.append(f"expected answer: {trace['answer']}")
            feedback += [f"{name} = {value:.3f}" for name, value in trace["metrics"].items()]
            if trace["error"]:
                feedback.append(f"rubric functions that raised: {trace['error']}")
            feedback += [f"{column}: {json.dumps(trace[column], default=str)}" for column in self.state_columns]
            records.append({"Inputs": trace["query"], "Generated Outputs": trace["completion"], "Feedback": "; ".join(feedback)})
        return {component: records for component in components_to_update}


def last_user_message(messages: Sequence[dict[str, Any]]) -> str:
    users = [m for m in messages if m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else ""


def render_messages(messages: Sequence[dict[str, Any]]) -> str:
    """A multi-turn completion as text: one `role: content` line per message."""
    return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages)
