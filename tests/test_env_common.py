"""What the built-in environments share (orchestrator/envs/common.py): the argument models'
one-line errors and the seeded held-out split."""

from typing import ClassVar, Literal, Self

import pytest
from pydantic import Field, model_validator

from orchestrator.envs.common import CountOrAll, EnvArgs, EvalCountOrAll, held_out_split


class ToyArgs(EnvArgs):
    env: ClassVar[str] = "toy"
    count: CountOrAll = -1
    held_out: EvalCountOrAll = 0
    turns: int = Field(3, ge=2)
    level: int = Field(2, ge=1, le=3)
    power: float = Field(4.0, gt=0)
    flag: bool = False
    mode: Literal["plain", "xml"] = "plain"
    prompt: str | None = None
    limit: CountOrAll | None = None

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.held_out > 10:
            raise ValueError(f"need held_out <= 10, got {self.held_out}")
        return self


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"count": 0}, "toy: count must be an integer >= 1 or -1 (all), got 0"),
        ({"count": -2}, "toy: count must be an integer >= 1 or -1 (all), got -2"),
        ({"count": True}, "toy: count must be an integer >= 1 or -1 (all), got True"),
        ({"count": "5"}, "toy: count must be an integer >= 1 or -1 (all), got '5'"),
        ({"held_out": -3}, "toy: held_out must be an integer >= 0 or -1 (all), got -3"),
        ({"turns": 1}, "toy: turns must be an integer >= 2, got 1"),
        ({"level": 4}, "toy: level must be an integer from 1 to 3, got 4"),
        ({"power": 0}, "toy: power must be a number > 0, got 0"),
        ({"power": float("nan")}, "toy: power must be a number > 0, got nan"),
        ({"flag": "yes"}, "toy: flag must be true or false, got 'yes'"),
        ({"mode": "json"}, "toy: mode must be 'plain' or 'xml', got 'json'"),
        ({"prompt": 3}, "toy: prompt must be a string, got 3"),
        ({"limit": 0}, "toy: limit must be an integer >= 1 or -1 (all), got 0"),
        ({"held_out": 11}, "toy: need held_out <= 10, got 11"),
        ({"turn": 5}, "toy: unknown argument 'turn' (did you mean 'turns'?); it takes count, held_out, turns, "
                      "level, power, flag, mode, prompt, limit"),
        ({"colour": 1}, "toy: unknown argument 'colour'; it takes count, held_out, turns, level, power, flag, mode, "
                        "prompt, limit"),
        ({"turns": 0, "mode": "x"}, "toy: turns must be an integer >= 2, got 0; mode must be 'plain' or 'xml', got 'x'"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it_and_what_it_takes(args, message):
    with pytest.raises(ValueError) as e:
        ToyArgs.parse(args)
    assert str(e.value) == message
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no pydantic traceback behind it


def test_good_arguments_parse_with_their_defaults():
    args = ToyArgs.parse({"count": -1, "limit": -1, "power": 2, "prompt": ""})
    assert (args.count, args.limit, args.power, args.prompt, args.turns, args.mode) == (-1, -1, 2.0, "", 3, "plain")
    assert isinstance(args.power, float)
    assert ToyArgs.parse({}) == ToyArgs()


def test_held_out_split_is_disjoint_seeded_and_sized():
    rows = [f"row{i}" for i in range(50)]
    train, held = held_out_split(rows, 7, seed=0, env="toy")
    assert len(held) == 7 and len(train) == 43 and sorted(train + held) == sorted(rows)
    assert held_out_split(rows, 7, seed=0, env="toy") == (train, held)  # the same seed, the same split
    assert held_out_split(rows, 7, seed=1, env="toy")[1] != held  # another seed, another one
    assert held_out_split(rows, 7, seed=0, env="other")[1] != held  # and each environment its own
    # both sets come in the shuffled order: the first N train rows are a seeded sample, not the file's head
    assert train != [r for r in rows if r not in held]
    # -1: one in `share`, at least one
    assert [len(held_out_split(rows, -1, 0, "toy", share=s)[1]) for s in (10, 5)] == [5, 10]
    assert len(held_out_split(rows[:3], -1, 0, "toy")[1]) == 1
    assert held_out_split(rows, 0, 0, "toy")[1] == []


def test_held_out_split_leaves_something_to_train_on():
    with pytest.raises(ValueError, match="^toy: 3 questions, not more than num_eval_examples=3$"):
        held_out_split([1, 2, 3], 3, 0, "toy", "questions")
    with pytest.raises(ValueError, match="^toy: 1 rows, not more than num_eval_examples=1$"):
        held_out_split([1], -1, 0, "toy")
