"""The packages show the architecture (README "A reader's map"): imports between src/'s modules
form no cycle, type-only and function-local imports included, and each role imports only the
roles below it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Every module of src/ that ``path`` imports anywhere (top level, functions, TYPE_CHECKING):
    `from a.b import c` counts as a.b.c when that is a module, else as a.b."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(SRC.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_package():
    graph = {"a": {"a.b"}, "a.b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "a.b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_src_has_no_import_cycle():
    graph = import_graph()
    assert "prime_rl.launch.deployment" in graph  # the walk sees the packages
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# role -> the roles it must not import (each role imports only what sits below it)
FORBIDDEN = {
    "contracts": ("prime_rl.launch", "prime_rl.observe", "prime_rl.commands", "prime_rl.cli", "orchestrator", "trainer", "inference"),
    "prime_rl.observe": ("prime_rl.launch", "prime_rl.commands", "prime_rl.cli", "orchestrator", "trainer", "inference"),
    "prime_rl.launch": ("prime_rl.commands", "prime_rl.cli", "orchestrator", "trainer", "inference"),
    "prime_rl.envs": ("prime_rl.launch", "prime_rl.observe", "prime_rl.commands", "prime_rl.cli", "orchestrator", "trainer", "inference"),
    "orchestrator": ("prime_rl.launch", "prime_rl.observe", "prime_rl.commands", "prime_rl.cli", "trainer", "inference"),
    "trainer": ("prime_rl.launch", "prime_rl.observe", "prime_rl.commands", "prime_rl.cli", "orchestrator", "inference"),
    "inference": ("prime_rl.launch", "prime_rl.observe", "prime_rl.commands", "prime_rl.cli", "orchestrator", "trainer"),
}


def role(module: str) -> str:
    for name in ("prime_rl.launch", "prime_rl.observe", "prime_rl.envs", "prime_rl.commands", "prime_rl.cli"):
        if module == name or module.startswith(name + "."):
            return name
    top = module.split(".")[0]
    return "contracts" if top == "prime_rl" else top


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_each_role_imports_only_the_roles_below_it():
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if any(within(target, banned) for banned in FORBIDDEN.get(role(module), ()))
    ]
    assert wrong == []


README = SRC.parent / "README.md"


def map_paths(readme: str) -> set[str]:
    """The paths README's reader's map names: the first column of the code block under
    `## Layout`, nested by two spaces per level (`a.py, b.py` names both)."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    named, parents = set(), []
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        head = line.strip().split("  ", 1)[0]
        if not head or indent > 8 or not all(n.endswith(("/", ".py")) for n in head.split(", ")):
            continue  # a description's continuation
        level = indent // 2
        parents = parents[:level]
        for name in head.split(", "):
            named.add("".join(parents) + name)
        if head.endswith("/"):
            parents.append(head.split(", ")[-1])
    return named


def test_the_map_reader_follows_nesting():
    readme = "## Layout\n```\nsrc/a/   x\n  b.py, c/  y\n    d.py   z\n                 more words/\n  e.py  w\n```\n"
    assert map_paths(readme) == {"src/a/", "src/a/b.py", "src/a/c/", "src/a/c/d.py", "src/a/e.py"}


def test_the_readmes_map_matches_the_packages():
    named = map_paths(README.read_text())
    root = SRC.parent
    missing_on_disk = sorted(p for p in named if not (root / p).exists())
    assert missing_on_disk == [], "the map names paths that do not exist"
    must_name = {f"{p.relative_to(root)}/" for p in SRC.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    prime_rl = SRC / "prime_rl"
    must_name |= {f"{p.parent.relative_to(root)}/" for p in prime_rl.rglob("__init__.py")}
    for package in (prime_rl, prime_rl / "launch", prime_rl / "observe"):
        must_name |= {str(p.relative_to(root)) for p in package.glob("*.py") if p.name != "__init__.py"}
    assert sorted(must_name - named) == [], "modules and packages the map does not name"


# --------------------------------------------------------------------------- resolve is the only writer

RESOLVE = "prime_rl/launch/resolve.py"
"""The resolve stage: every derived setting is written here, on a copy (launch/resolve.py's docstring)."""

NOT_OUR_CONFIGS = {
    ("trainer/weights.py", "dtype"): "a transformers PretrainedConfig of the weights written, not a prime-rl config",
    ("trainer/lora.py", "base_model_name_or_path"): "peft's LoraConfig of the adapter written, not a prime-rl config",
    ("orchestrator/client/admin.py", "model"): "Served, the client's record of the model a server serves now, not a config",
}
"""(file, attribute) -> why a write of that name there is not a write of a prime-rl config."""


def config_field_names() -> set[str]:
    """Every field name of every prime-rl config model."""
    import prime_rl.config as config
    from pydantic import BaseModel

    models = [v for v in vars(config).values() if isinstance(v, type) and issubclass(v, BaseModel)]
    return {name for model in models for name in model.model_fields}


def is_validator(function: ast.FunctionDef) -> bool:
    names = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in function.decorator_list}
    return bool(names & {"model_validator", "field_validator"})


def config_writes(path: Path, fields: set[str]) -> list[tuple[int, str]]:
    """(line, target) of each write of a config field name outside a config's own validators:
    `x.field = ...`, `x.field += ...`, and `setattr(x, "field", ...)`; `self.field = ...` in a
    class that is not a config is its own attribute."""
    tree = ast.parse(path.read_text(), str(path))
    writes, skip = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            is_config = any(ast.unparse(b) in ("StrictModel", "BaseModel") for b in node.bases)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and (not is_config or is_validator(item)):
                    skip.update(id(n) for n in ast.walk(item) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self")
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") and len(node.args) > 1:
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else "<computed>"
            if name in fields or name == "<computed>":
                writes.append((node.lineno, f"setattr(..., {name!r})"))
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in fields and id(target) not in skip:
                writes.append((target.lineno, ast.unparse(target)))
    return sorted(writes)


def test_the_config_write_finder_sees_each_kind_of_write(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class Box:\n    def __init__(self):\n        self.model = 1\n"  # its own attribute
        "class C(StrictModel):\n    @model_validator(mode='after')\n    def _v(self):\n        self.model = 2\n"
        "def f(config):\n    config.inference.model = 'x'\n    config.seq_len += 1\n    setattr(config, 'model', 3)\n"
        "    a.port, b = 1, 2\n    config.not_a_field = 4\n"
    )
    found = [target for _, target in config_writes(sample, {"model", "seq_len", "port"})]
    assert found == ["config.inference.model", "config.seq_len", "setattr(..., 'model')", "a.port"]


def test_no_config_is_written_outside_the_resolve_stage_and_the_validators():
    fields = config_field_names()
    assert {"model", "api_key", "base_url", "resume_step"} <= fields
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        relative = str(path.relative_to(SRC))
        if relative == RESOLVE:
            continue
        for line, target in config_writes(path, fields):
            if (relative, target.rpartition(".")[2]) not in NOT_OUR_CONFIGS:
                wrong.append(f"src/{relative}:{line}: {target}")
    assert wrong == [], "configs are written only by prime_rl/launch/resolve.py (return a new config from there)"
