"""The package's layers, read from the source: no import cycle among stopline's modules, the
pure layer (stopline/protocol/) imports only the standard library and itself, structured output
(stopline/structured/) only those and the protocol, the API dialects (stopline/api/) only those
and structured output, and the engine layer (stopline/engine/) imports nothing of the servers
above it, nor the settings it reads anything of the engine. No test imports conftest or another test
module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stopline"
PURE = "stopline.protocol"
STRUCTURED = "stopline.structured"
DIALECTS = "stopline.api"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, at_load: bool) -> set[str]:
    """The modules ``path`` imports: all of them, or (``at_load``) only those its loading runs, not
    those inside functions (run on demand) or under ``if TYPE_CHECKING:``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if at_load and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        if at_load and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # `from . import model` imports a module, not a name.
            found.update(f"{module}.{alias.name}" for alias in node.names if (module + "." + alias.name) in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _load_graph() -> dict[str, set[str]]:
    return {name: _imports(path, at_load=True) & MODULES.keys() for name, path in MODULES.items()}


def test_the_walk_reads_every_layer():
    graph = _load_graph()
    assert {"stopline.app", "stopline.engine.loop", "stopline.protocol.connection", "stopline.protocol.errors"} <= set(
        graph
    )
    assert "stopline.protocol.connection" in graph["stopline.session"]
    assert "stopline.protocol.vocabulary" in graph["stopline.protocol.connection"]
    assert {"stopline.protocol.validation", "stopline.structured.tool_calls"} <= graph["stopline.api.openai_fields"]


def test_no_module_imports_itself_back():
    graph = _load_graph()
    done: set[str] = set()

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for imported in sorted(graph[name]):
            found = cycle_from(imported, path + [name])
            if found:
                return found
        done.add(name)
        return None

    cycles = [cycle for name in sorted(graph) if (cycle := cycle_from(name, []))]
    assert cycles == [], " -> ".join(cycles[0])


def _strangers(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of ``package`` that import something beyond the standard library and ``allowed``, and what."""
    modules = {name: path for name, path in MODULES.items() if name == package or name.startswith(package + ".")}
    assert len(modules) >= 3, package
    strangers = {
        name: sorted(
            module
            for module in _imports(path, at_load=False)
            if module.split(".")[0] not in sys.stdlib_module_names
            and not any(module == layer or module.startswith(layer + ".") for layer in allowed)
        )
        for name, path in modules.items()
    }
    return {name: found for name, found in strangers.items() if found}


def test_the_pure_layer_imports_only_the_standard_library_and_itself():
    assert len([name for name in MODULES if name.startswith(PURE + ".")]) >= 8
    # Neither the dialects nor structured output: the grammar compiler reaches it through Limits.grammar_of.
    assert _strangers(PURE, (PURE,)) == {}


def test_structured_output_stands_on_the_protocol_alone():
    assert _strangers(STRUCTURED, (STRUCTURED, PURE)) == {}


def test_the_dialects_stand_on_the_protocol_and_structured_output_alone():
    # A dialect turns its body into the one generate frame, and the one outcome into its shapes; it serves nothing.
    assert _strangers(DIALECTS, (DIALECTS, STRUCTURED, PURE)) == {}


def test_the_layers_below_the_dialects_do_not_import_them():
    below = (PURE, STRUCTURED, "stopline.engine", "stopline.settings", "stopline.registry")
    upward = {
        name: sorted(module for module in _imports(path, at_load=False) if module.startswith(DIALECTS))
        for name, path in MODULES.items()
        if name.startswith(below)
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_the_engine_layer_imports_no_serving_module():
    # Below the servers: the pure layer, the settings (the config every layer reads) and the native loop.
    allowed = (PURE, "stopline.engine", "stopline.settings", "stopline._core")
    engine = {name: path for name, path in MODULES.items() if name.startswith("stopline.engine")}
    assert len(engine) >= 7
    upward = {
        name: sorted(
            module
            for module in _imports(path, at_load=False)
            if module.startswith("stopline.") and not module.startswith(allowed)
        )
        for name, path in engine.items()
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_the_settings_the_engine_reads_import_no_engine():
    # The engine reads its defaults and STOPLINE_ variables from the settings: they stand below it.
    settings = _imports(MODULES["stopline.settings"], at_load=False)
    assert {module for module in settings if module.startswith(("stopline.engine", "stopline._core"))} == set()


def test_no_test_imports_conftest_or_another_test_module():
    # Shared helpers live in tests/support/ (and the stand-ins beside it); a fixture comes
    # through pytest, never by import, so one test module can move without breaking another.
    tests = Path(__file__).resolve().parent
    found = {}
    for path in tests.rglob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        last_parts = {name.rpartition(".")[2] for name in imported}
        wrong = sorted(name for name in last_parts if name == "conftest" or name.startswith("test_"))
        if wrong:
            found[str(path.relative_to(tests))] = wrong
    assert found == {}
