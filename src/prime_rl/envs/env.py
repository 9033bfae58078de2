"""Environment base classes: the rollout loop, exact-token bookkeeping and scoring.

Users subclass ``SingleTurnEnv`` (one model call, then the rubric) or ``MultiTurnEnv``
(implement ``env_response`` and, if the episode can end early, ``is_completed``). The loop,
the per-turn tokens and the scoring belong to the base class:

    state = initial_state(example); setup_state(state)
    loop:   reply = model(messages, tools)                # exact tokens of this turn kept
            messages += [assistant reply]
            stop if is_completed(messages, state) or max_turns reached
            messages += env_response(messages, state)     # in the sequence, out of the loss
    score = rubric(prompt, completion, answer, info, state, ...); teardown_state(state)

The first model call of a group is one request for all of its rollouts (they share the
prompt); each rollout then continues on its own. An environment never sees tokenizers,
sampling settings or the trainer: it talks to a ``ModelClient``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prime_rl.envs.parser import Parser
from prime_rl.envs.rubric import Rubric
from prime_rl.envs.types import Example, Messages, ModelClient, ModelReply, PromptTooLong, Rollout, State

DatasetLike = Iterable[Mapping[str, Any] | Example] | Callable[[], Iterable[Mapping[str, Any] | Example]]
"""A list of rows (dicts), an HF ``datasets.Dataset``, or a zero-argument function building one."""


class Environment:
    """A dataset of examples, a rubric that scores rollouts, and the rollout loop."""

    max_turns: int = 1
    tool_defs: list[dict[str, Any]] = []
    """OpenAI tool schemas offered to the model on every call (``ToolEnv`` fills them)."""
    runs_programs: bool = True
    """Whether an episode may start processes (a sandboxed tool call, a program a reward
    runs). The orchestrator's episode limiter then starts this environment's first episodes
    a group at a time and measures their memory before it lets many run at once (its slow
    start, ``orchestrator.load``). An environment whose episodes never do sets it False: they
    hold nothing outside the orchestrator's own memory, and a whole step starts at once. One
    built on such an environment whose episodes do start programs sets it back to True."""

    def __init__(
        self,
        dataset: DatasetLike | None = None,
        eval_dataset: DatasetLike | None = None,
        system_prompt: str | None = None,
        few_shot: Messages | None = None,
        parser: Parser | None = None,
        rubric: Rubric | None = None,
        max_turns: int | None = None,
    ):
        if dataset is None and eval_dataset is None:
            raise ValueError("an environment needs a `dataset` (or at least an `eval_dataset`)")
        self.system_prompt = system_prompt
        self.few_shot = list(few_shot or [])
        self.parser = parser if parser is not None else (rubric.parser if rubric is not None else Parser())
        self.rubric = rubric if rubric is not None else Rubric(parser=self.parser)
        if max_turns is not None:
            self.max_turns = max_turns
        self.dataset: list[Example] = self.format_dataset(dataset) if dataset is not None else []
        self.eval_dataset: list[Example] | None = self.format_dataset(eval_dataset) if eval_dataset is not None else None
        if not self.eval_dataset:
            self.eval_dataset = None  # no eval split: evaluation uses the training examples

    # ----------------------------------------------------------------------- data

    def format_dataset(self, rows: DatasetLike) -> list[Example]:
        """Rows -> examples: a row has `prompt` (messages) or `question` (a string), and
        optionally `answer`, `info` (a dict or its JSON) and `task`. The system prompt and
        few-shot messages go first unless the prompt already starts with a system message."""
        if callable(rows) and not isinstance(rows, Sequence):
            rows = rows()
        examples = []
        for index, row in enumerate(rows):
            examples.append(row if isinstance(row, Example) else self._example(index, row))
        return examples

    def _example(self, index: int, row: Mapping[str, Any]) -> Example:
        if row.get("prompt") is not None:
            prompt = [dict(m) for m in row["prompt"]]
        elif row.get("question") is not None:
            prompt = [{"role": "user", "content": str(row["question"])}]
        else:
            raise ValueError(f"dataset row {index} has neither `prompt` (messages) nor `question`: keys {sorted(row)}")
        if not prompt or prompt[0].get("role") != "system":
            head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            prompt = head + [dict(m) for m in self.few_shot] + prompt
        info = row.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info) if info.strip() else {}
        answer, task = row.get("answer"), row.get("task")
        return Example(index, prompt, "" if answer is None else str(answer), dict(info), "default" if task is None else str(task))

    def use_system_prompt(self, prompt: str) -> None:
        """Replace the system prompt, in every example already built too (a prompt optimized
        by `prime-rl gepa`, given as `[[env]] system_prompt_file`)."""
        self.system_prompt = prompt
        self.dataset = [with_system_prompt(e, prompt) for e in self.dataset]
        if self.eval_dataset is not None:
            self.eval_dataset = [with_system_prompt(e, prompt) for e in self.eval_dataset]

    def eval_examples(self, n: int = -1) -> list[Example]:
        """The first ``n`` examples of the eval split (all when ``n`` < 0); the training split
        when the environment has no eval split."""
        examples = self.eval_dataset if self.eval_dataset is not None else self.dataset
        return list(examples if n < 0 else examples[:n])

    # ----------------------------------------------------------------------- rollouts

    def initial_state(self, example: Example) -> State:
        """A fresh state: the example's fields (copies, so a rollout may change them), the
        number of model turns so far, the completion messages and the model's replies."""
        return {
            "example_id": example.id,
            "prompt": copy.deepcopy(example.prompt),
            "answer": example.answer,
            "info": copy.deepcopy(example.info),
            "task": example.task,
            "turn": 0,
            "completion": [],
            "responses": [],
        }

    async def rollout(self, client: ModelClient, example: Example) -> Rollout:
        return (await self.rollout_group(client, example, 1))[0]

    async def rollout_group(self, client: ModelClient, example: Example, n: int) -> list[Rollout]:
        """``n`` scored rollouts of one example; the first turn is one request with ``n`` replies."""
        try:
            first = await client.reply(example.prompt, [], n, **self._offered_tools())
        except PromptTooLong:
            first = [None] * n
        return list(await asyncio.gather(*(self._play(client, example, reply) for reply in first)))

    def _offered_tools(self) -> dict[str, Any]:
        # only tool environments pass `tools`, so clients written before tools still work
        return {"tools": self.tool_defs} if self.tool_defs else {}

    async def _play(self, client: ModelClient, example: Example, reply: ModelReply | None) -> Rollout:
        state = await maybe_await(self.setup_state(self.initial_state(example)))
        try:
            return await self._play_and_score(client, example, reply, state)
        finally:
            await maybe_await(self.teardown_state(state))

    async def _play_and_score(self, client: ModelClient, example: Example, reply: ModelReply | None, state: State) -> Rollout:
        messages = list(example.prompt)
        turns, stop = [], "prompt_too_long"
        while reply is not None:
            # the model's turn: its exact tokens are kept, its message joins the conversation
            messages.append(reply.message())
            if reply.turn is not None:
                turns.append(reply.turn)
            state["turn"] += 1
            state["responses"].append(reply)
            state["completion"] = messages[len(example.prompt):]
            # stop conditions: the environment's, then the turn budget
            stop = await self.stop_condition(messages, state)
            if stop is not None:
                break
            # the environment's turn: its messages are in the sequence, out of the loss
            messages.extend(await self._env_response(messages, state))
            state["completion"] = messages[len(example.prompt):]
            try:
                (reply,) = await client.reply(messages, turns, 1, **self._offered_tools())
            except PromptTooLong:
                stop = "prompt_too_long"
                reply = None
        state["completion"] = messages[len(example.prompt):]
        score = await self.rubric.score(state)
        metrics = {**score.metrics, **self.rollout_metrics(state)}
        return Rollout(
            example_id=example.id,
            turns=turns,
            reward=score.reward,
            prompt=list(example.prompt),
            completion=state["completion"],
            metrics=metrics,
            errors=score.errors,
            stop_condition=stop,
            finish_reason=state["responses"][-1].finish_reason if state["responses"] else None,
            state=state,
        )

    async def stop_condition(self, messages: Messages, state: State) -> str | None:
        """`completed` when ``is_completed`` says so, `max_turns` once the budget is used."""
        if await maybe_await(self.is_completed(messages, state)):
            return "completed"
        if 0 < self.max_turns <= state["turn"]:
            return "max_turns"
        return None

    async def _env_response(self, messages: Messages, state: State) -> Messages:
        result = await maybe_await(self.env_response(messages, state))
        if isinstance(result, tuple):  # the classic API returned (messages, state)
            result, new_state = result
            if new_state is not None and new_state is not state:
                state.update(new_state)
        if isinstance(result, dict):
            result = [result]
        if not isinstance(result, list) or not all(isinstance(m, dict) and "role" in m for m in result):
            raise TypeError(f"{type(self).__name__}.env_response must return a list of messages, got {result!r}")
        return result

    # ----------------------------------------------------------------------- hooks

    def setup_state(self, state: State) -> State:
        """Called once per rollout before its first turn is processed (sync or async)."""
        return state

    def teardown_state(self, state: State) -> None:
        """Called once per rollout after it is scored, also when it failed (sync or async):
        release what ``setup_state`` acquired (a scratch directory, a connection)."""

    def close(self) -> None:
        """Release what the environment holds for the whole run (a worker process); the
        orchestrator, eval and GEPA call it once at the end."""

    def rollout_metrics(self, state: State) -> dict[str, float]:
        """Metrics the environment itself counts (tool calls, errors), beside the rubric's."""
        return {}

    def is_completed(self, messages: Messages, state: State) -> bool:
        """True once the episode is over (sync or async); checked after every model turn,
        before ``env_response`` (so a game that ends on the model's move ends here)."""
        return False

    def env_response(self, messages: Messages, state: State) -> Messages:
        """The environment's reply to the model's last message (sync or async)."""
        raise NotImplementedError(f"{type(self).__name__} must implement env_response(messages, state)")


class SingleTurnEnv(Environment):
    """One model call per rollout, then the rubric."""

    def __init__(self, **kwargs: Any):
        kwargs.pop("max_turns", None)
        super().__init__(max_turns=1, **kwargs)


class MultiTurnEnv(Environment):
    """A conversation: implement ``env_response`` (and ``is_completed`` if it can end before
    ``max_turns``; ``max_turns`` <= 0 means no limit but the model's context)."""

    def __init__(self, max_turns: int = 10, **kwargs: Any):
        super().__init__(max_turns=max_turns, **kwargs)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def with_system_prompt(example: Example, prompt: str) -> Example:
    """The example with ``prompt`` as its system message (replacing the one it has, if any)."""
    messages = [dict(m) for m in example.prompt]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = prompt
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return dataclasses.replace(example, prompt=messages)
