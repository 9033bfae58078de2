"""Write the warm-up SFT data: an environment's prompts with correct replies.

    python scripts/make_sft_data.py OUT.jsonl [--env reverse-text] [--num-examples 2000]
                                    [--seed N] [--args '{"answer_format": "hash"}']

One `{"messages": [...]}` per line, drawn from the environment's own generator (same
prompt format as RL), with a different seed than RL's default so the warm-up does not
simply memorize the RL prompts:

- reverse-text: `[system, user, assistant]`, the reversed text as the reply (seed 1; RL: 0);
- alphabet-sort: the whole conversation (every turn's correct sorted list and the
  follow-ups between them; seed 1337421, RL: 1337420);
- gsm8k: generated problems (unless `--args` names a `source` or `data_path`) with their
  worked solution ending in the requested answer format, `\\boxed{N}` or `#### N`
  (seed 1; RL: 0);
- wordle: whole winning games played by a fixed deterministic strategy (`wordle.demonstration`:
  opener `slate`, then the first common word consistent with all feedback so far), the
  env's feedback messages between the guesses; the few games it loses in six guesses are
  skipped, so there may be slightly fewer chats than `--num-examples`. Seed 0, as RL's: every
  game has the same prompt, the seed only draws the secret words, and RL's seed keeps its
  eval words out of the demonstrations.

- wiki-search: whole tool-using episodes (`wiki_search.demonstration`: search_pages(name),
  view_sections(page_id), read_section(section_id) with their real outputs, then the answer),
  each line with the environment's tool schemas (`"tools"`), over generated wikis of
  corpus seeds 1, 2, ... (RL's default wiki is corpus seed 0): other pages and facts than RL's,
  so the warm-up teaches the tool path, not the answers;
- math-python: a `python` tool call computing the answer, its real sandboxed output, then
  `\\boxed{N}` (`math_python.demonstration`; seed 1, RL: 0).

`--args` takes the environment's arguments as JSON (as `args` in an `[[env]]` entry); the
seed is `--seed`, not an entry of `--args`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ENVS = ("reverse-text", "alphabet-sort", "gsm8k", "wordle", "wiki-search", "math-python")
# RL's defaults: 0, 1337420, 0, 0, corpus 0, 0
DEFAULT_SEEDS = {"reverse-text": 1, "alphabet-sort": 1337421, "gsm8k": 1, "wordle": 0, "wiki-search": 1, "math-python": 1}


def sft_chats(num_examples: int, seed: int, args: dict | None = None) -> list[dict]:
    """reverse-text chats: the prompt and the reversed text."""
    from orchestrator.envs.reverse_text import load_environment

    env = load_environment(**{**(args or {}), "num_examples": num_examples, "seed": seed})
    return [
        {"messages": [*example.prompt, {"role": "assistant", "content": example.answer}]} for example in env.dataset
    ]


def alphabet_sort_chats(num_examples: int, seed: int, args: dict) -> list[dict]:
    from orchestrator.envs.alphabet_sort import demonstration, load_environment

    env = load_environment(**{"num_eval_examples": 0, **args, "num_examples": num_examples, "seed": seed})
    return [{"messages": demonstration(example)} for example in env.dataset]


def gsm8k_chats(num_examples: int, seed: int, args: dict) -> list[dict]:
    from orchestrator.envs.gsm8k import demonstration, load_environment

    defaults = {"num_eval_examples": 0}
    if "data_path" not in args:
        defaults["source"] = "generated"
    env = load_environment(**{**defaults, **args, "num_train_examples": num_examples, "seed": seed})
    return [{"messages": demonstration(example)} for example in env.dataset]


def wordle_chats(num_examples: int, seed: int, args: dict) -> list[dict]:
    """Winning games of the first `num_examples` secret words (games the strategy loses are
    skipped). The eval split keeps the env's default size, so that with RL's seed and args
    the demonstrations never play RL's eval words."""
    from orchestrator.envs.wordle import common_words, demonstration, load_environment, read_words

    env = load_environment(**{**args, "num_train_examples": num_examples, "seed": seed})
    words = read_words(args["words_path"]) if args.get("words_path") else common_words()
    games = (demonstration(example, words, env) for example in env.dataset)
    return [{"messages": game} for game in games if game is not None]


def wiki_search_chats(num_examples: int, seed: int, args: dict) -> list[dict]:
    from orchestrator.envs.wiki_search import demonstration, load_environment

    chats: list[dict] = []
    corpus_seed = seed
    while len(chats) < num_examples:
        env = load_environment(**{**args, "source": "generated", "corpus_seed": corpus_seed, "num_eval_examples": 0})
        for example in env.dataset:
            messages = demonstration(example, env)
            if messages is not None and len(chats) < num_examples:
                chats.append({"messages": messages, "tools": env.tool_defs})
        corpus_seed += 1
    return chats


def math_python_chats(num_examples: int, seed: int, args: dict) -> list[dict]:
    from orchestrator.envs.math_python import demonstration, load_environment

    env = load_environment(**{"source": "generated", **args, "num_train_examples": num_examples, "seed": seed})
    chats = [{"messages": demonstration(example), "tools": env.tool_defs} for example in env.dataset]
    return [chat for chat in chats if chat["messages"] is not None]


def chats_for(env: str, num_examples: int, seed: int, args: dict) -> list[dict]:
    if env == "wiki-search":
        return wiki_search_chats(num_examples, seed, args)
    if env == "math-python":
        return math_python_chats(num_examples, seed, args)
    if env == "reverse-text":
        return sft_chats(num_examples, seed, args)
    if env == "alphabet-sort":
        return alphabet_sort_chats(num_examples, seed, args)
    if env == "wordle":
        return wordle_chats(num_examples, seed, args)
    return gsm8k_chats(num_examples, seed, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="JSONL file to write")
    parser.add_argument("--env", choices=ENVS, default="reverse-text", help="environment (default reverse-text)")
    parser.add_argument("--num-examples", type=int, default=2000, help="number of chats")
    parser.add_argument("--seed", type=int, default=None, help="generator seed (default: RL's default + 1; wordle: RL's own)")
    parser.add_argument("--args", type=json.loads, default={}, help="environment args as a JSON object")
    args = parser.parse_args()
    if not isinstance(args.args, dict):
        parser.error(f"--args must be a JSON object, got {args.args!r}")
    if "seed" in args.args:
        parser.error("give the seed with --seed, not in --args")
    if "num_examples" in args.args or "num_train_examples" in args.args:
        parser.error("give the number of chats with --num-examples, not in --args")
    if args.num_examples < 1:
        parser.error(f"--num-examples must be >= 1, got {args.num_examples}")
    seed = DEFAULT_SEEDS[args.env] if args.seed is None else args.seed
    try:
        chats = chats_for(args.env, args.num_examples, seed, args.args)
    except (TypeError, ValueError, RuntimeError) as e:  # bad --args, or data that cannot be loaded
        parser.error(str(e) if str(e).startswith(args.env) else f"{args.env}: {e}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")  # readers never see a half-written file
    with open(tmp, "w") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    os.replace(tmp, args.output)
    lost = args.num_examples - len(chats)  # wordle: games the demonstration strategy lost
    skipped = f" ({lost} games the strategy lost skipped)" if lost > 0 else ""
    print(f"wrote {len(chats)} chats to {args.output}{skipped}")


if __name__ == "__main__":
    main()
