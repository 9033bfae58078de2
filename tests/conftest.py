import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prime_rl import procmem

from helpers import REPO, build_tiny, remove_cgroup, server_tmp_env, stop_launchers

# vLLM renames its engine and worker processes (setproctitle), which by default writes the
# title over the area /proc/PID/environ shows: the test tag helpers.tagged_processes looks
# for there was gone, and every "no process left" check missed those two. With SPT_NOENV
# the title stays within argv's area and the environment stays readable (every process the
# tests start inherits it).
os.environ["SPT_NOENV"] = "1"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The deterministic tiny Qwen3 model + byte-level tokenizer, built once per session."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory) -> Path:
    """The tiny model's architecture and tokenizer with other weights (seed 1): a new policy,
    or a teacher of the tiny model."""
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-seed1", seed=1)


@pytest.fixture(scope="session")
def family_models(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """The tiny model in each architecture family the documentation's users train: Qwen3
    dense (``tiny_model`` itself), Llama and Qwen3 MoE, with the same tokenizer and sizes."""
    root = tmp_path_factory.mktemp("families")
    return {"qwen3": tiny_model, **{arch: build_tiny(root / arch, arch=arch) for arch in ("llama", "qwen3_moe")}}


@pytest.fixture(scope="session")
def sampling_defaults_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a `generation_config.json` that truncates sampling (top_k 3, top_p
    0.5), as real models ship one (Qwen3: top_k 20, top_p 0.8). vLLM would apply it to every
    request that does not set those fields, and its logprobs would then no longer be the
    full softmax the trainer scores. No `do_sample`, as some models ship it: transformers
    refuses to re-save such a config, so the trainer must carry the file verbatim."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("models") / "sampling-defaults"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "top_k": 3, "top_p": 0.5, "temperature": 0.6}))
    return out


@pytest.fixture(scope="session")
def think_model(tmp_path_factory) -> Path:
    """The tiny model with a chat template that strips <think> blocks from assistant messages
    before the last user message, as Qwen3's does (a non-increasing template)."""
    return build_tiny(tmp_path_factory.mktemp("models") / "think", chat_template="think-stripping")


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, tiny_model) -> Path:
    """The tiny model after a short SFT on the first turn of wiki-search episodes (other
    generated wikis than the tests'): it learns to open with a `search_pages` call in
    Qwen3's `<tool_call>` JSON, which vLLM's hermes parser reads (measured: after 200 steps
    of 8, 6 of 8 first replies parse at temperature 0.5; copying the right name needs the
    full warm-up of configs/wiki-search)."""
    import json

    root = tmp_path_factory.mktemp("models")
    base, data, out = tiny_model, root / "wiki_sft.jsonl", root / "tool"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_sft_data.py"), str(data), "--env", "wiki-search",
                    "--num-examples", "2000"], check=True, capture_output=True)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    first_turns = []
    for row in rows:
        k = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
        first_turns.append(json.dumps({"messages": row["messages"][: k + 1], "tools": row["tools"]}))
    data.write_text("\n".join(first_turns) + "\n")
    config = root / "sft.toml"
    config.write_text(f'output_dir = "{out}"\nmax_steps = 200\nseq_len = 1024\n[model]\nname = "{base}"\n'
                      f'[data]\npath = "{data}"\nbatch_size = 8\nmicro_batch_size = 8\n[optim]\nlr = 1e-2\nwarmup_steps = 10\n')
    done = subprocess.run([sys.executable, "-m", "prime_rl.cli", "sft", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.fixture
def small_memory_cgroup():
    """A memory cgroup of 64 MiB beside nothing of the sandbox's (v1 or v2, under our own)."""
    found = procmem.memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup is mounted here")
    version, own = found
    cgroup = own / f"prime-rl-oom-test-{uuid.uuid4().hex[:8]}"
    limit = str(64 << 20)
    try:
        if version == 2 and "memory" not in (own / "cgroup.subtree_control").read_text().split():
            (own / "cgroup.subtree_control").write_text("+memory")  # refused where our cgroup holds processes
        cgroup.mkdir()
        if version == 2:
            (cgroup / "memory.max").write_text(limit)
            if (cgroup / "memory.swap.max").exists():
                (cgroup / "memory.swap.max").write_text("0")
        else:
            (cgroup / "memory.limit_in_bytes").write_text(limit)
            if (cgroup / "memory.memsw.limit_in_bytes").exists():
                (cgroup / "memory.memsw.limit_in_bytes").write_text(limit)
    except OSError as e:
        remove_cgroup(cgroup)
        pytest.skip(f"no writable memory cgroup: cannot make one under {own} ({e})")
    yield version, cgroup
    remove_cgroup(cgroup)


@pytest.fixture
def vllm_env():
    """The environment for a vLLM server a test starts itself (``helpers.server_tmp_env``)."""
    with server_tmp_env() as env:
        yield env


@pytest.fixture(autouse=True)
def stop_leftover_launchers():
    """A test that ends before its launcher did (an assertion, pytest-timeout) leaves no run behind."""
    yield
    stop_launchers()
