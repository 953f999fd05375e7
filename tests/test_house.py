"""The house rules, read from the code: no import circle between the package's parts (imports inside functions
included), no private name used across modules, no function over 60 lines, and a one-line docstring per folder."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "t5compress"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(p.read_text(), str(p))
    return out


MODULES = _modules()


def _part(module: str) -> str:
    """The part of the house a module belongs to: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """Every `t5compress` import in `tree`, at any depth: (module, names)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("t5compress"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("t5compress")]
    return found


def _edges(part=_part) -> dict[str, set[str]]:
    """Who imports whom, between parts (`part` maps a module to its part; the package face is left out)."""
    edges: dict[str, set[str]] = {}
    for module, tree in MODULES.items():
        for target, names in _imports(tree):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]  # `from pkg import module`
            targets = subs + ([target] if len(subs) < len(names) or not names else [])
            for t in targets:
                a, b = part(module), part(t)
                if a != b and b != "t5compress":
                    edges.setdefault(a, set()).add(b)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle_between_parts_of_the_package():
    assert _cycle(_edges()) is None, " -> ".join(_cycle(_edges()))


def test_no_import_circle_between_modules():
    edges = _edges(lambda m: m)
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_circle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def _module_aliases(tree: ast.Module) -> set[str]:
    """Names bound to a t5compress module in `tree` (`from t5compress.x import mod`, `import t5compress.x as m`)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("t5compress"):
            aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name in MODULES}
    return aliases


def test_no_private_name_is_used_from_another_module():
    private = [f"{m}: {t}.{n}" for m, tree in MODULES.items() for t, names in _imports(tree)
               for n in names if n.startswith("_") and n != "__version__"]
    for m, tree in MODULES.items():
        aliases = _module_aliases(tree)
        private += [f"{m}: {n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id in aliases
                    and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert private == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_fit_in_a_head(module):
    functions = [n for n in ast.walk(MODULES[module]) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    long = [f"{f.name}: {f.end_lineno - f.lineno + 1} lines" for f in functions
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PACKAGE.rglob("__init__.py")))
def test_every_folder_says_what_it_is(folder):
    init = PACKAGE / "__init__.py" if folder == "t5compress" else PACKAGE / folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{init} has no one-line docstring"


def test_the_runtime_imports_only_what_a_triton_repository_ships_with_it():
    from t5compress.triton.repository import RUNTIME_FILES

    shipped = {f"t5compress.{f.removesuffix('.py')}" for f in RUNTIME_FILES if f != "__init__.py"}
    outside = sorted({f"{m} -> {t}" for m, tree in MODULES.items() if m.startswith("t5compress.runtime")
                      for t, _ in _imports(tree) if not any(t == s or t.startswith(s + ".") for s in shipped)})
    assert outside == []
