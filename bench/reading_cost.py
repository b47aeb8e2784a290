"""How much of each package is prose: docstring and comment lines against code lines.

    python -m bench.reading_cost [--rev REV]

A line counts as prose when it holds no code token and is part of a module, class or function
docstring or holds a `#` comment; a code line with a trailing comment counts as code. Strings that
are not docstrings are code. `trailing` counts the code lines that carry a comment too (prose + trailing
is the share a count of "every line with a comment" gives). Only `.py` files are counted (gpu/csrc's
C++ is not). `--rev` reads the tree at a git revision instead of the working tree.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

CORE = ("runtime", "actors", "cache", "gpu", "api")
PACKAGES = (*CORE, "bench", "tests")
REPO = Path(__file__).resolve().parent.parent
NOT_CODE = {
    tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
    tokenize.ENCODING, tokenize.ENDMARKER,
}


@dataclass
class LineCount:
    files: int = 0
    nonblank: int = 0
    prose: int = 0
    trailing: int = 0

    @property
    def code(self) -> int:
        return self.nonblank - self.prose

    @property
    def share(self) -> float:
        return self.prose / self.nonblank if self.nonblank else 0.0

    def add(self, other: LineCount) -> None:
        self.files += other.files
        self.nonblank += other.nonblank
        self.prose += other.prose
        self.trailing += other.trailing


def docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def count_source(source: str) -> LineCount:
    """Counts one file's lines; `files` is 1."""
    docstrings = docstring_lines(ast.parse(source))
    code: set[int] = set()
    comments: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in NOT_CODE and token.start[0] not in docstrings:
            code.update(range(token.start[0], token.end[0] + 1))
    nonblank = [number for number, line in enumerate(source.splitlines(), 1) if line.strip()]
    prose = [n for n in nonblank if n not in code and (n in docstrings or n in comments)]
    return LineCount(files=1, nonblank=len(nonblank), prose=len(prose), trailing=len(code & comments))


def python_files(package: str, rev: str | None) -> dict[str, str]:
    """Path -> source of every .py file under `package`, at `rev` or in the working tree."""
    if rev is None:
        return {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / package).rglob("*.py"))}
    listing = git("ls-tree", "-r", "--name-only", rev, "--", package).splitlines()
    return {path: git("show", f"{rev}:{path}") for path in listing if path.endswith(".py")}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def package_counts(rev: str | None) -> dict[str, LineCount]:
    counts = {}
    for package in PACKAGES:
        total = LineCount()
        for source in python_files(package, rev).values():
            total.add(count_source(source))
        counts[package] = total
    return counts


def table(counts: dict[str, LineCount]) -> str:
    core = LineCount()
    for package in CORE:
        core.add(counts[package])
    rows = [*counts.items(), ("core", core)]
    lines = [f"{'package':<9}{'files':>6}{'non-blank':>11}{'code':>8}{'doc+comment':>13}{'share':>8}{'trailing':>10}"]
    for name, c in rows:
        lines.append(f"{name:<9}{c.files:>6}{c.nonblank:>11}{c.code:>8}{c.prose:>13}{c.share:>8.1%}{c.trailing:>10}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="git revision to read (default: the working tree)")
    args = parser.parse_args()
    print(f"reading cost at {args.rev or 'the working tree'} (core = {' + '.join(CORE)})")
    print(table(package_counts(args.rev)))


if __name__ == "__main__":
    main()
