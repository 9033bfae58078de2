"""What a run directory keeps (docs/failures.md, "What a run directory keeps"): the trainer's
real checkpoint and weight saves and the orchestrator's real record pruning over a simulated
run, checked against the rule written out after every save. A 1,000-step soak found
`weights/step_960` left beside checkpoints 980 and 1000: the last checkpoint pruned 960, and
no weights save came after it to prune its weights."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from orchestrator.progress import prune_records
from prime_rl.config import OptimConfig, TrainerConfig
from prime_rl.heartbeat import Heartbeat
from prime_rl.rundir import checkpoints_dir, complete_steps, rollouts_dir, weights_dir, write_step_dir
from trainer.ckpt import checkpoint_due
from trainer.model import World
from trainer.optim import build_optimizer
from trainer.rl import checkpoint
from trainer.weights import save_weights


@dataclass
class Seen:
    """What the rule needs of the run so far."""

    checkpoints: list[int] = field(default_factory=list)  # every checkpoint written, in order
    weights: int = 0  # the newest policy version published (0: the initial model, no folder)
    record: int = -1  # the newest orchestrator record (-1: none yet)
    checkpoints_at_record: list[int] = field(default_factory=list)  # kept when it was saved


def kept(seen: Seen, keep_ckpt: int, keep_weights: int) -> dict[str, list[int]]:
    """The rule (docs/failures.md): the newest `ckpt.keep_last` checkpoints; the newest
    `trainer.weights.keep_last` weights and those of every kept checkpoint; the records from the
    one before the oldest checkpoint kept when the newest record was saved, up to that record."""
    checkpoints = seen.checkpoints[-keep_ckpt:]
    newest = range(max(1, seen.weights - keep_weights + 1), seen.weights + 1)
    oldest = seen.checkpoints_at_record[-keep_ckpt:][:1]
    first = oldest[0] - 1 if oldest else 0
    return {"checkpoints": checkpoints, "weights": sorted({*newest, *checkpoints}),
            "rollouts": list(range(max(0, first), seen.record + 1))}


def on_disk(run: Path) -> dict[str, list[int]]:
    return {"checkpoints": complete_steps(checkpoints_dir(run)), "weights": complete_steps(weights_dir(run)),
            "rollouts": complete_steps(rollouts_dir(run))}


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def simulate(run: Path, steps: int, interval: int, keep_ckpt: int, keep_weights: int, async_level: int) -> dict:
    """The trainer's loop in `trainer.rl.train`'s order (checkpoint step k before training it,
    weights k + 1 after; the last checkpoint after the loop), with an orchestrator as far ahead
    as `async_level` allows, saving each step's record and pruning as it does; the rule holds
    after every save. Returns the end state."""
    cfg = TrainerConfig.model_validate({"output_dir": str(run), "max_steps": steps,
                                        "ckpt": {"interval": interval, "keep_last": keep_ckpt},
                                        "weights": {"keep_last": keep_weights}})
    model = tiny_model()
    optimizer, scheduler = build_optimizer(model, OptimConfig())
    world, heartbeat = World(0, 1, 0, torch.device("cpu")), Heartbeat(run, "trainer", enabled=False)
    seen = Seen()

    def check() -> None:
        assert on_disk(run) == kept(seen, keep_ckpt, keep_weights), seen

    def orchestrator() -> None:  # records every step the newest weights allow (policy >= step - async_level)
        while seen.record + 1 < steps and seen.record + 1 - async_level <= seen.weights:
            seen.record += 1
            write_step_dir(rollouts_dir(run), seen.record, "record", lambda tmp: None)
            prune_records(run)
            seen.checkpoints_at_record = complete_steps(checkpoints_dir(run))
            check()

    orchestrator()
    for step in range(steps):
        if step > 0 and checkpoint_due(step, interval, steps):
            checkpoint(model, optimizer, scheduler, cfg, step, world, heartbeat)
            seen.checkpoints.append(step)
            check()
        save_weights(model, run, step + 1, keep_weights)
        seen.weights = step + 1
        check()
        orchestrator()
    if checkpoint_due(steps, interval, steps):
        checkpoint(model, optimizer, scheduler, cfg, steps, world, heartbeat)
        seen.checkpoints.append(steps)
        check()
    return on_disk(run)


@pytest.mark.parametrize(
    "steps, interval, keep_ckpt, keep_weights, async_level, end",
    [
        # the 1,000-step quickstart soak's shape (interval 20 above weights' keep_last 3, the last
        # step a checkpoint's): it ends with checkpoints 980 and 1000, weights 980 and 998-1000
        # (960 was left too, before the fix), records 959-999
        (20, 4, 2, 3, 1, {"checkpoints": [16, 20], "weights": [16, 18, 19, 20], "rollouts": list(range(11, 20))}),
        # a last step off the interval gets its checkpoint too; one weights folder kept beside them
        (23, 5, 2, 1, 2, {"checkpoints": [20, 23], "weights": [20, 23], "rollouts": list(range(9, 23))}),
        # keep_last above the count of checkpoints: nothing of theirs is pruned
        (12, 4, 5, 2, 1, {"checkpoints": [4, 8, 12], "weights": [4, 8, 11, 12], "rollouts": list(range(3, 12))}),
    ],
)
def test_a_run_keeps_exactly_what_keep_last_says(tmp_path, steps, interval, keep_ckpt, keep_weights, async_level, end):
    assert simulate(tmp_path / "run", steps, interval, keep_ckpt, keep_weights, async_level) == end
