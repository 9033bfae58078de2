"""Write the warm-up SFT data: reverse-text chats with the reference answer as the reply.

    python scripts/make_sft_data.py OUT.jsonl [--num-examples 2000] [--seed 1]

One `{"messages": [system, user, assistant]}` per line, drawn from the reverse-text
environment's own generator (same prompt format as RL), with a different seed than
RL's default 0 so the warm-up does not simply memorize the RL prompts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from orchestrator.envs.reverse_text import load_environment


def sft_chats(num_examples: int, seed: int) -> list[dict]:
    env = load_environment(num_examples=num_examples, seed=seed)
    return [
        {"messages": [*example.prompt, {"role": "assistant", "content": example.answer}]} for example in env.dataset
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="JSONL file to write")
    parser.add_argument("--num-examples", type=int, default=2000, help="number of chats")
    parser.add_argument("--seed", type=int, default=1, help="generator seed (RL data uses 0)")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")  # readers never see a half-written file
    with open(tmp, "w") as f:
        for chat in sft_chats(args.num_examples, args.seed):
            f.write(json.dumps(chat) + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {args.num_examples} chats to {args.output}")


if __name__ == "__main__":
    main()
