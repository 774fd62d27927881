"""The import layers, read from the source (ast; nothing is imported).

From the bottom up: ``ssdcore`` (torch only) and the client package ``ssdrbm`` (its generated
stubs and the upload dtype table, which the service imports too) know nothing of each other or of
the service. In ``ssdrbm_server``, a few shared modules (settings, keys, errors, logs, ...)
import only each other and the store; the store (``store/``) imports only itself and them; the
worker (``worker/``) builds on the store, the shared modules and the job spec (``job_spec.py``,
the API side's reading of a resolved spec), and reaches the API side through nothing else.
Everything else in ``ssdrbm_server`` is the API side. No module imports itself back through a
cycle.

Imports inside functions count as well (a lazy import is still a dependency), except those
under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ssdcore": ROOT / "ssdcore", "ssdrbm_server": ROOT / "server" / "ssdrbm_server"}
PACKAGES["ssdrbm"] = ROOT / "client" / "ssdrbm"

# Modules of ssdrbm_server that the API side, the worker and the store may import: they import
# only each other and the store (checked; a cycle would fail test_no_import_cycles).
SHARED = {
    "ssdrbm_server.catalog",  # built-in datasets and the data directory
    "ssdrbm_server.config",
    "ssdrbm_server.cpus",
    "ssdrbm_server.entry_point",  # the service's and the worker's way from settings to exit code
    "ssdrbm_server.errors",
    "ssdrbm_server.exposure",  # its repeated warnings serve the Redis checks too
    "ssdrbm_server.handlers",  # wraps gRPC handlers: the error mapping (errors.py) uses it
    "ssdrbm_server.keys",
    "ssdrbm_server.logs",
    "ssdrbm_server.outage",  # a Redis outage logged once per process, whoever notices it
    "ssdrbm_server.metrics",  # the Prometheus registry, served by the API or a worker alone
    "ssdrbm_server.rank_metrics",  # a metric's direction: the leaderboard and the rung decision
    "ssdrbm_server.readiness",  # health, and the worker's heartbeat file
    "ssdrbm_server.redis_wait",  # --wait-for-redis, for both programs
    "ssdrbm_server.redis_checks",  # Redis persistence checks, in the API and in every worker
    "ssdrbm_server.tenancy",  # the caller's tenant, set by authentication, read by logs
    "ssdrbm_server.tracing",
    "ssdrbm_server.vocabulary",
}
# The API side's module that the worker imports: how a resolved spec is read.
JOB_SPEC = "ssdrbm_server.job_spec"
# Imports that break a layer, kept for now, each with the reason and the way out.
KNOWN_BREAKS: set[str] = set()


def module_files() -> dict[str, Path]:
    """Every module of the three packages by its dotted name (a package by its __init__)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = module_files()


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except what sits under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(name: str) -> set[str]:
    """The modules of the three packages that module ``name`` imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from pkg import module` imports that module
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {module for module in found if module in MODULES}


IMPORTS = {name: imports_of(name) for name in MODULES}


def layer_breaks(importers: str, allowed: Callable[[str], bool]) -> list[str]:
    """``a -> b`` for each import of a module whose name starts with ``importers`` that
    ``allowed(b)`` refuses, other than the KNOWN_BREAKS."""
    found = {
        f"{name} -> {target}"
        for name, targets in IMPORTS.items()
        if name == importers or name.startswith(f"{importers}.")
        for target in targets
        if not allowed(target)
    }
    return sorted(found - KNOWN_BREAKS)


def within(*packages: str) -> Callable[[str], bool]:
    """Whether a module is one of ``packages`` or inside one."""
    return lambda module: any(module == p or module.startswith(f"{p}.") for p in packages)


def test_the_modules_are_found() -> None:
    assert {"ssdcore.training", "ssdrbm.datasets", "ssdrbm_server.worker.runner"} <= set(MODULES)
    assert "ssdrbm_server.job_spec" in IMPORTS["ssdrbm_server.worker.child"]
    assert "ssdrbm_server.logs" in IMPORTS["ssdrbm_server.worker.child"]  # from pkg import mod
    assert SHARED | {JOB_SPEC} <= set(MODULES)


def test_ssdcore_imports_nothing_of_the_service_or_the_client() -> None:
    assert layer_breaks("ssdcore", within("ssdcore")) == []


def test_the_client_imports_nothing_of_ssdcore_or_the_service() -> None:
    assert layer_breaks("ssdrbm", within("ssdrbm")) == []


def test_the_service_uses_the_sdk_but_not_the_command_line_tool() -> None:
    assert layer_breaks("ssdrbm_server", lambda m: not within("ssdrbm.cli")(m)) == []


def test_the_shared_modules_import_no_api_side_and_no_worker_module() -> None:
    service, store = within("ssdrbm_server"), within("ssdrbm_server.store")
    for name in sorted(SHARED):
        outside = layer_breaks(name, lambda m: not service(m) or m in SHARED or store(m))
        assert outside == [], f"{name} is shared by the API and the worker but imports {outside}"


def test_the_known_breaks_are_still_there() -> None:
    """A break that is fixed leaves the list, so the list says what is left to fix."""
    for known in KNOWN_BREAKS:
        name, target = known.split(" -> ")
        assert target in IMPORTS[name], f"{known} is gone: remove it from KNOWN_BREAKS"


def test_the_job_spec_module_imports_only_ssdcore_and_shared_modules() -> None:
    allowed = within("ssdcore", "ssdrbm")
    assert layer_breaks(JOB_SPEC, lambda m: allowed(m) or m in SHARED) == []


def test_the_store_imports_no_api_side_and_no_worker_module() -> None:
    store_or_below = within("ssdrbm_server.store", "ssdcore", "ssdrbm")
    breaks = layer_breaks(
        "ssdrbm_server.store",
        lambda module: store_or_below(module) or module in SHARED,
    )
    assert breaks == []


def test_the_worker_reaches_the_api_side_only_through_the_store_and_the_job_spec() -> None:
    below = within("ssdrbm_server.worker", "ssdrbm_server.store", "ssdcore", "ssdrbm")
    breaks = layer_breaks(
        "ssdrbm_server.worker",
        lambda module: below(module) or module in SHARED or module == JOB_SPEC,
    )
    assert breaks == []


def cycles() -> list[list[str]]:
    """The import cycles between modules: strongly connected components of more than one
    module, or a module importing itself (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(IMPORTS[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(IMPORTS[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in IMPORTS[node]:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_cycles() -> None:
    assert cycles() == []
