"""The import rules between our packages, read from the source (every import, at any depth of a
module, relative ones resolved): a change that breaks one fails here, naming the file and line."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (importer prefix, imported prefix, why that import is refused)
RULES = [
    ("protocol", "node", "protocol is sans-IO and imports nothing of ours"),
    ("protocol", "coordinator", "protocol is sans-IO and imports nothing of ours"),
    ("node", "coordinator", "the swarm trains while the coordinator is down: the node never needs its code"),
    ("node.net", "node.averaging", "the net layer sits below averaging"),
    ("node.net", "node.roles", "the net layer sits below the roles"),
    ("node.averaging", "node.roles", "averaging serves the roles, never the other way round"),
    ("node.state", "node.roles", "state serves the roles, never the other way round"),
    ("node.models", "node.net", "models hold no network code"),
    ("node.models", "node.averaging", "models hold no network code"),
    ("node.models", "node.state", "models hold no network code"),
    ("node.models", "node.roles", "models hold no network code"),
    ("node.models", "hivemind", "models hold no network code"),
]
# what the coordinator may take from the node: its net layer, state format, config loading, and
# the reading of a Hugging Face model directory and its tokenizer (to refuse a bad one at start) and
# its cut into stages (a pipeline run's first checkpoints, of the model's weights)
COORDINATOR_MAY_IMPORT = ("node.net", "node.state", "node.config", "node.runconfig", "node.preflight", "node.cli", "node.osutil",
                          "node.models.hf", "node.models.tokens", "node.models.hf_stages")  # fmt: skip
HIVEMIND_ADAPTER = "node.net.host"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            found += [(node.lineno, f"{target}.{a.name}" if (ROOT / target.replace(".", "/") / f"{a.name}.py").exists() else target) for a in node.names]
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def sources() -> list[Path]:
    return sorted(p for top in ("node", "coordinator", "protocol") for p in (ROOT / top).rglob("*.py"))


def broken_rules() -> list[str]:
    broken = []
    for path in sources():
        mod = module_name(path)
        for line, target in imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            broken += [f"{where}: {why}" for src, dst, why in RULES if within(mod, src) and within(target, dst)]
            if within(target, "hivemind") and mod != HIVEMIND_ADAPTER:
                broken.append(f"{where}: only {HIVEMIND_ADAPTER} imports hivemind")
            if within(mod, "coordinator") and within(target, "node") and not any(within(target, ok) for ok in COORDINATOR_MAY_IMPORT):
                broken.append(f"{where}: the coordinator takes only {', '.join(COORDINATOR_MAY_IMPORT)} from the node")
    return broken


def test_every_package_imports_only_what_its_layer_may():
    assert broken_rules() == []


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    """A rule the walk could not see would pass for ever: it must find a function-level relative
    import of roles in the net layer and a hivemind import outside the adapter."""
    fake = tmp_path / "node" / "net"
    fake.mkdir(parents=True)
    (tmp_path / "node" / "roles").mkdir()
    (tmp_path / "node" / "roles" / "replica.py").write_text("")
    (fake / "sneaky.py").write_text("def f():\n    from ..roles import replica\n    import hivemind.dht\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = broken_rules()
    assert any("node/net/sneaky.py:2 imports node.roles.replica: the net layer sits below the roles" in b for b in found), found
    assert any("node/net/sneaky.py:3 imports hivemind.dht: only node.net.host imports hivemind" in b for b in found), found


@pytest.mark.parametrize("package", ["net", "averaging", "roles", "state", "models"])
def test_each_package_maps_its_files_in_its_init(package):
    """Every module of a package is named in its __init__'s docstring: the map a reader starts from."""
    init = ROOT / "node" / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    missing = [p.name for p in sorted(init.parent.glob("*.py")) if p.name != "__init__.py" and p.name not in doc]
    assert missing == [], f"node/{package}/__init__.py does not map {missing}"


# the sizes node/averaging/ keeps, for every module of node/, coordinator/ and protocol/
MAX_MODULE_LINES, MAX_CLASS_METHODS, MAX_FUNCTION_LINES = 600, 25, 80


def oversized(paths, root: Path) -> list[str]:
    found = []
    for path in paths:
        src = path.read_text()
        where = path.relative_to(root)
        if src.count("\n") > MAX_MODULE_LINES:
            found.append(f"{where}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if methods > MAX_CLASS_METHODS:
                    found.append(f"{where}:{node.lineno} class {node.name}: {methods} methods")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def test_no_module_class_or_function_outgrows_its_size():
    assert oversized(sources(), ROOT) == []


def test_the_size_check_sees_a_long_function_and_a_class_of_many_methods(tmp_path):
    big = tmp_path / "node" / "big.py"
    big.parent.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(26))
    big.write_text(f"def long():\n{body}\n\n\nclass Wide:\n{methods}\n")
    assert oversized([big], tmp_path) == ["node/big.py:1 long: 82 lines", "node/big.py:85 class Wide: 26 methods"]
