"""`prime-rl sft CONFIG.toml`: supervised fine-tuning, one trainer process (``trainer.sft``)."""

from __future__ import annotations

import os
import subprocess
import sys

from prime_rl.commands.common import OUTPUT_DIR, checked_output_dir, make_dir, print_help
from prime_rl.config import SFTConfig
from prime_rl.keys import holds_secret
from prime_rl.launch.resolve import checked_model_path
from prime_rl.rundir import write_json_atomic
from prime_rl.settings import ConfigError, load_config, split_argv


def main(argv: list[str]) -> int:
    if not argv or "--help" in argv or "-h" in argv:
        print_help("prime-rl sft CONFIG.toml [flags]", SFTConfig, {})
        return 0
    files, flags = split_argv(argv)
    config = load_config(SFTConfig, files, flags)
    checked_model_path(config.model.name, "model.name")
    if not config.data.path.is_file():
        raise ConfigError(f"data.path: SFT data file {str(config.data.path)!r} does not exist (expected JSONL of chats)")
    out = checked_output_dir(config.output_dir, OUTPUT_DIR)
    resolved = out / "configs" / "sft.json"
    make_dir(resolved.parent, OUTPUT_DIR)
    data = config.model_dump(mode="json")
    write_json_atomic(resolved, data, private=holds_secret(data))  # as the RL launcher's configs
    cmd = [sys.executable, "-m", "trainer.sft", "--config", str(resolved)]
    try:
        return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except KeyboardInterrupt:
        return 130
