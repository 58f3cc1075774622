"""The package's shape: podagent's import graph has no cycle and no layer imports upward; no
class of some length goes without a docstring saying its one job, the top level stays
small, and the start sequence and the restart count are the kernel's alone.

Imports are read with `ast` from every module of podagent/, those inside functions (late
imports) included: a late import still ties two modules together. `from podagent import x`
counts as an import of the module podagent.x where x is one.

Layers, lowest first:
  foundation  the top-level modules podagent/*.py (not cli.py, __main__.py) and podagent/report/
  ray_access  the GCS client, Ray version gates
  platform    pod, NCCL, discovery, roles, the RunPod API
  kernel      run/: what every run does whatever runs its job (below both engines)
  packages    cluster/, checks/, control/, gang/, launch/, rewards/ (one layer; a package imports
              another only as ALLOWED_CROSS says)
  top         cli.py, __main__.py
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "podagent"

LAYERS = ("foundation", "ray_access", "platform", "kernel", "packages", "top")
PACKAGES = ("cluster", "checks", "control", "gang", "launch", "rewards")
TOP = ("podagent.cli", "podagent.__main__")

# Imports between two packages of the package layer that are allowed: (importer, imported).
ALLOWED_CROSS = {
    # The head supervises the built-in reward server: it reads its settings and `describe`
    # to say which profile it started (cluster/reward_server.py).
    ("cluster", "rewards"): "the head runs the reward server",
    # `podagent check --cluster` submits the cluster check as a job, through the head's own
    # JobRunner (checks/cluster_run.py); cluster never imports checks.
    ("checks", "cluster"): "the cluster check runs as a job",
    # The asking commands (`status`/`stop`/`logs`) are a client of each engine's own protocol
    # with its pods: a run without Ray's supervisor port (gang/mesh.py), a Ray run's store in
    # its head's GCS (cluster/runstate.py), which the checks read the cluster check's line of.
    ("control", "gang"): "the asking commands ask the supervisor of a run without Ray",
    ("control", "cluster"): "the asking commands read a Ray run's state in its head's GCS",
}

# Modules that import nothing of podagent, so that anything may import them.
LEAVES = ("podagent.choices",)

# A class is as long as its one job needs; past this many lines its docstring must say the job.
SAYS_ITS_JOB_PAST = 40
MAX_TOP_LEVEL_MODULES = 14


@dataclass(frozen=True)
class Import:
    importer: str  # module names, dotted
    imported: str
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} imports {self.imported}"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file; a package is its __init__.py."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str:
    """The module a dotted name is in: itself, else its nearest enclosing module."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of a podagent module by a podagent module, wherever in the file it is."""
    found = []
    root = modules["podagent"].parent.parent
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, up level - 1 packages
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                # `from P import x`: the module P.x where x is one, else P itself.
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                           else source for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != "podagent":
                    continue
                imported = _known(target, modules)
                if imported != module:
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.append(Import(module, imported, where))
    return found


def layer(module: str) -> tuple[int, str]:
    """(rank, name): the layer's rank (higher is higher up) and, in the package layer, the
    package."""
    parts = module.split(".")
    if module in TOP:
        return LAYERS.index("top"), "top"
    if len(parts) <= 2 or parts[1] in ("report", "config"):
        return LAYERS.index("foundation"), "foundation"
    if parts[1] in ("ray_access", "platform"):
        return LAYERS.index(parts[1]), parts[1]
    if parts[1] == "run":
        return LAYERS.index("kernel"), "kernel"
    assert parts[1] in PACKAGES, f"{module}: a package the layers do not name"
    return LAYERS.index("packages"), parts[1]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


MODULES = module_files()
IMPORTS = imports(MODULES)


def test_the_scan_sees_the_package():
    # A layout change that hid the modules from the scan would pass every check below.
    assert {"podagent.config", "podagent.cli", "podagent.rewards.settings"} <= set(MODULES)
    assert any(i.importer == "podagent.cli" and i.imported == "podagent.config"
               for i in IMPORTS)


def test_the_import_graph_has_no_cycle():
    found = cycles(IMPORTS)
    lines = []
    for component in found:
        lines.append("cycle: " + ", ".join(component))
        lines += [f"  {i}" for i in IMPORTS
                  if i.importer in component and i.imported in component]
    assert not found, "\n".join(lines)


def test_no_layer_imports_upward():
    upward = [i for i in IMPORTS if layer(i.imported)[0] > layer(i.importer)[0]]
    assert not upward, "imports of a higher layer:\n" + "\n".join(
        f"  {i} ({layer(i.importer)[1]} -> {layer(i.imported)[1]})" for i in upward)


def test_packages_import_each_other_only_as_allowed():
    rank = LAYERS.index("packages")
    crossing = [i for i in IMPORTS if layer(i.importer)[0] == layer(i.imported)[0] == rank
                and layer(i.importer)[1] != layer(i.imported)[1]
                and (layer(i.importer)[1], layer(i.imported)[1]) not in ALLOWED_CROSS]
    assert not crossing, "imports between packages not in ALLOWED_CROSS:\n" + "\n".join(
        f"  {i}" for i in crossing)


def test_every_allowed_crossing_is_still_used():
    """An entry of ALLOWED_CROSS no import needs any more must go."""
    pairs = {(i.importer, i.imported) for i in IMPORTS}
    crossings = {(layer(a)[1], layer(b)[1]) for a, b in pairs}
    assert not ALLOWED_CROSS.keys() - crossings, (
        f"remove from ALLOWED_CROSS: {ALLOWED_CROSS.keys() - crossings}")


# The two engines of the run kernel: what they share is in run/, so neither imports the other.
ENGINES = ("cluster", "gang")


def test_neither_engine_imports_the_other():
    crossing = [i for i in IMPORTS if {layer(i.importer)[1], layer(i.imported)[1]}
                == set(ENGINES)]
    assert not crossing, "\n".join(f"  {i}" for i in crossing)


# What only the run kernel does (run/start.py, run/restarts.py): a call of one of these
# outside podagent/run/ is an engine writing its own start sequence or its own restart count.
KERNEL_ONLY = {
    "install_signals": "a start's signal handling", "become_subreaper": "a start's subreaper",
    "recall": "a start's ledger recall", "report_end": "a start's end line and code",
    "settle": "what a pod does after a start", "restarting": "a restart's ledger entry",
    "policy.admit": "a restart's count", "policy.backoff": "a restart's backoff",
    "event(Event.RESTART)": "a restart's event",
}


def kernel_only_calls(modules: dict[str, Path]) -> list[str]:
    """Calls outside podagent/run/ of what only the kernel does, as path:line: what."""
    found = []
    root = modules["podagent"].parent.parent
    for module, path in modules.items():
        if module.startswith("podagent.run.") or module == "podagent.run":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            names = []
            if isinstance(func, ast.Name):
                names.append(func.id)
            elif isinstance(func, ast.Attribute):
                names.append(func.attr)
                if isinstance(func.value, ast.Name):
                    names.append(f"{func.value.id}.{func.attr}")
                first = node.args[0] if node.args else None
                if (func.attr == "event" and isinstance(first, ast.Attribute)
                        and ast.unparse(first) == "Event.RESTART"):
                    names.append("event(Event.RESTART)")
            for name in names:
                if name in KERNEL_ONLY:
                    found.append(f"  {path.relative_to(root)}:{node.lineno}: {name} "
                                 f"({KERNEL_ONLY[name]})")
    return found


def test_no_start_sequence_and_no_restart_count_outside_the_kernel():
    """Both engines are adapters of one start (run/start.py) and one restart (run/restarts.py):
    neither installs signals, recalls the ledger, picks an exit code, settles the pod, or
    counts, records or backs off a restart of its own."""
    found = kernel_only_calls(MODULES)
    assert not found, "done outside podagent/run/:\n" + "\n".join(found)


def test_the_kernel_only_scan_sees_what_it_looks_for(tmp_path):
    package = tmp_path / "podagent"
    (package / "run").mkdir(parents=True)
    (package / "gang").mkdir()
    for init in (package, package / "run", package / "gang"):
        (init / "__init__.py").write_text("")
    (package / "run" / "start.py").write_text("install_signals(r)\npolicy.admit(s, 0, 'x')\n")
    (package / "gang" / "run.py").write_text(
        "import x\nsignals = install_signals(r)\nn = policy.admit(s, 0, 'w')\n"
        "r.event(Event.RESTART, n=1)\nledger.restarting({})\nr.event(Event.EXIT)\n")
    found = kernel_only_calls(module_files(package))
    assert [line.split(": ", 1)[1].split(" (")[0] for line in found] == [
        "install_signals", "policy.admit", "event(Event.RESTART)", "restarting"]


def test_leaves_import_nothing_of_podagent():
    leaning = [i for i in IMPORTS if i.importer in LEAVES]
    assert not leaning, "\n".join(f"  {i}" for i in leaning)


def test_every_class_of_some_length_says_its_job():
    silent = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef) and not ast.get_docstring(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > SAYS_ITS_JOB_PAST:
                    where = path.relative_to(PACKAGE.parent)
                    silent.append(f"  {where}:{node.lineno}: class {node.name}, {lines} lines")
    assert not silent, (f"classes over {SAYS_ITS_JOB_PAST} lines without a docstring saying "
                        f"their job:\n" + "\n".join(silent))


def test_the_top_level_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(top)} modules directly in podagent/ (at most {MAX_TOP_LEVEL_MODULES}): {top}")


def test_the_scan_reads_late_relative_and_package_imports(tmp_path):
    package = tmp_path / "podagent"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import os\n\ndef f():\n    from podagent import b  # late\n",
        "b.py": "from . import c\nfrom .c import thing\n",
        "c.py": "import podagent.a\nthing = 1\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..a import f\nfrom podagent import __version__\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    found = imports(module_files(package))
    assert sorted((i.importer, i.imported, i.where) for i in found) == [
        ("podagent.a", "podagent.b", "podagent/a.py:4"),
        ("podagent.b", "podagent.c", "podagent/b.py:1"),
        ("podagent.b", "podagent.c", "podagent/b.py:2"),
        ("podagent.c", "podagent.a", "podagent/c.py:1"),
        ("podagent.sub.d", "podagent", "podagent/sub/d.py:2"),
        ("podagent.sub.d", "podagent.a", "podagent/sub/d.py:1"),
    ]
    assert cycles(found) == [["podagent.a", "podagent.b", "podagent.c"]]


def test_layers():
    assert layer("podagent.config") == layer("podagent.report.wandb_run") == (0, "foundation")
    assert layer("podagent.ray_access.gcs")[0] < layer("podagent.platform.pod")[0] \
        < layer("podagent.cluster.head")[0] == layer("podagent.rewards.settings")[0] \
        < layer("podagent.cli")[0] == layer("podagent.__main__")[0]
    assert layer("podagent.rewards.__main__") == (LAYERS.index("packages"), "rewards")
