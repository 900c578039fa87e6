"""The package's import graph, read statically (every ``import``, at module level or inside a function), has no cycle;
the module index of the package docstring and README sorts every root module into library and commands.

An import inside a function hides a cycle from a plain ``import`` of each module, and still ties the two modules
together: this test sees those too. An edge goes to the module an import names (``from .models import x``: the
``models`` package; ``from . import data``: the ``data`` module), not to the packages Python initialises on the way.
"""
import ast
import re
from pathlib import Path
from typing import Dict, List, Optional, Set

import timm_attnconv

PACKAGE_DIR = Path(timm_attnconv.__file__).parent
PACKAGE = PACKAGE_DIR.name


def _module_name(path: Path) -> str:
    parts = (PACKAGE,) + path.relative_to(PACKAGE_DIR).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imported(node: ast.AST, module: str, is_package: bool, modules: Set[str]) -> List[str]:
    """The package's modules that one import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split('.')
        base = base[:len(base) - node.level + 1] if is_package else base[:len(base) - node.level]
        source = '.'.join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ''
    submodules = [f'{source}.{alias.name}' for alias in node.names if f'{source}.{alias.name}' in modules]
    others = len(submodules) < len(node.names)
    return submodules + ([source] if others and source in modules else [])


def import_graph() -> Dict[str, Set[str]]:
    """``{module: modules of the package it imports}`` for every module of the package."""
    paths = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob('*.py'))}
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == '__init__.py'
        graph[module] = {target for node in ast.walk(tree)
                         for target in _imported(node, module, is_package, set(paths)) if target != module}
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None (depth-first search, modules in sorted order)."""
    state: Dict[str, str] = {}
    stack: List[str] = []

    def visit(module: str) -> Optional[List[str]]:
        state[module] = 'open'
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 'open':
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[module] = 'done'
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert f'{PACKAGE}.layers' in graph[PACKAGE] and f'{PACKAGE}.models' in graph[PACKAGE]
    assert len(graph) > 30  # every module of the package, subpackages included


def test_find_cycle_names_the_modules_of_a_cycle():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b'}, 'b': set(), 'c': {'a', 'b'}}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def _index(text: str, row: str) -> Set[str]:
    """The module names in the ``Library`` or ``Commands`` row of a module index: a docstring item, which may wrap onto
    indented lines, or a README table row."""
    prefixes = (f'- {row}: ', f'| {row} | ')
    rows = [line for line in re.sub(r'\n +', ' ', text).splitlines() if line.startswith(prefixes)]
    assert len(rows) == 1, f'{len(rows)} {row} rows'
    prefix, = [p for p in prefixes if rows[0].startswith(p)]
    return {name.strip() for name in rows[0][len(prefix):].rstrip(' |').split(',')}


def test_the_module_index_sorts_library_and_commands():
    # a command is a root module with a main(argv); everything else at the root, subpackages included, is library
    roots = [p for p in PACKAGE_DIR.iterdir() if (p.suffix == '.py' or (p / '__init__.py').is_file())
             and p.name != '__init__.py']
    commands = {p.stem for p in roots if p.suffix == '.py' and re.search(r'^def main\(', p.read_text(), re.MULTILINE)}
    library = {p.stem for p in roots} - commands
    readme = (PACKAGE_DIR.parent / 'README.md').read_text()
    for where, text in (('timm_attnconv.__doc__', timm_attnconv.__doc__), ('README.md', readme)):
        assert (_index(text, 'Library'), _index(text, 'Commands')) == (library, commands), where
