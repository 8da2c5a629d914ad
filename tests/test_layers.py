"""The layers of the product, read from its import statements (with ast: nothing is imported).

    entry points    scheduler_svc.cli and its subcommand modules (serve_cli starts every
                    service), http_svc (the gateway: a client of the public API), router_svc
                    (the router: the public API in front of several replicas)
    scheduler_svc   requests, policy, the engine; the KV cache and the model through their
                    clients (kvcache_svc.client, model_svc.client) or, embedded, in process
    kvcache_svc, model_svc
    contracts       the shared layer
    pico_kernels, protos

An import points down or within its own package, never up or sideways (ALLOWED), and no two
product modules import each other, directly or around a loop. Every import statement counts:
module level, inside a function, under TYPE_CHECKING. A lazy import still ties two modules
together, so one that only dodges a cycle is a cycle here too. Not counted: a submodule's
implicit import of its own package's __init__ (every submodule has it; counting it would make
a package __init__ that names a submodule a cycle by construction).

The scheduler service's process never imports torch: checked here by importing its entry
point in a fresh interpreter, and in tests/services on the running process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (
    "contracts",
    "scheduler_svc",
    "kvcache_svc",
    "model_svc",
    "http_svc",
    "router_svc",
    "pico_kernels",
    "protos",
)
SERVICES = ("scheduler_svc", "kvcache_svc", "model_svc", "http_svc", "router_svc")
# What each package may import besides itself: the layers below it.
ALLOWED = {
    "contracts": {"protos"},
    "pico_kernels": set(),
    "protos": set(),
    "kvcache_svc": {"contracts", "protos"},
    "model_svc": {"contracts", "protos", "pico_kernels"},
    "scheduler_svc": {"contracts", "protos", "kvcache_svc", "model_svc"},
    "http_svc": {"contracts", "protos"},
    "router_svc": {"contracts", "protos"},
}
# (module, package) pairs allowed beyond ALLOWED, each with its reason.
EXCEPTIONS = {
    # `picovllm serve all|http` starts the gateway and waits for its health: the one entry point
    # that starts every service imports each of them, inside the functions that start them.
    ("scheduler_svc.serve_cli", "http_svc"): "serve_cli starts the HTTP gateway",
    ("scheduler_svc.serve_cli", "router_svc"): "serve_cli starts the router",
}
# Folders of a source checkout that are not installed: product code never imports them
# (scheduler_svc.bench_cli loads bench/ by path when a bench command runs, from a checkout).
UNPACKAGED = ("bench", "tests", "loadtest", "scripts", "compose")
# The layers the torch-free scheduler process imports: they must not name torch at all.
TORCH_FREE = ("contracts", "kvcache_svc", "router_svc")
TORCH = ("torch", "triton", "transformers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _product_files() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


MODULES = _product_files()


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in the file. `from X import
    Y` counts as an import of X.Y when that is a product module, else of X."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, `level - 1` packages up
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else source))
    return sorted(set(found))


def _product_target(imported: str) -> str | None:
    """The product module an import loads (the longest product prefix), or None."""
    parts = imported.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


GRAPH = {name: [(line, imported) for line, imported in _imports(name, path)] for name, path in MODULES.items()}


def test_every_import_points_down():
    wrong = []
    for name, imports in GRAPH.items():
        package = name.split(".")[0]
        for line, imported in imports:
            top = imported.split(".")[0]
            if top not in PACKAGES or top == package or top in ALLOWED[package] or (name, top) in EXCEPTIONS:
                continue
            wrong.append(f"{MODULES[name].relative_to(REPO)}:{line}: {package} imports {imported}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_services_and_contracts_stay_in_their_layer():
    # The rules ALLOWED encodes, spelled out: the two services never reach up to the
    # scheduler (or the gateway), and the shared layer imports no service.
    for package in ("kvcache_svc", "model_svc"):
        assert not ALLOWED[package] & {"scheduler_svc", "http_svc"}
    assert not ALLOWED["contracts"] & set(SERVICES)
    assert all(module.split(".")[0] == "scheduler_svc" for module, _ in EXCEPTIONS)


def test_no_product_module_imports_unpackaged_folders():
    wrong = [
        f"{MODULES[name].relative_to(REPO)}:{line}: {imported}"
        for name, imports in GRAPH.items()
        for line, imported in imports
        if imported.split(".")[0] in UNPACKAGED
    ]
    assert not wrong, "product code importing what is not installed:\n" + "\n".join(wrong)


def test_torch_free_layers_never_name_torch():
    wrong = [
        f"{MODULES[name].relative_to(REPO)}:{line}: {imported}"
        for name, imports in GRAPH.items()
        if name.split(".")[0] in TORCH_FREE
        for line, imported in imports
        if imported.split(".")[0] in TORCH
    ]
    assert not wrong, "torch in a layer the scheduler process imports:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing
    itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    edges = {
        name: {t for _, imported in imports if (t := _product_target(imported)) is not None}
        for name, imports in GRAPH.items()
    }
    cycles = _cycles(edges)
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_scheduler_service_imports_no_torch():
    """The scheduler service's entry point, its engine for service mode, both clients and the
    tokenizer it loads, and the router, in a fresh interpreter."""
    code = (
        "import sys\n"
        "import scheduler_svc.server, scheduler_svc.remote_engine, kvcache_svc.client, model_svc.client\n"
        "import router_svc.server\n"
        "from contracts.service_config import BUNDLED_MODEL\n"
        "from contracts.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(BUNDLED_MODEL)\n"
        "assert tok.decode(tok.encode('Once upon a time'), skip_special_tokens=True) == 'Once upon a time'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
