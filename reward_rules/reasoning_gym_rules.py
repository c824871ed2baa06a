"""reasoning-gym's procedural tasks (Stojanovski et al., 2025, arXiv:2505.24760; `reasoning-gym` on PyPI) as a rule:
a row of data_source reasoning_gym/<task> is scored by that task's own `score_answer(answer, entry)`.

The answer is read as reasoning-gym reads it: `reasoning_gym.utils.extract_answer`, the text inside the last
<answer>…</answer> of the response, which its SYSTEM_PROMPTS ask for (agents/reasoning_gym.make_reasoning_gym puts one of them in
each prompt). A response without one is scored on None, as the task scores a missing answer.

The ground truth is the JSON text of {"task", "config", "entry"} (ground_truth_text): the entry as the task made it
(question, answer, metadata) and the keyword arguments its dataset was made with. The dataset is rebuilt from them
once per (task, config), because some tasks' score_answer reads its config (decimal_arithmetic's tolerance,
puzzle24's numbers, polynomial_equations, time_intervals).
"""
import functools
import json


def ground_truth_text(task: str, config: dict, entry: dict) -> str:
    """What a reasoning_gym/<task> row stores as its ground truth; raises TypeError when the entry is not JSON."""
    return json.dumps({"task": task, "config": config, "entry": entry}, sort_keys=True)


@functools.lru_cache(maxsize=32)
def task_dataset(task: str, config_json: str):
    """The task's dataset, as reasoning_gym.create_dataset(task, **config) makes it; one per (task, config)."""
    import reasoning_gym  # deferred: importing it takes ~1.5 s, paid only by runs that score its rows
    return reasoning_gym.create_dataset(task, **json.loads(config_json))


def read_ground_truth(ground_truth: str) -> dict:
    """{"task", "config", "entry"} from ground_truth_text's JSON; a ValueError saying what it should be."""
    try:
        truth = json.loads(ground_truth)
    except (TypeError, json.JSONDecodeError):
        truth = None
    if not (isinstance(truth, dict) and isinstance(truth.get("task"), str) and isinstance(truth.get("config"), dict)
            and isinstance(truth.get("entry"), dict)):
        raise ValueError(f"a reasoning_gym/* ground truth is the JSON text of {{task, config, entry}}, as "
                         f"tools/prepare_data.py --task reasoning_gym:<name> writes it; got {str(ground_truth)[:80]!r}")
    return truth


def reasoning_gym_score(solution_str: str, ground_truth: str) -> dict:
    """{"score": the task's score_answer(extract_answer(solution_str), entry), "pred": the answer read, "" when the
    response has no <answer> tags}."""
    from reasoning_gym.utils import extract_answer
    truth = read_ground_truth(ground_truth)
    answer = extract_answer(solution_str)
    dataset = task_dataset(truth["task"], json.dumps(truth["config"], sort_keys=True))
    return {"score": float(dataset.score_answer(answer, truth["entry"])), "pred": answer or ""}
