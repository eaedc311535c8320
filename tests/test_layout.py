"""The house rules that keep the code easy to change: no import circle among the package's modules
(imports inside functions count), functions that fit on a screen, no import of another module's
private names."""
import ast
from pathlib import Path

from helpers import REPO

SRC = REPO / "src"
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "vramfit").rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def test_no_import_circle_among_the_package_modules():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}

    def reaches(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert not [m for m in modules if m in reaches(m)]


def _python_files():
    return sorted([*(SRC / "vramfit").rglob("*.py"), *(REPO / "tests").glob("*.py")])


def test_functions_fit_on_a_screen():
    long = [f"{p.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in _python_files() for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_no_import_of_another_modules_private_names():
    private = [f"{p.relative_to(REPO)}:{n.lineno} {a.name}" for p in _python_files()
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] in ("vramfit", "conftest"))
               for a in n.names if a.name.startswith("_")]
    assert not private


MAX_TOP_MODULES = 12


def test_few_modules_at_the_top_of_the_package():
    """The folders show the architecture: a module lives in the sub-package of its concern, and only
    what every layer shares (and the entry) stays at the top."""
    top = sorted(p.name for p in (SRC / "vramfit").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_every_sub_package_says_what_it_holds():
    silent = [p.parent.name for p in sorted((SRC / "vramfit").glob("*/__init__.py"))
              if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not silent
