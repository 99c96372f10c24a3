"""How the packages import each other: no circles (not even through type-only imports),
`reconcile.decide()` on pure modules only, and every library bij-api reaches declared in pyproject.

The graph is read from the source with `ast`, every import counted (those inside functions too:
a lazy import is still a dependency, it only hides a circle until the function runs), except
those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"bij": ROOT / "src" / "bij"}

# What `decide()` may stand on: plain data and functions over it, no storage, Kubernetes or processes.
PURE = {
    "bij.control.reconcile", "bij.contract.fingerprint", "bij.contract.rounds",
    # decide()'s own parts: what it reads of the cluster, the decisions, and its rules (one module each)
    "bij.control.observe", "bij.control.decisions", "bij.control.rules",
    "bij.control.rules.ended", "bij.control.rules.permissions", "bij.control.rules.stop", "bij.control.rules.steps",
    "bij.control.rules.rounds", "bij.control.rules.canary", "bij.control.rules.publish",
    "bij.control.rules.pool_round",
    "bij.control.stopping",  # whether cancel was asked or the deadline passed: the spec, the status, a clock
    "bij.control.permissions",  # the worker grants and the recorded answer about them (asked in access_review)
    "bij.control.pools",  # spec.workers.pools: which lanes run in which pool, when a pool gives up (plain data)
    "bij.contract", "bij.contract.codes", "bij.contract.errors", "bij.contract.spec",
    "bij.contract.spec_base", "bij.contract.spec_io", "bij.contract.spec_model", "bij.contract.spec_workers",
    "bij.contract.plan", "bij.contract.publish_plan", "bij.contract.globs",
    "bij.contract.step_report",  # a step's report as the status holds it: pydantic over plain data
    "bij.contract.step_results",  # each step kind's result in that report: pydantic over plain data
    "bij.contract.manifest",  # the manifest's model (a manifest step's summary counts it): reads only what it is given
    "bij.contract.lane_report",  # a lane's report as the status holds it: pydantic over plain data
    "bij.contract.round_record",  # a round's record as the status holds it: pydantic over plain data
    "bij.contract.columns",  # the names a published row uses: the spec refuses them as pass-through columns
    "bij.contract.sampling",  # the spec's sampling defaults are checked with the rows' own rules
    "bij.contract.schema",  # the CEL rules and schema extras declared on the spec's models: data
    "bij.contract.status",  # the bij's status as decide() reads it: pydantic over plain data
    "bij.contract.prompt",  # spec.prompt's template is parsed when the spec is (Jinja, sandboxed: no I/O)
    "bij.contract.canary",  # spec.canary's verdict and estimate: arithmetic over the canary step's figures
    "bij.contract.efficiency",  # how money and durations are written: arithmetic
    "bij.contract.engines",  # what each engine is: a table of data
    "bij.contract.schemes",  # the storage schemes: a table of data
    "bij.contract.layout",  # where a job's objects live: names joined into URIs
    "bij.contract.formats",  # the output formats: a Literal
}
IMPURE_LIBRARIES = {"boto3", "botocore", "kopf", "kubernetes", "urllib3", "subprocess", "socket", "threading",
                    "zstandard", "pyarrow"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: Path, modules: set[str], type_only: bool = False) -> set[str]:
    """Every module name `module` imports at run time: ``from a import b`` names ``a.b`` when that is a
    module of ours, else ``a`` (a package's own import of its submodule is no edge to the package)."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                names.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def import_graph(type_only: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, every name each module imports); with `type_only`, the imports under
    ``if TYPE_CHECKING:`` count too."""
    modules = _modules()
    imported = {m: _imported_names(m, p, set(modules), type_only) for m, p in modules.items()}
    edges = {m: {n for n in names if n in modules and n != m} for m, names in imported.items()}
    return edges, imported


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_circle_through(v, component, edges))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def _circle_through(start: str, component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside one component, for the failure message."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a component but on no circle")


def test_the_graph_sees_lazy_imports_and_skips_type_checking_ones() -> None:
    edges, _ = import_graph()
    # bij-worker imports the lane's main inside its main; fingerprint names storage's ObjectInfo
    # only for mypy.
    assert "bij.worker.main" in edges["bij.cli.worker"]
    assert "bij.storage" not in edges["bij.contract.fingerprint"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circles_in_the_operator_or_the_worker() -> None:
    edges, _ = import_graph()
    found = cycles(edges)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_circles_even_through_imports_only_for_the_type_checker() -> None:
    # A circle hidden under TYPE_CHECKING still ties two modules together for a reader: none either.
    edges, _ = import_graph(type_only=True)
    assert "bij.worker.stopflag" in edges["bij.worker.schedulers"]
    found = cycles(edges)
    assert not found, "import circles through type-only imports: " + "; ".join(" -> ".join(c) for c in found)


def test_decide_imports_only_pure_modules() -> None:
    edges, imported = import_graph()
    reached, todo = set(), ["bij.control.reconcile"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(edges[m])
    assert reached <= PURE, f"reconcile reaches modules that are not pure: {sorted(reached - PURE)}"
    libraries = {name.split(".")[0] for m in reached for name in imported[m]}
    assert not libraries & IMPURE_LIBRARIES, f"reconcile reaches {sorted(libraries & IMPURE_LIBRARIES)}"


def test_importing_reconcile_loads_no_storage_kubernetes_or_publishing() -> None:
    # The same rule, checked on the interpreter rather than on the source.
    code = ("import sys, bij.control.reconcile; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('bij', 'boto3', "
            "'kopf', 'kubernetes', 'zstandard', 'pyarrow')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(out) <= PURE | {"bij", "bij.control"}, sorted(set(out) - PURE)


def test_the_layer_contracts_hold() -> None:
    # pyproject.toml's import-linter contracts: each layer imports only the layers below it, control
    # imports no storage, engine, worker or step code, decide() and its rules nothing that applies or renders,
    # steps no engine, bij-api no worker, engine or step;
    # imports for type checking count as well (a type-only import still ties the layers).
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config.get("exclude_type_checking_imports") is False
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in done.stdout


# Imported by a module bij-api reaches, but only on a path it never takes: its files prefix is file:// or
# s3://, never an hf:// input (bij.storage.hf), whose library comes with the engines' extras.
NOT_BIJ_API = {"huggingface_hub"}


def _requirement_names(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"][extra]
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower()  # type: ignore[union-attr]
            for r in reqs}


def test_every_library_bij_api_imports_is_declared_in_the_operator_extra() -> None:
    """`pip install bij[operator]` (the image's bij-api) has every library a module bij-api reaches imports,
    lazy imports included: none may come only as another's dependency."""
    edges, names = import_graph()
    reached, todo = set(), [m for m in edges if m == "bij.api" or m.startswith("bij.api.")]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += edges[m]
    libraries = {n.split(".")[0]: m for m in sorted(reached) for n in names[m]
                 if n.split(".")[0] not in sys.stdlib_module_names | {"bij", "__future__"}}
    assert {"aiohttp", "kubernetes", "pydantic", "urllib3"} <= set(libraries)  # the walk sees what it must
    dists = importlib.metadata.packages_distributions()
    declared = _requirement_names("operator")
    missing = {}
    for lib, module in libraries.items():
        if lib in NOT_BIJ_API:
            continue
        found = {re.sub(r"[-_.]+", "-", d).lower() for d in dists.get(lib, [])}
        assert found, f"{module} imports {lib}, which no installed distribution provides"
        if not found & declared:
            missing[lib] = (module, sorted(found))
    assert not missing, f"imported by bij-api's modules but not declared in pyproject's dependencies or its " \
                        f"operator extra: {missing}"
