"""The layout a forker reads: the stages at the top level, the plumbing in infra/, rule ports in reward_rules/, commands
in tools/. The import graph, deferred imports included, has no cycle and no upward edge."""
import ast
import glob
import os

import pytest

from conftest import REPO

LAYERS = {"infra": "plumbing", "reward_rules": "rules", "tools": "tools"}  # anything else at the top is a stage
MAY_IMPORT = {"plumbing": {"plumbing"}, "rules": {"rules"}, "stage": {"stage", "plumbing", "rules"},
              "tools": {"stage", "plumbing", "rules"}}


def library_modules() -> dict[str, str]:
    """Module name → file, for every library file (tests, bench and examples aside)."""
    files = glob.glob(os.path.join(REPO, "*.py")) + [f for d in LAYERS for f in glob.glob(os.path.join(REPO, d, "*.py"))]
    return {os.path.relpath(f, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__"): f for f in files}


def layer(module: str) -> str:
    return LAYERS.get(module.split(".")[0], "stage")


def local_imports(path: str, modules: dict) -> list[tuple[str, int]]:
    """(imported library module, line) for every import statement in the file, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name in modules and name not in LAYERS]
    return found  # `from infra import cli` gives infra.cli; the folders' empty __init__ are not edges


def graph() -> dict[str, list[tuple[str, int]]]:
    modules = library_modules()
    return {name: local_imports(path, modules) for name, path in modules.items()}


def test_every_folder_is_what_its_name_says():
    """`ls` tells the story: the design card's stages are top-level files, and the rest sits in the three folders."""
    modules = library_modules()
    stages = sorted(m for m in modules if layer(m) == "stage")
    assert {"ppo", "rollout", "reward_model", "critic", "kl", "data"} <= set(stages)
    assert len(stages) <= 18, f"the top level should hold the stages only, it holds {stages}"
    for folder in LAYERS:
        assert folder in modules, f"{folder}/__init__.py is missing"


def test_no_upward_import():
    """The plumbing imports no stage and no rule port, the rule ports import nothing of the library but themselves,
    and nothing imports a tool."""
    wrong = [f"{src} imports {dst} (line {line})" for src, edges in graph().items() for dst, line in edges
             if layer(dst) not in MAY_IMPORT[layer(src)]]
    assert not wrong, wrong


def test_import_graph_has_no_cycle():
    """No module reaches itself through imports, deferred ones included (a cycle kept from failing only by a
    deferred import is still a cycle)."""
    edges = {src: {dst for dst, _ in out} for src, out in graph().items()}
    state = {}  # module → "open" while its imports are being followed, then "done"

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " → ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def reachable(start: str) -> set[str]:
    """Every library module `start` imports, directly or through others, deferred imports included."""
    edges = {src: {dst for dst, _ in out} for src, out in graph().items()}
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_ppo_never_imports_the_reward_model_training_script():
    """Issue 31: nothing in ppo.py's import graph is reward_model.py (the Bradley–Terry training script): the scorer
    PPO calls and the network it runs are in scorers.py, which the training script imports in turn."""
    assert "reward_model" not in reachable("ppo")
    assert "scorers" in reachable("ppo") and "scorers" in reachable("reward_model")


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The two checks above fail on a tree that has a cycle (a → b → a, b's import deferred) and a plumbing module
    importing a stage: they are not vacuous."""
    import test_layout
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "__init__.py").write_text("")
    (tmp_path / "infra" / "low.py").write_text("import a\n")
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    monkeypatch.setattr(test_layout, "REPO", str(tmp_path))
    with pytest.raises(AssertionError, match="a → b → a"):
        test_import_graph_has_no_cycle()
    with pytest.raises(AssertionError, match="infra.low imports a"):
        test_no_upward_import()
