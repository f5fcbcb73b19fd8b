"""The import rules of ARCHITECTURE.md, checked on the tree: an AST walk over every `import` and
`from ... import` in ds4/ (relative imports resolved, imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ds4"
FRAMEWORKS = ("torch", "triton", "mlx")
BACKENDS = ("reference", "mlx", "triton")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # (a submodule imported by name)
    return out


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        for name in sorted(imports(path)):
            top = name.split(".")[0]
            if top == "cli":
                bad.append(f"{mod} imports {name}: nothing in ds4/ imports cli")
            if under(mod, "ds4.core"):
                if top in FRAMEWORKS or (top == "ds4" and not under(name, "ds4.core")):
                    bad.append(f"{mod} imports {name}: ds4.core imports only ds4.core")
            if under(mod, "ds4.wire") and top == "ds4" and not (
                    under(name, "ds4.core") or under(name, "ds4.wire")):
                bad.append(f"{mod} imports {name}: ds4.wire imports only ds4.core")
            for b in BACKENDS:
                if under(mod, f"ds4.backends.{b}"):
                    others = [o for o in BACKENDS if o != b]
                    if any(under(name, f"ds4.backends.{o}") for o in others):
                        bad.append(f"{mod} imports {name}: a backend imports no other backend")
            if not under(mod, "ds4.backends") and any(under(name, f"ds4.backends.{b}") for b in BACKENDS):
                bad.append(f"{mod} imports {name}: only the registry names backend modules")
    return bad


def test_the_import_rules_hold():
    assert violations() == []


def test_the_walk_sees_relative_and_nested_imports():
    # (the rules would pass vacuously if the walk missed these forms)
    engine = imports(PKG / "engine.py")
    assert "ds4.core.graph" in engine and "ds4.backends" in engine
    tp = imports(PKG / "tp" / "partner.py")
    assert "torch" in tp and "ds4.wire.ds4t" in tp
