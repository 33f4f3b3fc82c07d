"""The house rules of ARCHITECTURE.md, checked on the source: the package's import graph has no cycle and every
import goes down the layers; imports of the package's own modules inside functions are few and each says why; no
module of the package is a script; the library never imports the lab."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ssmquant"

# ARCHITECTURE.md's layers, from the bottom: a package may import those of a lower rank (or its own rank's
# earlier entries, where the table names the order: report reads analysis, evaluate and calibrate read both)
LAYERS = [
    ("__version__", "errors", "filemodes", "provenance", "memory", "defaults"),
    ("formats",),
    ("kinds",),
    ("replay",),
    ("engines",),
    ("kernels",),
    ("simulate",),
    ("sizing",),
    ("models",),
    ("analysis",),
    ("report",),
    ("evaluate", "calibrate"),
    ("export",),
    ("startup",),
    ("cli", "__main__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_INNER_IMPORTS = 15


def _unit(module: str) -> str | None:
    """'ssmquant.kinds.base' -> 'kinds' (the package-level unit a module belongs to)."""
    parts = module.split(".")
    if parts[0] != "ssmquant":
        return None
    return parts[1] if len(parts) > 1 else "__version__"


def _imports():
    """(source file, its unit, imported unit, in a function, line, has a comment) of every own-module import."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src_unit = _unit(module)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    stem = package[: len(package) - node.level + 1]
                    base = ".".join(stem + ([node.module] if node.module else []))
                    targets = [base + "." + a.name for a in node.names] if node.module is None else [base]
                elif base == "ssmquant":
                    targets = ["ssmquant." + a.name for a in node.names]
                elif base.startswith("ssmquant."):
                    targets = [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("ssmquant")]
            for target in targets:
                unit = _unit(target)
                if unit is None or unit == src_unit:
                    continue
                q, inner = node, False
                while q in parents:
                    q = parents[q]
                    if isinstance(q, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        inner = True
                        break
                line = lines[node.lineno - 1]
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                commented = "#" in line or above.startswith("#")
                out.append((path.relative_to(ROOT), src_unit, unit, inner, node.lineno, commented))
    return out


def test_every_import_goes_down_the_layers():
    wrong = [f"{f}:{n}: {a} imports {b}" for f, a, b, _, n, _ in _imports() if RANK[b] > RANK[a]]
    assert not wrong, "\n".join(wrong)


def test_the_package_graph_has_no_cycle():
    edges: dict[str, set[str]] = {}
    for _, a, b, _, _, _ in _imports():
        edges.setdefault(a, set()).add(b)
    seen, on_path = set(), []

    def visit(u):
        if u in on_path:
            raise AssertionError("import cycle: " + " -> ".join(on_path[on_path.index(u) :] + [u]))
        if u in seen:
            return
        on_path.append(u)
        for v in sorted(edges.get(u, ())):
            visit(v)
        on_path.pop()
        seen.add(u)

    for u in sorted(edges):
        visit(u)


def test_inner_imports_are_few_and_say_why():
    inner = [(f, n, c) for f, a, _, i, n, c in _imports() if i and a not in ("cli", "__main__")]
    assert len(inner) <= MAX_INNER_IMPORTS, "\n".join(f"{f}:{n}" for f, n, _ in inner)
    silent = [f"{f}:{n}" for f, n, c in inner if not c]
    assert not silent, "an import inside a function says why (start-up, an optional package):\n" + "\n".join(silent)


def test_no_module_of_the_package_is_a_script_and_none_imports_the_lab():
    scripts, lab = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name != "__main__.py" and "__name__ == \"__main__\"" in text:
            scripts.append(str(path.relative_to(ROOT)))
        if "import lab" in text or "from lab" in text:
            lab.append(str(path.relative_to(ROOT)))
    assert not scripts and not lab, (scripts, lab)
