"""The package's shape, read from its source with the standard library's ast: no import circles,
imports that flow one way through the layers docs/design.md draws, and one decoding loop (only the
engine feeds the model to decode)."""

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parents[1] / "llama_tp"

# docs/design.md's layers, top to bottom: a room may import the rooms of its own layer and of any
# layer below it, never one above. A room is a folder of llama_tp, or a module flat in it
# ("__init__" for the package's own).
LAYERS = [
    {"bench", "bench_serve", "convert", "plan", "reshard", "run_batch", "tools"},  # the commands
    {"serve"},  # the HTTP door
    {"__init__", "generation", "context", "decoding"},  # the API door, its check of max_seq_len and of decoding options
    {"engine"},  # the loop under every door
    {"checkpoint"},  # files: loading and writing checkpoints
    {"structured", "sampling", "text"},
    {"model"},  # the transformer, its cache, its quantized layers, its memory plan
    {"parallel"},
    {"kernels"},
    {"logs", "optional"},
]
# Imports against the flow, each imported only where it is used, and why.
AGAINST_THE_FLOW = {
    ("llama_tp.generation", "llama_tp.tools.demo"):
        "Llama.build() without paths builds the demo model, which the commands' code fetches and converts",
}
# What calls the model's passes: one of these on anything, outside the engine and outside the
# modules that define a forward of their own (the model's insides), is a second decoding loop.
PASSES = {"forward", "forward_segments", "decode_step"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str) -> Iterator[str]:
    """The package's modules that module `name` imports (TYPE_CHECKING imports too): `from . import
    x` names module x, not the package it comes from; a package's metadata (`__version__`) is none."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if alias.name.startswith("__"):
                    continue
                if f"{source}.{alias.name}" in MODULES:
                    yield f"{source}.{alias.name}"
                elif source in MODULES:
                    yield source
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in MODULES)


def circles() -> list[list[str]]:
    """Every set of modules that import each other round a circle (Tarjan's strongly connected
    components of more than one module, or one that imports itself)."""
    graph = {name: set(imports(name)) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while not component or component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1 or name in graph[name]:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(name: str) -> int:
    return next(number for number, rooms in enumerate(LAYERS) if room(name) in rooms)


def test_no_module_imports_itself_round_a_circle():
    assert circles() == []


def test_every_room_has_a_layer():
    assert sorted({room(name) for name in MODULES} - set().union(*LAYERS)) == []


def test_few_modules_sit_flat_in_the_package():
    """Besides the package's own and the API door, the flat modules are the commands' entry points
    (python -m llama_tp.X) and the bottom layer's two helpers: everything else lives in a room."""
    flat = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert len(flat) <= 12, flat


def test_imports_flow_down_the_layers():
    upward = [f"{name} imports {other}" for name in sorted(MODULES) for other in imports(name)
              if layer(other) < layer(name) and (name, other) not in AGAINST_THE_FLOW]
    assert upward == []


def test_only_the_engine_feeds_the_model_to_decode():
    """The model's passes are called from llama_tp/engine/ alone (its step and speculation's
    rounds), and from the model's own modules, which define a forward of their own."""
    callers = []
    for name, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text())
        defines_forward = any(isinstance(node, ast.FunctionDef) and node.name == "forward" for node in ast.walk(tree))
        if room(name) == "engine" or defines_forward:
            continue
        callers += [f"{name}:{node.lineno} calls {node.func.attr}" for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PASSES]
    assert callers == []
