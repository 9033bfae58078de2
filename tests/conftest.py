import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The deterministic tiny Qwen3 model + byte-level tokenizer, built once per session."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(out)], check=True)
    return out
