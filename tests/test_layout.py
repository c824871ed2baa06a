"""The layout a forker reads: the stages at the top level, the plumbing in infra/, rule ports in reward_rules/, commands
in tools/, and what is off by default in feature folders (agents/, scorers/, rollout_kinds/) that a stage names only
as "module:name" on the table line that selects it. The import graph, deferred imports and those table lines
included, has no cycle and no upward edge; every rollout kind and the wrappers around them answer one generate."""
import ast
import glob
import importlib
import inspect
import os
import re

import pytest

from conftest import REPO

STAGES = {"ppo", "rollout", "rewards", "advantages", "losses", "kl", "critic", "validation", "data", "reward_model", "sft", "dpo"}
LAYERS = {"infra": "plumbing", "reward_rules": "rules", "tools": "tools",  # anything else at the top is a stage
          "agents": "feature", "scorers": "feature", "rollout_kinds": "feature"}
MAY_IMPORT = {"plumbing": {"plumbing"}, "rules": {"rules"}, "stage": {"stage", "plumbing", "rules", "feature"},
              "feature": {"feature", "stage", "plumbing", "rules"}, "tools": {"stage", "plumbing", "rules", "feature"}}
TARGET = re.compile(r"""["']((?:agents|scorers|rollout_kinds)\.\w+):([\w.]+)["']""")  # a table line's "module:name"


def library_modules() -> dict[str, str]:
    """Module name → file, for every library file (tests, bench and examples aside)."""
    files = glob.glob(os.path.join(REPO, "*.py")) + [f for d in LAYERS for f in glob.glob(os.path.join(REPO, d, "*.py"))]
    return {os.path.relpath(f, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__"): f for f in files}


def layer(module: str) -> str:
    return LAYERS.get(module.split(".")[0], "stage")


def table_targets(path: str) -> list[tuple[str, str, int]]:
    """(feature module, name, line) for every "module:name" string in the file: how a stage's table line names what
    a feature folder holds (infra.config.load_target imports it when a run selects it)."""
    return [(m.group(1), m.group(2), text[:m.start()].count("\n") + 1)
            for text in [open(path).read()] for m in TARGET.finditer(text)]


def local_imports(path: str, modules: dict, with_tables: bool = True) -> list[tuple[str, int]]:
    """(imported library module, line) for every import statement in the file, inside functions too, and (with_tables)
    every feature module a table line names."""
    found = [(module, line) for module, _, line in table_targets(path) if module in modules] if with_tables else []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name in modules and name not in LAYERS]
    return found  # `from infra import cli` gives infra.cli; the folders' empty __init__ are not edges


def graph(with_tables: bool = False) -> dict[str, list[tuple[str, int]]]:
    modules = library_modules()
    return {name: local_imports(path, modules, with_tables) for name, path in modules.items()}


def test_every_folder_is_what_its_name_says():
    """`ls` tells the story: the top level holds the stage files, by name, and the rest sits in the folders."""
    modules = library_modules()
    stages = {m for m in modules if layer(m) == "stage"}
    assert stages == STAGES, f"the top level should hold the stages {sorted(STAGES)}, it holds {sorted(stages)}"
    for folder in LAYERS:
        assert folder in modules, f"{folder}/__init__.py is missing"


def test_stages_name_a_feature_only_on_a_table_line():
    """The default step's modules (ppo.py and what it imports) import no feature folder, directly or through another
    module; and every "module:name" a stage's table line gives resolves to what that folder holds. (reward_model.py,
    another entry point, imports the reward model's network from scorers/model.py.)"""
    imports = graph()
    seen, todo = {"ppo"}, ["ppo"]
    while todo:
        for nxt, _ in imports.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    wrong = [f"{src} imports {dst} (line {line})" for src in seen for dst, line in imports[src]
             if layer(dst) == "feature"]
    assert not wrong and not [m for m in seen if layer(m) == "feature"], wrong
    targets = [(src, *target) for src, path in library_modules().items() if layer(src) == "stage"
               for target in table_targets(path)]
    assert {module for _, module, _, _ in targets} >= {"agents.multi_turn", "scorers.model", "scorers.judge",
                                                        "scorers.remote", "rollout_kinds.server"}
    for src, module, name, line in targets:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        assert callable(obj), f"{src} line {line}: {module}:{name}"


def test_every_rollout_kind_and_wrapper_answers_one_generate():
    """HF, vLLM, the server, multi-turn and running ahead: generate(self, rows, n, temperature, seed=None)."""
    from agents.multi_turn import AgentRollout
    from rollout import HFRollout, RunAhead, VLLMRollout
    from rollout_kinds.server import ServerRollout
    for kind in (HFRollout, VLLMRollout, ServerRollout, AgentRollout, RunAhead):
        params = list(inspect.signature(kind.generate).parameters.values())
        assert [p.name for p in params] == ["self", "rows", "n", "temperature", "seed"], kind
        assert params[-1].default is None, kind


def test_no_upward_import():
    """The plumbing imports no stage and no rule port, the rule ports import nothing of the library but themselves,
    and nothing imports a tool (a stage reaching a feature folder: test_stages_name_a_feature_only_on_a_table_line)."""
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
    edges = {src: {dst for dst, _ in out} for src, out in graph(with_tables=True).items()}
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_ppo_never_imports_the_reward_model_training_script():
    """Nothing in ppo.py's import graph is reward_model.py (the Bradley–Terry training script): the scorer PPO calls
    and the network it runs are in scorers/model.py (named on rewards.SCORERS' line), which the training script
    imports in turn."""
    assert "reward_model" not in reachable("ppo")
    assert "scorers.model" in reachable("ppo") and "scorers.model" in reachable("reward_model")


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
