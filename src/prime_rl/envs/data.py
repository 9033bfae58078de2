"""Where an environment's rows come from: a local file, the HF hub, or an offline generator.

``load_rows`` is what the built-in environments use and what users' modules may use:

    rows, origin = load_rows(source="auto", data_path=None, hub_id="openai/gsm8k",
                             hub_config="main", split="train", generate=my_generator)

- ``data_path`` given: that file (JSONL, JSON list, CSV or Parquet), nothing else;
- ``source="hub"``: the hub dataset, or ``DatasetUnavailable`` saying what to pass instead;
- ``source="generated"``: ``generate()``;
- ``source="auto"``: the hub when it answers, else ``generate()`` (the origin says which).
The hub is probed once with a short timeout before ``datasets`` is asked (which would
retry for ~30 s when there is no network), and ``datasets`` is imported only then.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

SOURCES = ("auto", "hub", "generated")
HUB_PROBE_TIMEOUT_S = 5.0


class DatasetUnavailable(RuntimeError):
    """A dataset that is needed cannot be loaded; the message says what to pass instead."""


def load_rows(
    *,
    source: str = "auto",
    data_path: str | Path | None = None,
    hub_id: str | None = None,
    hub_config: str | None = None,
    split: str = "train",
    generate: Callable[[], list[dict[str, Any]]] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """(rows, origin): see the module docstring."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if data_path is not None:
        return read_file(Path(data_path)), f"file {data_path}"
    if source == "generated" or (source == "auto" and hub_id is None):
        if generate is None:
            raise DatasetUnavailable(f"no offline generator for this dataset: pass data_path=FILE or source='hub' ({hub_id})")
        return generate(), "generated offline"
    if hub_id is None:
        raise DatasetUnavailable("no hub dataset for this environment: pass data_path=FILE")
    reason = hub_unreachable(hub_id)
    if reason is not None:
        if source == "auto" and generate is not None:
            return generate(), f"generated offline (hub {hub_id} unreachable: {reason})"
        hint = "source='generated' or " if generate is not None else ""
        raise DatasetUnavailable(f"dataset {hub_id} is unreachable ({reason}); pass {hint}data_path=FILE (JSONL rows)")
    try:
        rows = read_hub(hub_id, hub_config, split)
    except DatasetUnavailable as e:  # e.g. offline mode without a cached copy
        if source == "auto" and generate is not None:
            return generate(), f"generated offline ({e})"
        raise
    return rows, f"hub {hub_id}" + (f" ({hub_config})" if hub_config else "") + f" split {split}"


def hub_unreachable(hub_id: str) -> str | None:
    """None when the hub answers for ``hub_id`` (or offline mode has it cached), else why not."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None  # datasets reads its cache; a miss fails below with its own message
    try:
        HfApi().dataset_info(hub_id, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure means "not from the hub now"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}".rstrip(": ")
    return None


def read_hub(hub_id: str, config: str | None, split: str) -> list[dict[str, Any]]:
    import datasets

    try:
        return [dict(row) for row in datasets.load_dataset(hub_id, config, split=split)]
    except Exception as e:  # noqa: BLE001 - one line for the user, whatever datasets raised
        raise DatasetUnavailable(f"cannot load {hub_id} split {split} from the hub: {type(e).__name__}: {e}") from e


def read_file(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file, a JSON list, a CSV or a Parquet file."""
    if not path.is_file():
        raise DatasetUnavailable(f"data_path {str(path)!r} does not exist (expected a JSONL file of rows)")
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
        if suffix == ".json":
            rows = json.loads(path.read_text())
            if not isinstance(rows, list):
                raise ValueError("expected a JSON list of rows")
            return rows
        if suffix in (".csv", ".parquet"):
            import datasets

            return [dict(r) for r in datasets.load_dataset(suffix[1:], data_files=str(path), split="train")]
    except (ValueError, OSError) as e:
        raise DatasetUnavailable(f"data_path {str(path)!r}: cannot read it: {e}") from e
    raise DatasetUnavailable(f"data_path {str(path)!r}: unknown format (expected .jsonl, .json, .csv or .parquet)")
