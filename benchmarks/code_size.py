"""The product code's size, per file and per function (issue 24's before / after table).

    python benchmarks/code_size.py [--top 15] [--limit 80] [--json OUT]

Walks the product packages (cluster, router, prefill_worker, decode_worker, engine, proto; not
kernels, benchmarks or tests) and prints: lines per package, the largest files, the longest
functions (a function's lines from its ``def`` to its last statement, docstring included) and
how many functions pass ``--limit`` lines. Generated protobuf stubs are left out.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "router", "prefill_worker", "decode_worker", "engine", "proto")


def _files() -> list[Path]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            out.append(path)
    return out


def _functions(tree: ast.AST, rel: str) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in ``tree``."""
    found: list[tuple[int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append((child.end_lineno - child.lineno + 1, f"{rel}:{child.lineno} {name}"))
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def measure(limit: int) -> dict:
    files, functions, packages = [], [], {}
    for path in _files():
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        lines = text.count("\n")
        files.append((lines, rel))
        pkg = rel.split("/")[0]
        packages[pkg] = packages.get(pkg, 0) + lines
        functions += _functions(ast.parse(text), rel)
    files.sort(reverse=True)
    functions.sort(reverse=True)
    return {
        "packages": packages,
        "files": files,
        "functions": functions,
        "over_limit": [f for f in functions if f[0] > limit],
        "limit": limit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--limit", type=int, default=80, help="function length that counts as long")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = measure(args.limit)
    print("| package | lines |\n|---|---|")
    for pkg, n in sorted(m["packages"].items(), key=lambda kv: -kv[1]):
        print(f"| {pkg} | {n} |")
    print(f"\n| largest files (of {len(m['files'])}) | lines |\n|---|---|")
    for n, rel in m["files"][: args.top]:
        print(f"| {rel} | {n} |")
    print(f"\n| longest functions (of {len(m['functions'])}) | lines |\n|---|---|")
    for n, name in m["functions"][: args.top]:
        print(f"| {name} | {n} |")
    print(f"\nfunctions over {args.limit} lines: {len(m['over_limit'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1) + "\n")


if __name__ == "__main__":
    main()
