"""Code statistics of the package, for the closing notes of refactoring issues.

    python lab/bench/code_stats.py [--ref GIT_REF]

Prints, for the working tree (or for GIT_REF, read through `git show`):
- lines of Python in `ssmquant/` (all lines, and non-blank);
- the doc+comment to code ratio of `ssmquant/kernels` by lines and by characters (docstrings and `#` comments
  against the remaining non-blank code), the measure fla's `ops/` was compared with;
- imports inside functions outside `ssmquant/cli.py`, with their places.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import subprocess
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _files(ref: str | None) -> dict[str, str]:
    if ref is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "ssmquant").rglob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", ref, "ssmquant"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {
        n: subprocess.run(["git", "show", f"{ref}:{n}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for n in names
        if n.endswith(".py")
    }


def _doc_lines(src: str) -> tuple[set[int], int]:
    """Line numbers holding docstrings or comments, and the characters of those docstrings and comments."""
    lines: set[int] = set()
    chars = 0
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
                chars += len(first.value.value)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
            chars += len(tok.string)
    return lines, chars


def comment_ratio(files: dict[str, str], prefix: str) -> tuple[float, float]:
    """(doc+comment lines / code lines, doc+comment chars / code chars) over the files under ``prefix``."""
    doc_l = code_l = doc_c = code_c = 0
    for name, src in files.items():
        if not name.startswith(prefix):
            continue
        doc, chars = _doc_lines(src)
        text = src.splitlines()
        for i, line in enumerate(text, 1):
            if not line.strip():
                continue
            if i in doc:
                doc_l += 1
            else:
                code_l += 1
                code_c += len(line.strip())
        doc_c += chars
    return doc_l / max(code_l, 1), doc_c / max(code_c, 1)


def function_imports(files: dict[str, str]) -> list[str]:
    """``file:line module`` of every import inside a function, outside the CLI."""
    out = []
    for name, src in files.items():
        if name.endswith("ssmquant/cli.py") or name == "ssmquant/cli.py":
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import):
                        out.append(f"{name}:{sub.lineno} {', '.join(a.name for a in sub.names)}")
                    elif isinstance(sub, ast.ImportFrom):
                        out.append(f"{name}:{sub.lineno} {'.' * sub.level}{sub.module or ''}")
    return sorted(set(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=None, help="a git ref to measure instead of the working tree")
    args = ap.parse_args()
    files = _files(args.ref)
    total = sum(len(s.splitlines()) for s in files.values())
    nonblank = sum(1 for s in files.values() for line in s.splitlines() if line.strip())
    by_lines, by_chars = comment_ratio(files, "ssmquant/kernels/")
    imports = function_imports(files)
    print(f"ssmquant/: {len(files)} Python files, {total} lines ({nonblank} non-blank)")
    print(f"ssmquant/kernels doc+comment : code = {by_lines:.2f} by lines, {by_chars:.2f} by characters")
    print(f"imports inside functions outside cli.py: {len(imports)}")
    for line in imports:
        print("  " + line)


if __name__ == "__main__":
    main()
