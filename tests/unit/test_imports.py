"""DESIGN §2 "who may import whom", enforced by parsing every module with ``ast``.

Rules (experiments may import everything):
- engine imports no other pdlab package; kv_transfer imports only engine;
- prefill_worker / decode_worker import engine and kv_transfer, never each other;
- router imports only the torch-free engine modules and no torch/transformers/ray/msgpack;
- transformers only in engine/model.py (engine/runner.py allowed); msgpack only in
  kv_transfer/payload.py; ray (``import ray`` / ``from ray...``) only in experiments/* and
  kv_transfer/ray_store.py; kv_transfer.ray_store itself only lazily (inside a function)
  outside experiments;
- the torch-free engine modules import no torch at module level (checked in a subprocess too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "experiments")
TORCH_FREE_ENGINE = ("engine.request", "engine.config", "engine.metrics", "engine.events",
                     "engine.errors", "engine.kv_blocks")


@dataclass(frozen=True)
class Import:
    file: str      # e.g. "engine/model.py"
    module: str    # absolute dotted name, e.g. "engine.events" or "torch.nn"
    lazy: bool     # inside a function body (runs only when called)
    line: int

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}{' (lazy)' if self.lazy else ''}"


class _Collector(ast.NodeVisitor):
    def __init__(self, file: str, package: str):
        self.file, self.package = file, package
        self.imports: list[Import] = []
        self._depth = 0

    def _function(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self.imports.append(Import(self.file, alias.name, self._depth > 0, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.level:  # relative: resolve against this file's package
            parts = self.file[:-3].split("/")[:-node.level]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base == "__future__":
            return
        # `from engine import events` imports the submodule engine.events: record that
        submodules = [a.name for a in node.names
                      if (ROOT / base.replace(".", "/") / f"{a.name}.py").exists()]
        if len(submodules) < len(node.names):
            self.imports.append(Import(self.file, base, self._depth > 0, node.lineno))
        for name in submodules:
            self.imports.append(Import(self.file, f"{base}.{name}", self._depth > 0, node.lineno))


def collect() -> list[Import]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            collector = _Collector(rel, package)
            collector.visit(ast.parse(path.read_text(), filename=rel))
            found.extend(collector.imports)
    return found


IMPORTS = collect()


def in_package(imp: Import, *packages: str) -> bool:
    return imp.file.split("/")[0] in packages


def violations(predicate) -> list[str]:
    return [str(i) for i in IMPORTS if predicate(i)]


def test_the_parser_sees_the_imports_it_should():
    """Guard against a vacuous pass: known imports are found, laziness is detected."""
    files = {i.file for i in IMPORTS}
    for package in PACKAGES:
        assert any(f.startswith(package + "/") for f in files), package
    assert any(i.file == "engine/model.py" and i.top == "transformers" and i.lazy
               for i in IMPORTS)
    assert any(i.file == "experiments/placement.py" and i.top == "ray" and not i.lazy
               for i in IMPORTS)
    assert any(i.file == "kv_transfer/payload.py" and i.module == "msgpack" for i in IMPORTS)
    assert any(i.file == "router/router.py" and i.module == "engine.events" for i in IMPORTS)
    assert any(i.file == "kv_transfer/factory.py" and i.module == "kv_transfer.ray_store"
               and i.lazy for i in IMPORTS)


def test_engine_imports_no_other_pdlab_package():
    pdlab_others = set(PACKAGES) - {"engine"}
    assert violations(lambda i: in_package(i, "engine") and i.top in pdlab_others) == []


def test_kv_transfer_imports_only_engine():
    others = set(PACKAGES) - {"engine", "kv_transfer"}
    assert violations(lambda i: in_package(i, "kv_transfer") and i.top in others) == []


@pytest.mark.parametrize("worker,other", [("prefill_worker", "decode_worker"),
                                          ("decode_worker", "prefill_worker")])
def test_workers_import_engine_and_kv_transfer_never_each_other(worker, other):
    forbidden = set(PACKAGES) - {"engine", "kv_transfer", worker}
    assert other in forbidden
    assert violations(lambda i: in_package(i, worker) and i.top in forbidden) == []
    tops = {i.top for i in IMPORTS if in_package(i, worker)}
    assert {"engine", "kv_transfer"} <= tops


def test_router_imports_only_torch_free_engine_modules():
    def bad(i: Import) -> bool:
        if not in_package(i, "router"):
            return False
        if i.top in ("torch", "transformers", "ray", "msgpack"):
            return True
        if i.top == "engine":
            return i.module not in TORCH_FREE_ENGINE
        return i.top in set(PACKAGES) - {"router"}

    assert violations(bad) == []


def test_transformers_only_in_model_and_runner():
    allowed = {"engine/model.py", "engine/runner.py"}
    assert violations(lambda i: i.top == "transformers" and i.file not in allowed) == []


def test_msgpack_only_in_payload():
    assert violations(lambda i: i.top == "msgpack" and i.file != "kv_transfer/payload.py") == []


def test_ray_only_in_experiments_and_ray_store():
    def bad(i: Import) -> bool:
        if in_package(i, "experiments"):
            return False
        if i.top == "ray":
            return i.file != "kv_transfer/ray_store.py"
        if i.module == "kv_transfer.ray_store":  # would pull ray in with the module
            return not i.lazy or i.file != "kv_transfer/factory.py"
        return False

    assert violations(bad) == []


def test_experiments_import_ray_lazily_outside_placement():
    """Report (not a rule): which experiments modules import ray, and how."""
    eager = {i.file for i in IMPORTS if in_package(i, "experiments") and i.top == "ray"
             and not i.lazy}
    assert eager <= {"experiments/placement.py"}, eager


@pytest.mark.parametrize("module", TORCH_FREE_ENGINE + ("engine.scheduler",))
def test_torch_free_modules_have_no_module_level_torch(module):
    file = module.replace(".", "/") + ".py"
    assert violations(lambda i: i.file == file and not i.lazy
                      and i.top in ("torch", "transformers", "ray", "msgpack")) == []
    # and nothing they import at module level from pdlab brings torch in
    for i in IMPORTS:
        if i.file == file and not i.lazy and i.top == "engine" and i.module != "engine":
            assert i.module in TORCH_FREE_ENGINE + ("engine.scheduler",), str(i)


def test_torch_free_modules_import_without_torch_in_a_fresh_process():
    modules = list(TORCH_FREE_ENGINE) + ["engine.scheduler", "router.router", "router.policy",
                                         "router.calls"]
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in modules)
            + "bad = sorted(m for m in ('torch', 'transformers', 'ray', 'msgpack') if m in sys.modules)\n"
            + "print(','.join(bad))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"pulled in: {result.stdout.strip()}"
