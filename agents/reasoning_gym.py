"""reasoning-gym's procedural tasks (Stojanovski et al., 2025; `reasoning-gym` on PyPI) as data: the rows
tools/prepare_data.py writes for one task or a composite of tasks (make_reasoning_gym), and the curricula that make
the training rows as a run goes (data.curriculum: Curriculum). The rule reasoning_gym/* scores every such row with its
task's own score_answer (reward_rules/reasoning_gym_rules.py).

Curricula: data.curriculum names a YAML file written as reasoning-gym's own training configs write it
(training/configs/curriculum/*.yaml: a `curriculum:` block, and `reasoning_gym:` with dataset_size and
developer_prompt; the block alone, or reasoning-gym's CurriculumExperimentConfig YAML, will do too).

    curriculum:
      enabled: True
      schedule: {automatic: False, update_steps: 30}  # automatic: every task one level up every update_steps steps
      last_k: 20                # a task's window: its last k training samples
      success_threshold: 0.70   # a full window with a mean above it: the task one level up, its window emptied
      failure_threshold: 0.10   # below it: one level down
      curricula:
        spell_backward: {attribute_levels: {word_len: 0}, weight: 1.0}   # "*": every attribute

As reasoning-gym's trainer does (training/train_grpo.py, training/trainers/ray_grpo_trainer.py): the rows are the
entries of reasoning_gym.coaching.CurriculumExperiment(config, size=dataset_size) — entry i a task drawn by weight,
then its entry i at the task's current level — each prompt the developer prompt (reasoning_gym.utils.SYSTEM_PROMPTS)
and the question; validation is the same composite at the starting levels with another seed; a sample's
correctness is the task's score_answer on the answer in <answer> tags (the rule reasoning_gym/*, whatever
reward.sources add); a level moves with BaseCurriculum.increment_global_level / decrement_global_level through the
experiment's update_difficulty, after a step, and a task's rows are made again at its new level (the same indices:
the data order does not change). The levels and windows are saved in checkpoints (state.json).

Departures: the tasks' datasets are seeded (trainer.seed + i + 1 for the i-th task, as reasoning-gym's composite
seeds a spec without a seed; validation trainer.seed + 1), where CurriculumExperiment leaves them random, so that
every process and a resumed run make the same rows; the samples of all processes fill the windows in process order;
a window's mean is over all of it (reasoning-gym's trainer takes its first difficulty group's, the same once the
level has held for last_k samples); a level whose prompts do not fit data.max_prompt_length (data.truncation=error)
is not entered: the task stays, with a console line.
"""
import dataclasses
import difflib
import os

import yaml
from accelerate.utils import gather_object

from data import DataError, prompt_rows
from reward_rules.reasoning_gym_rules import ground_truth_text, read_ground_truth, reasoning_gym_score


# ---- rows of one task, or of a composite of tasks (tools/prepare_data.py --task reasoning_gym:<name>)

def make_reasoning_gym(task: str, n: int, seed: int, config: dict, system_prompt: str = "default",
                       shots: int = 0) -> list[dict]:
    """n entries of reasoning-gym's task made with seed and config (its keyword arguments), one RL row each: one of
    reasoning-gym's SYSTEM_PROMPTS (they ask for the answer in <answer> tags), `shots` worked examples (the same
    for every row: entries of seed + 1, answered "<answer>…</answer>"), the question; the ground truth the rule
    rebuilds the entry and the task from; data_source reasoning_gym/<task>. A task whose entries do not come back
    from JSON with the same score for their own answer is refused."""
    import reasoning_gym  # deferred: only this task needs it
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS
    where = f"--task reasoning_gym:{task}"
    if task not in DATASETS:
        near = difflib.get_close_matches(task, DATASETS, n=3)
        raise DataError(f"{where}: reasoning-gym has no task {task!r}" + (f"; did you mean {', '.join(near)}?" if near
                        else f"; it has {len(DATASETS)}: {', '.join(sorted(DATASETS))}"))
    if system_prompt not in SYSTEM_PROMPTS:
        raise DataError(f"--system-prompt {system_prompt!r}: reasoning-gym's prompts are {', '.join(SYSTEM_PROMPTS)}")
    if task == "composite":
        return make_composite(config, n, seed, system_prompt, shots)
    config = {**config, "seed": seed, "size": n}
    try:
        dataset = reasoning_gym.create_dataset(task, **config)
        entries = [dataset[i] for i in range(n)]
        shown = reasoning_gym.create_dataset(task, **{**config, "seed": seed + 1, "size": shots}) if shots else []
        examples = list(shown)
    except (TypeError, ValueError, AssertionError) as e:  # an unknown or out-of-range config key
        raise DataError(f"{where} --task-config: reasoning-gym refused the config {config}: {e}") from None
    return [reasoning_gym_row(task, config, dataset, entry, i, SYSTEM_PROMPTS[system_prompt], examples)
            for i, entry in enumerate(entries)]


def reasoning_gym_row(task: str, config: dict, dataset, entry: dict, i: int, system: str, examples: list) -> dict:
    """Row i: the system prompt, the worked examples, the entry's question; the ground truth the rule rebuilds the
    entry and the task's dataset (made with `config`) from; a DataError where the entry does not come back from JSON
    with the same score for its own answer."""
    where = f"--task reasoning_gym:{task}"
    try:
        truth = ground_truth_text(task, config, entry)
    except TypeError as e:
        raise DataError(f"{where}: entry {i} cannot be stored as JSON ({e}); this task is not supported") from None
    if dataset.score_answer(entry["answer"], read_ground_truth(truth)["entry"]) != dataset.score_answer(
            entry["answer"], entry):
        raise DataError(f"{where}: entry {i} scores its own answer differently once stored as JSON (its metadata "
                        f"holds tuples or other values JSON changes); this task is not supported")
    worked = [m for e in examples for m in ({"role": "user", "content": e["question"]},
                                            {"role": "assistant", "content": f"<answer>{e['answer']}</answer>"})]
    return {"prompt": [{"role": "system", "content": system}, *worked, {"role": "user", "content": entry["question"]}],
            "ground_truth": truth, "data_source": f"reasoning_gym/{task}", "extra_info": {"index": i}}


def make_composite(config: dict, n: int, seed: int, system_prompt: str, shots: int) -> list[dict]:
    """n entries of reasoning-gym's composite dataset, create_dataset("composite", seed, size, datasets=[DatasetSpec(
    name, weight, config), …]) from config["datasets"] (dicts with name, weight, config), each task drawn by weight
    as reasoning-gym draws it. Each row is its task's own (data_source reasoning_gym/<task>), its ground truth holding
    the config the composite made that task with (its seed and size included), so the rule scores it with the very
    dataset whose score_answer the composite's forwards to."""
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.utils import SYSTEM_PROMPTS
    where = "--task reasoning_gym:composite --task-config"
    specs = config.get("datasets")
    if set(config) - {"datasets"} or not isinstance(specs, list) or not specs or not all(
            isinstance(d, dict) and "name" in d and set(d) <= {"name", "weight", "config"} for d in specs):
        raise DataError(f"{where}: reasoning-gym's composite takes datasets: a list of {{name, weight, config}} (as "
                        f"its CompositeConfig YAML writes them), got {str(config)[:200]}")
    try:
        made = [DatasetSpec(d["name"], d.get("weight", 1.0), d.get("config") or {}) for d in specs]
        composite = reasoning_gym.create_dataset("composite", seed=seed, size=n, datasets=made)
        entries = [composite[i] for i in range(n)]
        examples = list(reasoning_gym.create_dataset("composite", seed=seed + 1, size=shots, datasets=made)) \
            if shots else []
    except (TypeError, ValueError, AssertionError, KeyError, AttributeError) as e:
        raise DataError(f"{where}: reasoning-gym refused the composite {specs}: {type(e).__name__}: {e}") from None
    rows = []
    for i, entry in enumerate(entries):
        task = entry["metadata"]["source_dataset"]
        j = composite.dataset_names.index(task)  # the composite gives task j seed + j + 1 and its size, unless set
        task_config = {"seed": seed + j + 1, "size": n, **made[j].config}
        rows.append(reasoning_gym_row(task, task_config, composite.datasets[task], entry, i,
                                      SYSTEM_PROMPTS[system_prompt], examples))
    return rows



# ---- curricula (data.curriculum)

BLOCK_KEYS = {"enabled", "schedule", "last_k", "success_threshold", "failure_threshold", "curricula"}
DEFAULTS = {"enabled": True, "schedule": {"automatic": False, "update_steps": 30}, "last_k": 20,
            "success_threshold": 0.70, "failure_threshold": 0.10}  # reasoning-gym's spell_backward.yaml
GYM_DEFAULTS = {"dataset_size": 20000, "developer_prompt": "DeepSeekZero"}  # its training configs' values


def read_spec(path: str) -> dict:
    """The curriculum block of `path` with DEFAULTS filled in, and its `reasoning_gym:` dataset_size and
    developer_prompt (GYM_DEFAULTS where absent); a DataError naming the file and the key for anything else."""
    where = f"data.curriculum={path}"
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except OSError as e:
        raise DataError(f"{where}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise DataError(f"{where}: is not YAML ({' '.join(str(e).split())[:200]})") from None
    whole = isinstance(tree, dict) and "curriculum" in tree  # a whole training config: its other keys are verl's
    block, gym = (tree["curriculum"], tree.get("reasoning_gym") or {}) if whole else (tree, {})
    if not isinstance(block, dict) or not isinstance(gym, dict):
        raise DataError(f"{where}: holds no curriculum: mapping (reasoning-gym's block with curricula:)")
    if set(block) - BLOCK_KEYS:
        raise DataError(f"{where}: unknown key {sorted(set(block) - BLOCK_KEYS)[0]!r} in the curriculum block; it "
                        f"takes {', '.join(sorted(BLOCK_KEYS))}")
    spec = {**DEFAULTS, **block, "schedule": {**DEFAULTS["schedule"], **(block.get("schedule") or {})},
            **{key: gym.get(key, value) for key, value in GYM_DEFAULTS.items()}}
    check_spec(spec, where)
    return spec


def check_spec(spec: dict, where: str) -> None:
    """Every value of the spec as reasoning-gym would take it, or a DataError naming it."""
    from reasoning_gym.factory import CURRICULA
    from reasoning_gym.utils import SYSTEM_PROMPTS
    numbers = {"last_k": (int, 1, None), "success_threshold": (float, 0, 1), "failure_threshold": (float, 0, 1),
               "dataset_size": (int, 1, None)}
    for key, (kind, low, high) in numbers.items():
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
                or value < low or (high is not None and value > high):
            raise DataError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'} ≥ {low}"
                            f"{f' and ≤ {high}' if high is not None else ''}, got {value!r}")
    if spec["enabled"] is not True:
        raise DataError(f"{where}: curriculum.enabled is {spec['enabled']!r}: nothing to run; unset data.curriculum")
    automatic, every = spec["schedule"].get("automatic"), spec["schedule"].get("update_steps")
    if not isinstance(automatic, bool) or isinstance(every, bool) or not isinstance(every, int) or every < 1 \
            or set(spec["schedule"]) - {"automatic", "update_steps"}:
        raise DataError(f"{where}: schedule takes automatic (true or false) and update_steps (an integer ≥ 1), got "
                        f"{spec['schedule']}")
    if spec["developer_prompt"] not in SYSTEM_PROMPTS:
        raise DataError(f"{where}: reasoning_gym.developer_prompt {spec['developer_prompt']!r} is not one of "
                        f"reasoning-gym's SYSTEM_PROMPTS: {', '.join(SYSTEM_PROMPTS)}")
    curricula = spec.get("curricula")
    if not isinstance(curricula, dict) or not curricula:
        raise DataError(f"{where}: curricula must map each task to {{attribute_levels, weight}}, got {curricula!r}")
    for task, entry in curricula.items():
        if task not in CURRICULA:
            near = difflib.get_close_matches(str(task), CURRICULA, n=3)
            raise DataError(f"{where}: reasoning-gym has no curriculum for {task!r}" +
                            (f"; did you mean {', '.join(near)}?" if near else ""))
        levels = entry.get("attribute_levels") if isinstance(entry, dict) else None
        weight = entry.get("weight", 1.0) if isinstance(entry, dict) else None
        if not isinstance(levels, dict) or not levels or set(entry) - {"attribute_levels", "weight"} or isinstance(
                weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise DataError(f"{where}: curricula.{task} takes attribute_levels (a mapping, not empty) and weight "
                            f"(≥ 0), got {entry!r}")
        attributes = CURRICULA[task]().attributes
        for name, level in levels.items():
            if name != "*" and name not in attributes:
                raise DataError(f"{where}: curricula.{task}.attribute_levels.{name}: {task}'s attributes are "
                                f"{', '.join(attributes)} (or * for all)")
            top = min(len(a.levels) for a in attributes.values()) if name == "*" else len(attributes[name].levels)
            if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < top:
                raise DataError(f"{where}: curricula.{task}.attribute_levels.{name} must be a level from 0 to "
                                f"{top - 1}, got {level!r}")
    if spec["failure_threshold"] > spec["success_threshold"]:
        raise DataError(f"{where}: failure_threshold {spec['failure_threshold']} is above success_threshold "
                        f"{spec['success_threshold']}")


class Curriculum:
    """The training rows of a reasoning-gym curriculum (`rows`, a list that draw_prompts indexes, remade in place for
    a task whose level moves), its validation rows, and the windows that move the levels."""

    def __init__(self, path: str, cfg_data, tokenizer, seed: int, print0=print):
        from reasoning_gym.coaching import CurriculumAttributeConfig, CurriculumExperiment, CurriculumExperimentConfig
        from reasoning_gym.composite import CompositeDataset
        from reasoning_gym.utils import SYSTEM_PROMPTS
        if cfg_data.truncation == "filter":
            raise DataError(f"data.curriculum={path}: data.truncation=filter would drop rows as the levels rise; set "
                            f"data.truncation=error (a level whose prompts are too long is not entered) or left")
        self.spec, self.path, self.tokenizer, self.cfg_data = read_spec(path), path, tokenizer, cfg_data
        if self.spec["dataset_size"] < cfg_data.train_batch_size:
            raise DataError(f"data.curriculum={path}: data.curriculum's dataset_size is {self.spec['dataset_size']}, "
                            f"fewer than data.train_batch_size={cfg_data.train_batch_size}; raise "
                            f"reasoning_gym.dataset_size")
        self.system, self.print0 = SYSTEM_PROMPTS[self.spec["developer_prompt"]], print0
        config = CurriculumExperimentConfig(curricula={task: CurriculumAttributeConfig(**entry)
                                                       for task, entry in self.spec["curricula"].items()})
        self.experiment = CurriculumExperiment(os.path.basename(path), config, self.spec["dataset_size"], seed=seed)
        self.tasks = list(self.spec["curricula"])
        starting = self.experiment.composite.config
        for i, task in enumerate(self.tasks):  # departure: seeded, every process alike
            self.experiment.composite.update_dataset_config(task, {"seed": seed + i + 1})
        val_specs = [dataclasses.replace(d, config={**d.config, "seed": seed + 1 + i + 1})
                     for i, d in enumerate(starting.datasets)]
        val_size = min(cfg_data.val_max_samples or self.spec["dataset_size"], self.spec["dataset_size"])
        val = CompositeDataset(dataclasses.replace(starting, seed=seed + 1, size=val_size, datasets=val_specs))
        self.rows = self.make_rows(self.experiment.composite, range(self.spec["dataset_size"]))
        self.val_rows = self.make_rows(val, range(val_size))
        self.windows = {task: [] for task in self.tasks}  # each task's last last_k correctness scores
        print0(f"train prompts: reasoning-gym's curriculum {path}: {len(self.rows)} rows of "
               f"{', '.join(self.tasks)} at levels {self.levels()}; val prompts: {len(self.val_rows)} at those levels "
               f"(data.train_files and data.val_files are not read)")

    def make_rows(self, composite, indices, task=None) -> list:
        """Rows for the composite's entries at `indices`, tokenized as data.py does (`task`: named in its messages)."""
        raw = []
        for i in indices:
            entry = composite[i]
            name = entry["metadata"]["source_dataset"]
            dataset = composite.datasets[name]
            config = {**dataclasses.asdict(dataset.config), "seed": dataset.seed, "size": dataset.size}
            raw.append(reasoning_gym_row(name, config, dataset, entry, i, self.system, []))
        return prompt_rows(raw, f"data.curriculum={self.path}{f' ({task})' if task else ''}", self.tokenizer,
                           self.cfg_data.max_prompt_length, self.cfg_data.truncation)[0]

    def levels(self) -> dict:
        return {task: self.experiment.curricula[task].get_max_level() for task in self.tasks}

    def attribute_levels(self, task: str) -> dict:
        curriculum = self.experiment.curricula[task]
        return {name: curriculum.get_attr_level(name) for name in curriculum.attributes}

    def set_levels(self, task: str, levels: dict) -> None:
        """The task's attributes at `levels`, its dataset made again at them (as update_difficulty remakes it)."""
        curriculum = self.experiment.curricula[task]
        for name, level in levels.items():
            curriculum.set_attr_level(name, level)
        self.experiment.composite.update_dataset_config(task, curriculum.get_global_level())

    def remake_rows(self, task: str) -> None:
        """The task's rows made again at its current level, in place (the same indices: the data order holds)."""
        indices = [i for i, row in enumerate(self.rows) if row["data_source"] == f"reasoning_gym/{task}"]
        for i, row in zip(indices, self.make_rows(self.experiment.composite, indices, task)):
            self.rows[i] = row

    def record(self, rows: list, texts: list, accelerator) -> None:
        """Each sample's correctness into its task's window, the samples of every process in process order."""
        mine = [(row["data_source"].removeprefix("reasoning_gym/"), reasoning_gym_score(text, row["ground_truth"])[
            "score"]) for row, text in zip(rows, texts)]
        for task, score in gather_object(mine) if accelerator.num_processes > 1 else mine:
            self.windows[task] = (self.windows[task] + [score])[-self.spec["last_k"]:]

    def update(self, step: int) -> dict:
        """After a step: each task's level moved as the windows (or the automatic schedule) say; returns the metrics
        curriculum/<task>/level and curriculum/<task>/accuracy (its window's mean, before any move)."""
        s, metrics = self.spec, {}
        for task, level in self.levels().items():
            window = self.windows[task]
            mean = sum(window) / len(window) if window else None
            metrics[f"curriculum/{task}/level"] = level
            if window:
                metrics[f"curriculum/{task}/accuracy"] = mean
            if s["schedule"]["automatic"] and window and step % s["schedule"]["update_steps"] == 0:
                self.move(task, "increment", f"schedule.automatic at step {step}")
            elif not s["schedule"]["automatic"] and len(window) >= s["last_k"]:
                if mean > s["success_threshold"] or mean < s["failure_threshold"]:
                    self.move(task, "increment" if mean > s["success_threshold"] else "decrement",
                              f"accuracy {mean:.2f} over {len(window)}")
        return metrics

    def move(self, task: str, method: str, why: str) -> None:
        """The task one level up or down (reasoning-gym's update_difficulty, its window emptied) and its rows made
        again; a level whose prompts are too long is left again, with a console line."""
        before, saved = self.levels()[task], self.attribute_levels(task)
        self.windows[task] = []
        self.experiment.update_difficulty(task, method)
        if self.levels()[task] == before:
            return
        try:
            self.remake_rows(task)
        except DataError as e:
            self.set_levels(task, saved)
            self.print0(f"curriculum: {task} stays at level {before}: {e}")
            return
        self.print0(f"curriculum: {task} level {before} → {self.levels()[task]} ({why})")

    def state_dict(self) -> dict:
        return {"levels": {task: self.attribute_levels(task) for task in self.tasks}, "windows": self.windows}

    def load_state_dict(self, saved: dict) -> None:
        """The levels and windows of a checkpoint, the rows of each task whose level differs made again."""
        self.windows = {task: list(saved["windows"].get(task, [])) for task in self.tasks}
        for task, levels in saved["levels"].items():
            if levels != self.attribute_levels(task):
                self.set_levels(task, levels)
                self.remake_rows(task)
