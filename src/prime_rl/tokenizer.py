"""A model's tokenizer: its files, and the tokenizer `AutoTokenizer` gives, loaded without
importing torch where the class it picks is already known.

- ``TOKENIZER_FILES``, ``tokenizer_digest``: the files that make a model folder's tokenizer
  (``trainer.weights`` carries them into every ``weights/step_N``; a warm server compares
  their digest with a run's).
- ``load_tokenizer(name)``: ``AutoTokenizer.from_pretrained(name)``, with the class it picked
  remembered for a local folder.

Why remember the class: to pick it, AutoTokenizer imports ``transformers.models.auto``, which
imports torch, torch._dynamo and transformers' model code. Here that is 4 of the 5 s that
`from transformers import AutoTokenizer` takes, in an orchestrator that needs no torch
(docs/machine_facts.md, "A tokenizer without torch"); the class itself imports in about 1 s.
So the first load of a local folder asks AutoTokenizer and records the class it picked, under
a key of everything that choice reads: the name as given, the folder's file names, its
config.json and tokenizer files, transformers' version. A later load under the same key
imports that class and calls its ``from_pretrained``, the call AutoTokenizer ends with. Only
transformers' own classes are recorded (a model's remote code is asked for every time), and
hub ids always go through AutoTokenizer. The records live in ``$PRIME_RL_CACHE/tokenizers``,
else ``~/.cache/prime-rl/tokenizers``: one small JSON file a key, safe to delete.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)


def tokenizer_digest(folder: Path) -> str:
    """sha256 over the tokenizer files present (name and bytes)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def classes_dir() -> Path:
    """Where the picked classes are recorded: ``$PRIME_RL_CACHE/tokenizers``, else
    ``~/.cache/prime-rl/tokenizers``."""
    base = os.environ.get("PRIME_RL_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "prime-rl") / "tokenizers"


def choice_key(name: str, folder: Path) -> str:
    """A digest of what AutoTokenizer reads to pick a local folder's class: transformers'
    version, ``name`` as given (its patterns match the name), the folder's file names (a file's
    presence picks some backends), config.json and the tokenizer files."""
    digest = hashlib.sha256()
    digest.update(importlib.metadata.version("transformers").encode() + b"\0" + name.encode() + b"\0")
    digest.update("\0".join(sorted(p.name for p in folder.iterdir())).encode() + b"\0")
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes() + b"\0")
    digest.update(tokenizer_digest(folder).encode())
    return digest.hexdigest()


def recorded_class(record: Path) -> type | None:
    """The class a record names, imported; None where there is no usable record."""
    try:
        found = json.loads(record.read_text())
        module, qualname = found["module"], found["class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(module, str) or not module.startswith("transformers.") or not isinstance(qualname, str):
        return None
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        return None
    return cls if callable(getattr(cls, "from_pretrained", None)) else None


def record_class(record: Path, cls: type) -> None:
    """Records ``cls`` (a transformers class) through a file of this process's own and a
    rename; a cache that cannot be written costs the next load its time, nothing else."""
    if not cls.__module__.startswith("transformers."):
        return
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"module": cls.__module__, "class": cls.__qualname__}) + "\n")
        os.replace(tmp, record)
    except OSError:
        tmp.unlink(missing_ok=True)


def load_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained(name)``; for a local folder whose pick is recorded, that
    class's ``from_pretrained(name)`` without importing AutoTokenizer (or torch)."""
    folder = Path(name).expanduser()
    record = classes_dir() / f"{choice_key(name, folder)}.json" if folder.is_dir() else None
    cls = recorded_class(record) if record is not None else None
    if cls is not None:
        return cls.from_pretrained(name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if record is not None:
        record_class(record, type(tokenizer))
    return tokenizer
