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


@pytest.fixture(scope="session")
def think_model(tmp_path_factory) -> Path:
    """The tiny model with a chat template that strips <think> blocks from assistant messages
    before the last user message, as Qwen3's does (a non-increasing template)."""
    out = tmp_path_factory.mktemp("models") / "think"
    script = REPO / "scripts" / "build_tiny_model.py"
    subprocess.run([sys.executable, str(script), str(out), "--chat-template", "think-stripping"], check=True, capture_output=True)
    return out
