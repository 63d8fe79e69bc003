"""Who may import whom, enforced by parsing every module with ``ast``.

The layer order (a package may import only those below it; experiments may import
everything):

    channel  <  engine.serving;  engine  <  kv_transfer  <  prefill_worker, decode_worker
    channel  <  prefill_worker, decode_worker
    engine (torch-free), channel.contract, channel.local  <  router  <  planner, server
    engine, kv_transfer, channel, workers, router, planner  <  deployment  <  experiments

Rules:
- engine imports no other pdlab package but ``channel`` in engine/serving.py (a worker's
  loop speaks the message plane); kv_transfer imports only engine; channel imports no
  other pdlab package;
- prefill_worker / decode_worker import engine, kv_transfer and channel, never each other;
- router imports only the torch-free engine modules, ``channel.contract`` and
  ``channel.local`` (its default hub, in-process), no torch/transformers/ray/msgpack/zmq;
- planner (the simulator and its models) imports only the torch-free engine modules and
  router: a plan never loads torch or Ray; server (the HTTP front end) the same, plus web
  libraries;
- inside experiments: a command (``experiments/commands/*``) imports shared modules, never
  another command; shared modules never import a command; only ``experiments/cli.py`` knows
  the commands (by module name, loaded on use);
- no import circle between any two modules (lazy imports count);
- at most ``MAX_LAZY_IMPORTS`` function-level imports in the whole tree (benchmarks but
  ``benchmarks/kv_transfer.py`` included), each with a comment saying why;
- transformers only in engine/model.py (engine/runner.py allowed); msgpack only in
  kv_transfer/payload.py and channel/wire.py; zmq only in channel/sockets.py; ray
  (``import ray`` / ``from ray...``) only in deployment/* and kv_transfer/ray_store.py;
  kv_transfer.ray_store itself only lazily (inside a function) outside deployment;
- deployment imports no experiments, server or benchmarks module;
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
PACKAGES = ("engine", "kv_transfer", "channel", "prefill_worker", "decode_worker", "router",
            "planner", "server", "deployment", "experiments")
TORCH_FREE_ENGINE = ("engine.request", "engine.config", "engine.metrics", "engine.events",
                     "engine.errors", "engine.arrivals", "engine.limits", "engine.kv_blocks",
                     "engine.placement", "engine.kv_heads", "engine.memory_fit", "engine.clock")
HEAVY = ("torch", "transformers", "ray", "msgpack", "zmq")
# the contract and the in-process hub (its default): no sockets, no msgpack
CHANNEL_FOR_ROUTER = ("channel", "channel.contract", "channel.local")
MAX_LAZY_IMPORTS = 10


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
    assert any(i.file == "engine/model.py" and i.top == "transformers" and not i.lazy
               for i in IMPORTS)
    assert any(i.file == "deployment/ray_actors.py" and i.top == "ray" and not i.lazy
               for i in IMPORTS)
    assert any(i.file == "deployment/placement.py" and i.module == "deployment.ray_actors"
               and i.lazy for i in IMPORTS)
    assert any(i.file == "kv_transfer/ray_store.py" and i.top == "ray" and not i.lazy
               for i in IMPORTS)
    assert any(i.file == "kv_transfer/payload.py" and i.module == "msgpack" for i in IMPORTS)
    assert any(i.file == "channel/wire.py" and i.module == "msgpack" for i in IMPORTS)
    assert any(i.file == "channel/sockets.py" and i.module == "zmq" for i in IMPORTS)
    assert any(i.file == "router/router.py" and i.module == "engine.events" for i in IMPORTS)
    assert any(i.file == "kv_transfer/factory.py" and i.module == "kv_transfer.ray_store"
               and i.lazy for i in IMPORTS)


def test_engine_imports_no_other_pdlab_package():
    pdlab_others = set(PACKAGES) - {"engine"}
    assert violations(lambda i: in_package(i, "engine") and i.top in pdlab_others
                      and not (i.file == "engine/serving.py" and i.top == "channel")) == []


def test_channel_imports_no_other_pdlab_package():
    others = set(PACKAGES) - {"channel"}
    assert violations(lambda i: in_package(i, "channel") and i.top in others) == []


def test_kv_transfer_imports_only_engine():
    others = set(PACKAGES) - {"engine", "kv_transfer"}
    assert violations(lambda i: in_package(i, "kv_transfer") and i.top in others) == []


@pytest.mark.parametrize("worker,other", [("prefill_worker", "decode_worker"),
                                          ("decode_worker", "prefill_worker")])
def test_workers_import_engine_and_kv_transfer_never_each_other(worker, other):
    forbidden = set(PACKAGES) - {"engine", "kv_transfer", "channel", worker}
    assert other in forbidden
    assert violations(lambda i: in_package(i, worker) and i.top in forbidden) == []
    tops = {i.top for i in IMPORTS if in_package(i, worker)}
    assert {"engine", "kv_transfer"} <= tops


@pytest.mark.parametrize("package,allowed", [("router", {"engine", "router", "channel"}),
                                             ("planner", {"engine", "router", "planner"}),
                                             ("server", {"engine", "router", "server"})])
def test_router_planner_server_import_only_torch_free_engine_modules(package, allowed):
    def bad(i: Import) -> bool:
        if not in_package(i, package):
            return False
        if i.top in HEAVY:
            return True
        if i.top == "engine":
            return i.module not in TORCH_FREE_ENGINE + ("engine.scheduler",)
        if i.top == "channel":
            return i.module not in CHANNEL_FOR_ROUTER
        return i.top in set(PACKAGES) - allowed

    assert violations(bad) == []


def test_deployment_imports_no_experiment_nor_front_end():
    assert violations(lambda i: in_package(i, "deployment")
                      and i.top in ("experiments", "server", "benchmarks")) == []
    tops = {i.top for i in IMPORTS if in_package(i, "deployment")}
    assert {"router", "prefill_worker", "decode_worker", "channel"} <= tops


def _command(file: str) -> bool:
    return file.startswith("experiments/commands/") and not file.endswith("__init__.py")


def test_commands_import_shared_modules_never_each_other_and_only_the_cli_knows_them():
    commands = {f[:-3].replace("/", ".") for f in {i.file for i in IMPORTS} if _command(f)}
    assert {"experiments.commands.compare", "experiments.commands.plan",
            "experiments.commands.serve"} <= commands
    assert violations(lambda i: i.module in commands and i.file != "experiments/cli.py") == []
    assert violations(lambda i: i.file == "experiments/cli.py" and i.top != "engine"
                      and i.top in PACKAGES) == []  # the CLI loads commands by name only


def test_no_import_circles():
    """Tarjan's strongly connected components over the module graph (lazy imports too)."""
    graph: dict[str, set[str]] = {}
    for i in IMPORTS:
        if i.top in PACKAGES:
            graph.setdefault(i.file[:-3].replace("/", "."), set()).add(i.module)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert circles == []


def _lazy_imports() -> list[tuple[str, int, str]]:
    """``(file, first line, source)`` of every group of imports inside a function (lines in
    a row are one group), in the packages and benchmarks/; the source starts with the line
    above the group (a comment may stand there instead)."""
    found = []
    for package in PACKAGES + ("benchmarks",):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lines = path.read_text().splitlines()
            collector = _Collector(rel, package)
            collector.visit(ast.parse("\n".join(lines), filename=rel))
            previous = -1
            for line in sorted({i.line for i in collector.imports if i.lazy}):
                if line == previous + 1:
                    found[-1] = (rel, found[-1][1], found[-1][2] + "\n" + lines[line - 1])
                else:
                    found.append((rel, line, lines[line - 2] + "\n" + lines[line - 1]))
                previous = line
    return found


def test_few_function_level_imports_each_saying_why():
    lazy = _lazy_imports()
    assert any(f == "kv_transfer/factory.py" for f, _, _ in lazy)  # the parser sees them
    assert len(lazy) <= MAX_LAZY_IMPORTS, "\n".join(f"{f}:{n}" for f, n, _ in lazy)
    assert [f"{f}:{n}" for f, n, text in lazy if "#" not in text] == []


def test_transformers_only_in_model_and_runner():
    allowed = {"engine/model.py", "engine/runner.py"}
    assert violations(lambda i: i.top == "transformers" and i.file not in allowed) == []


def test_msgpack_only_in_payload_and_the_channel_wire():
    allowed = {"kv_transfer/payload.py", "channel/wire.py"}
    assert violations(lambda i: i.top == "msgpack" and i.file not in allowed) == []


def test_zmq_only_in_the_channel_sockets():
    assert violations(lambda i: i.top == "zmq" and i.file != "channel/sockets.py") == []


def test_ray_only_in_deployment_and_ray_store():
    def bad(i: Import) -> bool:
        if in_package(i, "deployment"):
            return False
        if i.top == "ray":
            return i.file != "kv_transfer/ray_store.py"
        if i.module == "kv_transfer.ray_store":  # would pull ray in with the module
            return not i.lazy or i.file != "kv_transfer/factory.py"
        return False

    assert violations(bad) == []


def test_ray_eagerly_only_in_ray_actors():
    """Only ``deployment/ray_actors.py`` imports ray at module level, and placement imports
    it only for a Ray deployment, so local mode (``Deployment(local=True)``, ``make
    gpu-check``) runs where Ray is not installed."""
    eager = {i.file for i in IMPORTS if not i.lazy and i.top == "ray"} - {
        "kv_transfer/ray_store.py"}
    assert eager == {"deployment/ray_actors.py"}, eager
    assert violations(lambda i: i.file == "deployment/placement.py" and not i.lazy
                      and i.module == "deployment.ray_actors") == []


def test_local_placement_imports_where_ray_cannot_be_imported():
    """``sys.modules['ray'] = None`` makes every ``import ray`` fail, as on a box without it."""
    code = ("import sys\nsys.modules['ray'] = None\n"
            "import deployment.placement\nprint('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


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
                                         "router.calls", "router.assignment", "planner.simulate",
                                         "planner.search", "planner.band", "planner.diagnose",
                                         "planner.drift", "planner.latency", "server.app",
                                         "channel.contract", "channel.local"]
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in modules)
            + "bad = sorted(m for m in ('torch', 'transformers', 'ray', 'msgpack', 'zmq') "
              "if m in sys.modules)\n"
            + "print(','.join(bad))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"pulled in: {result.stdout.strip()}"


# ---- the test suite's own hygiene ------------------------------------------------------------
def _test_files(folder: str = "") -> list[Path]:
    return sorted((ROOT / "tests" / folder).rglob("test_*.py"))


def _required_dependencies() -> set[str]:
    """Import names of pyproject's required dependencies (not the optional extras)."""
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0].replace("-", "_").lower() for d in deps}


def test_required_dependencies_are_imported_never_skipped():
    """``pytest.importorskip`` of a required dependency (Ray) would turn a broken install into
    skipped tests; a plain import makes it fail."""
    required = _required_dependencies()
    assert {"ray", "torch", "msgpack"} <= required
    skipped = []
    for path in _test_files():
        text = path.read_text()
        if "importorskip" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value.split(".")[0].lower() in required):
                skipped.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[0].value}")
    assert skipped == []


@pytest.mark.parametrize("folder,marker", [("gpu", "gpu"), ("ray", "ray")])
def test_every_gpu_and_ray_test_file_carries_its_marker(folder, marker):
    unmarked = [str(p.relative_to(ROOT)) for p in _test_files(folder)
                if f"pytest.mark.{marker}" not in p.read_text()]
    assert _test_files(folder) and unmarked == []


def test_every_test_file_that_kills_a_worker_carries_the_workers_or_ray_marker():
    """``make test-fast`` leaves out, and ``tests/flakiness.py`` reruns, the tests marked
    ``workers`` or ``ray``: a file that kills a worker (``.kill(``) must say which it is."""
    unmarked = [str(p.relative_to(ROOT)) for p in _test_files() if ".kill(" in p.read_text()
                and not any(m in p.read_text() for m in ("pytest.mark.workers",
                                                          "pytest.mark.ray"))]
    assert [p for p in _test_files() if ".kill(" in p.read_text()] and unmarked == []


def test_every_ray_init_starts_its_own_cluster_or_names_one():
    """``ray.init()`` with no address joins whatever cluster this machine runs (another test
    run's, a user's ``ray start``): each call passes ``address=`` (``"local"`` for a private
    one) or ``ray_init_kwargs()``, which does."""
    calls = [(p, line) for p in ROOT.glob("[a-z]*/**/*.py") if ".venv" not in p.parts
             for line in p.read_text().splitlines() if line.lstrip().startswith("ray.init(")]
    loose = [f"{p.relative_to(ROOT)}: {line.strip()}" for p, line in calls
             if "address=" not in line and "**" not in line]
    assert calls and loose == []
