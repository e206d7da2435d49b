"""The layout of tagc/ (issue 38, "one room per concept"), read from the sources with ast:
no import circle among its modules (every .py file under tagc/), no import of the facade tagc_hook, and one module,
tagc/codec.py, that imports the C extension _tagc.  Imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
CODEC = "tagc.codec"  # the one owner of `import _tagc`


def _modules() -> Dict[str, Path]:
    """Dotted name -> file, for every .py file under tagc/ (tagc/*.py, tagc/train/*.py,
    and any subpackage added later)."""
    out = {}
    for path in sorted((ROOT / "tagc").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[Tuple[str, Tuple[str, ...]]]:
    """(imported module, names taken from it) for every import statement in the file,
    at any depth (function bodies included), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def _edges(name: str, path: Path) -> Set[str]:
    """The tagc modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    out = set()
    for mod, names in _imports(name, path):
        subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
        out.update(subs)
        if mod in MODULES and (not names or len(subs) < len(names)):
            out.add(mod)
    out.discard(name)
    return out


def _cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle of ``graph`` (its modules, the first repeated last), or []."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_scan_sees_the_package() -> None:
    assert {"tagc.state", "tagc.codec", "tagc.wrapping", "tagc.train.sharding"} <= set(MODULES)
    assert "tagc.hsdp" in _edges("tagc.wrapping", MODULES["tagc.wrapping"])
    assert "tagc.teardown" in _edges("tagc.train.loop", MODULES["tagc.train.loop"])


def test_no_import_circle_in_tagc() -> None:
    graph = {name: _edges(name, path) for name, path in MODULES.items()}
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_tagc_never_imports_the_facade() -> None:
    """tagc_hook re-exports tagc/; the package imports its own modules."""
    bad = [name for name, path in MODULES.items()
           if any(mod.split(".")[0] == "tagc_hook" for mod, _ in _imports(name, path))]
    assert bad == [], bad


def test_only_the_codec_module_imports_the_extension() -> None:
    """`import _tagc` lives in tagc/codec.py; the others take the handle from there
    (`from .codec import _tagc`), never from another module (`transports._tagc`)."""
    files = dict(MODULES, tagc_hook=ROOT / "tagc_hook.py")
    importers = sorted(name for name, path in files.items()
                       if any(mod.split(".")[0] == "_tagc" for mod, _ in _imports(name, path)))
    assert importers == [CODEC], importers
    for name, path in files.items():
        for mod, names in _imports(name, path):
            assert "_tagc" not in names or mod == CODEC, (name, mod)
        tree = ast.parse(path.read_text())
        reached = [ast.unparse(n) for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr == "_tagc"
                   and ast.unparse(n.value) not in ("codec", CODEC)]
        assert reached == [], (name, reached)
