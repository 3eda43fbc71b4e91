"""The strategies stay readable as they grow: a room per engine (``ddp/``, ``fsdp/``, ``deepspeed/``: its strategy and
the helpers only it uses) and no loose module beside the folders, ``common/`` holding only what two or more engines use,
each strategy at most 400 lines, what the three do alike written once (in a helper each owns and calls from its own
hooks), and training across nodes reached through one object instead of a branch in every hook."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

STRATEGIES = Path(__file__).resolve().parents[2] / "lightning_fastdist" / "strategies"
ENGINES = ("ddp", "fsdp", "deepspeed")
CLASSES = tuple(f"{engine}/strategy.py" for engine in ENGINES)
FORMS = ("outer_sync", "replica_groups")


def method_bodies(source: str) -> dict[str, list[str]]:
    """The statements of each method of the source's strategy class, as source, docstrings left out."""
    (strategy,) = (node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    bodies = {}
    for node in strategy.body:
        if isinstance(node, ast.FunctionDef):
            statements = node.body
            if isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
                statements = statements[1:]
            bodies[node.name] = [ast.unparse(statement) for statement in statements]
    return bodies


def written_twice(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(method, module, module) for each method of three or more statements written alike in two modules."""
    bodies = {name: method_bodies(source) for name, source in sources.items()}
    return [
        (method, first, second)
        for first, second in itertools.combinations(sources, 2)
        for method, statements in bodies[first].items()
        if len(statements) >= 3 and bodies[second].get(method) == statements
    ]


def methods_mentioning_the_forms(source: str) -> list[str]:
    return [name for name, lines in method_bodies(source).items() if any(f in line for line in lines for f in FORMS)]


def strategy_imports() -> dict[str, set[str]]:
    """Each module of ``strategies/`` (``"fsdp.sharded_module"``) and the modules of ``strategies/`` it imports."""
    prefix = "lightning_fastdist.strategies."
    graph = {}
    for path in STRATEGIES.rglob("*.py"):
        name = ".".join(path.relative_to(STRATEGIES).with_suffix("").parts).removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
                imported.add(node.module.removeprefix(prefix))
        graph[name] = imported - {name}
    return graph


def engines_reaching(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The engines whose strategy imports ``module``, directly or through other modules."""
    reaching = set()
    for engine in ENGINES:
        seen, todo = set(), [f"{engine}.strategy"]
        while todo:
            current = todo.pop()
            if current == module:
                reaching.add(engine)
            todo += [name for name in graph.get(current, ()) if name not in seen]
            seen.update(graph.get(current, ()))
    return reaching


def test_no_module_lies_loose_beside_the_folders():
    assert sorted(path.name for path in STRATEGIES.glob("*.py")) == ["__init__.py"]


def test_an_engines_room_holds_what_only_that_engine_uses():
    graph = strategy_imports()
    for module in graph:
        room = module.split(".")[0]
        if room in ENGINES and module != room:
            importers = {name for name, imported in graph.items() if module in imported}
            assert all(name.split(".")[0] == room or name == "" for name in importers), (module, importers)


def test_common_holds_only_what_two_or_more_engines_use():
    graph = strategy_imports()
    for module in graph:
        if module.startswith("common.") and module != "common":
            assert len(engines_reaching(module, graph)) >= 2, module


def test_each_strategy_module_is_at_most_400_lines():
    lines = {name: len((STRATEGIES / name).read_text().splitlines()) for name in CLASSES}
    assert all(count <= 400 for count in lines.values()), lines


def test_no_method_of_three_or_more_statements_is_written_twice_among_the_strategies():
    assert written_twice({name: (STRATEGIES / name).read_text() for name in CLASSES}) == []


def test_the_strategies_reach_training_across_nodes_through_one_object():
    for name in ("ddp/strategy.py", "fsdp/strategy.py"):
        mentioning = methods_mentioning_the_forms((STRATEGIES / name).read_text())
        assert len(mentioning) <= 3, (name, mentioning)


def test_the_checks_see_a_copied_method_and_a_branch_on_a_form():
    copied = "class A:\n    def hook(self):\n        a = 1\n        b = 2\n        return a + b\n"
    short = "class A:\n    def hook(self):\n        '''Two lines.'''\n        a = 1\n        return a\n"
    assert written_twice({"one.py": copied, "two.py": copied, "three.py": short}) == [("hook", "one.py", "two.py")]
    assert written_twice({"one.py": short, "two.py": short}) == []
    branching = (
        "class A:\n    def hook(self):\n        '''outer_sync in a docstring.'''\n        if self.outer_sync: pass\n"
    )
    assert methods_mentioning_the_forms(branching) == ["hook"]
    assert methods_mentioning_the_forms(short) == []
