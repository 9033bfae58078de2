"""What the built-in environments share: their arguments' checking and the held-out split.

- ``EnvArgs``: a built-in's ``load_environment(**args)`` arguments as a pydantic model (one per
  environment, the fields' docstrings document them). Unknown names and wrong types or values
  are refused in one line that names the environment, the argument and what it takes
  (``gsm8k: num_train_examples must be an integer >= 1 or -1 (all), got 0``). Types are
  strict, as the arguments come from TOML or JSON: ``"1"`` is not a seed, ``true`` not a count.
- ``held_out_split``: one list of rows (a file, a hub split) split into train and a disjoint
  eval set by a seeded shuffle.

Nothing here knows a particular environment.
"""

from __future__ import annotations

import difflib
import random
import types
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

R = TypeVar("R")


@dataclass(frozen=True)
class OrAll:
    """Field metadata: -1 is accepted too, meaning "all of them" (``Annotated[int, Field(ge=1), OrAll()]``)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        def all_or_checked(value: Any, check: Any) -> Any:
            return value if type(value) is int and value == -1 else check(value)

        return core_schema.no_info_wrap_validator_function(all_or_checked, handler(source))


CountOrAll = Annotated[int, Field(ge=1), OrAll()]
"""A number of examples: at least one, or -1 for all."""
EvalCountOrAll = Annotated[int, Field(ge=0), OrAll()]
"""A number of held-out examples: none or more, or -1 for all (or the environment's default share)."""
Source = Literal["auto", "hub", "generated"]
"""Where rows come from (``prime_rl.envs.load_rows``): the hub when it answers, else generated."""


class EnvArgs(BaseModel):
    """A built-in's arguments; subclasses set ``env`` (its id, which starts every message)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)
    env: ClassVar[str]

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Self:
        """The checked arguments, or one ValueError line with every problem."""
        try:
            return cls.model_validate(args)
        except ValidationError as e:
            problems = dict.fromkeys(cls._problem(error) for error in e.errors())
            raise ValueError(f"{cls.env}: {'; '.join(problems)}") from None

    @classmethod
    def _problem(cls, error: Any) -> str:
        name = str(error["loc"][0]) if error["loc"] else None
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(name), cls.model_fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"unknown argument {name!r}{hint}; it takes {', '.join(cls.model_fields)}"
        if name is None or name not in cls.model_fields:  # a check of several arguments together
            return error["msg"].removeprefix("Value error, ")
        return f"{name} must be {expected(cls.model_fields[name])}, got {error['input']!r}"



class TrainCountArgs(EnvArgs):
    """Arguments of a built-in that takes `num_examples` as verifiers' other name for
    `num_train_examples` (subclasses declare both fields, each with its default)."""

    @model_validator(mode="after")
    def _one_train_count(self) -> Self:
        given, default = self.num_train_examples, type(self).model_fields["num_train_examples"].default
        if self.num_examples is not None and given not in (default, self.num_examples):
            raise ValueError(f"num_examples is another name for num_train_examples; give one, "
                             f"got {self.num_examples} and {given}")
        return self

    @property
    def train_count(self) -> int:
        return self.num_train_examples if self.num_examples is None else self.num_examples

def expected(field: FieldInfo) -> str:
    """What a field takes, in words: ``an integer >= 1 or -1 (all)``, ``'boxed' or 'hash'``."""
    kinds, metadata = [], list(field.metadata)
    for kind in _union_members(field.annotation):
        if get_origin(kind) is Annotated:  # e.g. `CountOrAll | None`: the member's own bounds
            kind, *inner = get_args(kind)
            metadata += [m for i in inner for m in (i.metadata if isinstance(i, FieldInfo) else [i])]
        if kind is not type(None):
            kinds.append(kind)
    if len(kinds) == 1 and get_origin(kinds[0]) is Literal:
        return _either([repr(v) for v in get_args(kinds[0])])
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    what = _either([words.get(k, getattr(k, "__name__", str(k))) for k in kinds])
    bounds = {type(m): m for m in metadata}
    low, high = bounds.get(annotated_types.Ge), bounds.get(annotated_types.Le)
    if low is not None and high is not None:
        what += f" from {low.ge} to {high.le}"
    elif low is not None:
        what += f" >= {low.ge}"
    elif high is not None:
        what += f" <= {high.le}"
    if annotated_types.Gt in bounds:
        what += f" > {bounds[annotated_types.Gt].gt}"
    if OrAll in bounds:
        what += " or -1 (all)"
    return what


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _either(options: list[str]) -> str:
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def held_out_split(rows: list[R], num_eval: int, seed: int, env: str, what: str = "rows", share: int = 10) -> tuple[list[R], list[R]]:
    """(train, eval) of one list of rows: a shuffle seeded by ``env`` and ``seed`` orders them,
    the first ``num_eval`` are held out (-1: one in ``share``, at least one) and the rest are
    train, both in the shuffled order (so taking the first N train rows is a seeded sample).
    ``what`` names the rows in the error when too few are left for training."""
    n_eval = max(1, len(rows) // share) if num_eval == -1 else num_eval
    if len(rows) <= n_eval:
        raise ValueError(f"{env}: {len(rows)} {what}, not more than num_eval_examples={n_eval}")
    order = list(range(len(rows)))
    random.Random(f"{env}/split/{seed}").shuffle(order)
    return [rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]]
