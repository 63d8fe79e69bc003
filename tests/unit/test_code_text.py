"""The product's own text, read with ``ast`` and ``tokenize``: what its docstrings and comments
may say, and how much of it they may be.

- No module (tests included) cites what a reader of the repository cannot open: an issue number ("issue 28",
  "issues 10, 30"), a design section ("DESIGN §3", "DESIGN.md"), ``../shared``, or a date
  (2026-12-06). History lives in git; figures live on the results page.
- A module docstring states the module's contract in at most ``MAX_MODULE_DOCSTRING`` lines.
- Product prose (lines of docstrings plus lines holding only a comment, over all lines of the
  product packages, tests and benchmarks excluded) stays at most ``MAX_PROSE_RATIO``.

``python tests/unit/test_code_text.py`` prints the prose ratio of each package.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The packages whose prose the ratio counts; the docstring-length check also reads
# benchmarks/, the forbidden-reference check benchmarks/ and tests/ too.
PRODUCT = ("engine", "channel", "router", "prefill_worker", "decode_worker", "kv_transfer",
           "planner", "server", "experiments", "deployment")
CHECKED = PRODUCT + ("benchmarks",)
MAX_MODULE_DOCSTRING = 25
MAX_PROSE_RATIO = 0.18

FORBIDDEN = {
    "an issue number": re.compile(r"\bissues? #?\d+|\bissue #\d+", re.IGNORECASE),
    "a design-document section": re.compile(r"\bDESIGN\b\s*(§|\.md)|\bFIELD\.md\b"),
    "a path outside the repository": re.compile(r"\.\./shared"),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


def modules(packages=CHECKED) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _docstring_nodes(tree: ast.Module) -> list[tuple[ast.AST, ast.Expr]]:
    """Each (owner, docstring expression) of the module, its classes and functions."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                found.append((node, body[0]))
    return found


def _comment_tokens(source: str) -> list[tokenize.TokenInfo]:
    return [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT]


def prose_lines(path: Path) -> tuple[int, int]:
    """(prose lines, all lines) of one file: a prose line is inside a docstring or holds only a
    comment; a code line that ends in a comment counts as code."""
    source = path.read_text()
    lines = source.splitlines()
    prose: set[int] = set()
    for _, doc in _docstring_nodes(ast.parse(source)):
        prose.update(range(doc.lineno, doc.end_lineno + 1))
    for tok in _comment_tokens(source):
        if lines[tok.start[0] - 1].lstrip().startswith("#"):
            prose.add(tok.start[0])
    return len(prose), len(lines)


def prose_ratio(packages=PRODUCT) -> tuple[int, int]:
    """(prose lines, all lines) summed over the packages' modules."""
    counts = [prose_lines(p) for p in modules(packages)]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def forbidden_references(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: <what> in "<text>"`` for each forbidden reference in a docstring, a comment
    or any other string of the module."""
    source = path.read_text()
    texts: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for i, line in enumerate(tok.string.splitlines()):
                texts.append((tok.start[0] + i, line))
        elif sys.version_info >= (3, 12) and tok.type == tokenize.FSTRING_MIDDLE:
            texts.append((tok.start[0], tok.string))
    found = []
    for lineno, text in texts:
        for what, pattern in FORBIDDEN.items():
            match = pattern.search(text)
            if match:
                found.append(f"{_rel(path, root)}:{lineno}: {what} ({match.group(0)!r}) in "
                             f"{text.strip()[:100]!r}")
    return found


def long_module_docstring(path: Path, root: Path = ROOT) -> str | None:
    """``file:line: ...`` when the module docstring runs over ``MAX_MODULE_DOCSTRING`` lines."""
    tree = ast.parse(path.read_text())
    for owner, doc in _docstring_nodes(tree):
        if owner is tree:
            length = doc.end_lineno - doc.lineno + 1
            if length > MAX_MODULE_DOCSTRING:
                return (f"{_rel(path, root)}:{doc.lineno}: module docstring of {length} lines "
                        f"(at most {MAX_MODULE_DOCSTRING})")
    return None


def test_no_forbidden_references():
    tests = [p for p in modules(("tests",)) if p != Path(__file__).resolve()]  # (its examples)
    found = [f for path in modules() + tests for f in forbidden_references(path)]
    assert not found, "forbidden references in code:\n" + "\n".join(found)


def test_module_docstrings_state_a_contract_briefly():
    found = [f for f in (long_module_docstring(path) for path in modules()) if f]
    assert not found, "module docstrings over the limit:\n" + "\n".join(found)


def test_prose_ratio():
    prose, total = prose_ratio()
    assert prose / total <= MAX_PROSE_RATIO, (
        f"product prose is {prose}/{total} = {prose / total:.1%} of its lines "
        f"(at most {MAX_PROSE_RATIO:.0%}); per package: python tests/unit/test_code_text.py")


def test_the_checks_catch_what_they_name(tmp_path):
    """Each check fails on a module that breaks its rule, naming the file and line."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""A module.\n\nSee issue 28 and DESIGN §3."""\n'
                   + "# measured on 2026-12-06\nx = 1  # not ../shared/FIELD.md\n")
    found = forbidden_references(bad, tmp_path)
    assert [f.split(":")[1] for f in found] == ["3", "3", "4", "5", "5"]
    assert all(f.startswith("bad.py:") for f in found)
    assert long_module_docstring(bad, tmp_path) is None
    bad.write_text('"""' + "line\n" * MAX_MODULE_DOCSTRING + '"""\n')
    assert long_module_docstring(bad, tmp_path) == (
        f"bad.py:1: module docstring of {MAX_MODULE_DOCSTRING + 1} lines "
        f"(at most {MAX_MODULE_DOCSTRING})")
    bad.write_text('"""Doc."""\n\n# why\nx = 1  # code\n\n\ndef f():\n    """One.\n\n    Two."""\n')
    assert prose_lines(bad) == (1 + 1 + 3, 10)


if __name__ == "__main__":
    for package in PRODUCT:
        prose, total = prose_ratio((package,))
        print(f"{package:16s} {prose:6d} / {total:6d} = {prose / max(total, 1):6.1%}")
    prose, total = prose_ratio()
    print(f"{'product':16s} {prose:6d} / {total:6d} = {prose / total:6.1%}")
