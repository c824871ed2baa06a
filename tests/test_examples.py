"""examples/: the real-size recipes, run as written for one step with a tiny model and tiny GSM8K files.

Each recipe is a shell script: the data step (GSM8K jsonl → parquet through tools/prepare_data.py), then `accelerate launch
ppo.py --config configs.yaml <its overrides> "$@"`. The test runs the script itself, appending only what
makes it tiny (model, sizes, CPU backends, output folder), and checks that the run used every other
override of the recipe, so a renamed or retyped key fails here instead of on a GPU an hour in.
"""
import json
import os
import subprocess

import pytest
import yaml

from conftest import REPO, make_tiny_model, read_metrics

from infra import cli

RECIPES = ["gsm8k_qwen05b_ppo.sh", "gsm8k_qwen05b_grpo_lora.sh"]
GSM8K_LIKE = [  # (question, answer) in GSM8K's distributed jsonl form: reasoning, then "#### <n>"
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 6 pens. How many pens are in 2 boxes?", "6 * 2 = <<6*2=12>>12\n#### 12"),
    ("Sam had 10 cards and gave away 3. How many are left?", "10 - 3 = <<10-3=7>>7\n#### 7"),
    ("Each of 5 kids has 2 balls. How many balls in all?", "5 * 2 = <<5*2=10>>10\n#### 10"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model, and GSM8K-shaped train.jsonl (8 rows) and test.jsonl (4 rows) where the recipes look."""
    root = tmp_path_factory.mktemp("examples")
    make_tiny_model(root / "model", arch="qwen2")
    (root / "raw").mkdir()
    for name, rows in (("train", GSM8K_LIKE * 2), ("test", GSM8K_LIKE)):
        with open(root / "raw" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows)
    return root


def recipe_overrides(script: str, env: dict) -> list[str]:
    """The `overrides=( … )` array of a recipe, expanded by bash itself (comments dropped, $DATA filled in)."""
    text = open(os.path.join(REPO, "examples", script)).read()
    block = text[text.index("\noverrides=(") + 1:]
    block = block[:block.index("\n)\n") + 3]
    shell = 'DATA=${GSM8K_DATA:-data/gsm8k}\n' + block + 'printf "%s\\n" "${overrides[@]}"'
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, check=True).stdout
    return out.split()


def setting(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


@pytest.mark.parametrize("script", RECIPES)
def test_recipe_runs_one_step_with_its_own_overrides(tiny, tmp_path, script):
    """The recipe's data step turns GSM8K jsonl into train/test parquet; its launch runs one PPO step (validation
    before and after) with a tiny model; and the resolved config.yaml holds every override of the recipe that
    the test did not replace, so the recipe's keys and values all parse and reach the run."""
    out, data_dir = tmp_path / "out", tmp_path / "gsm8k"
    env = {**os.environ, "GSM8K_RAW": str(tiny / "raw"), "GSM8K_DATA": str(data_dir), "OMP_NUM_THREADS": "1"}
    tiny_overrides = [
        f"model.path={tiny}/model", "rollout.name=hf", "model.dtype=fp32", "rollout.dtype=fp32",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "data.max_prompt_length=400",
        "rollout.max_response_length=8", "trainer.total_steps=1", f"trainer.output_dir={out}",
        "trainer.plot_curves=false"]
    recipe = recipe_overrides(script, env)
    assert len(recipe) > 30 and all("=" in o for o in recipe), recipe
    proc = subprocess.run(["bash", f"examples/{script}", *tiny_overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    import pyarrow.parquet as pq
    assert pq.read_table(data_dir / "train.parquet").num_rows == 8
    test_rows = pq.read_table(data_dir / "test.parquet").to_pylist()
    assert len(test_rows) == 4 and test_rows[0]["data_source"] == "openai/gsm8k" and test_rows[0]["ground_truth"] == "7"

    with open(out / "config.yaml") as f:
        resolved = yaml.safe_load(f)
    replaced = {o.split("=", 1)[0] for o in tiny_overrides}
    for override in recipe:
        key = override.split("=", 1)[0]
        if key not in replaced:
            wanted = setting(cli.load_config(None, [override]), key)
            assert setting(resolved, key) == wanted, (override, setting(resolved, key))

    lines = read_metrics(out)
    assert [m["step"] for m in lines] == [0, 1]
    assert "val/openai/gsm8k/score" in lines[0] and "val/score/mean" in lines[1]
    assert {"score/mean", "policy/entropy", "actor/grad_norm"} <= set(lines[1])
    if "ppo" in script:
        assert {"loss/value", "critic/grad_norm", "kl/coef"} <= set(lines[1])
