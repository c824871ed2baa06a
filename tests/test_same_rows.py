"""A change of shape changes nothing the loop computes: ppo.py of this tree and of BASE (the commit before the loop's
steps 1–3 moved back into ppo.main, the generation protocol became one and the features moved into their folders), on
the same tiny model, data and seed, log the same keys and values at every step, times aside. One case for each route
through steps 1–3: the default job (PPO with a critic on vLLM), GRPO, DAPO's dynamic sampling, running one step ahead,
the tools demo, an environment, a judge, and a reward model.

Both trees run side by side, one thread each; the base tree is the repository's own history (git archive)."""
import os
import subprocess
import sys

import pytest

from conftest import arithmetic_run_folder, make_tiny_model, read_metrics, REPO, vllm_build
from test_agent import agent_workdir, caller_dir, tools_file  # noqa: F401 (fixtures: the tool-calling tiny model)
from test_judge import StubServer, TEMPLATE

BASE = "16e774a"  # main before the change of shape: its rows are the ones this tree must log

needs_base = pytest.mark.skipif(subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{BASE}^{{commit}}"],
                                               capture_output=True).returncode != 0, reason=f"the history lacks {BASE}")
needs_vllm = pytest.mark.skipif(vllm_build() is None, reason="vLLM is not installed")

SMALL = ["rollout.max_response_length=6", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2",
         "trainer.total_steps=3", "trainer.test_freq=2", "trainer.save_freq=0", "trainer.max_kl=0", "model.dtype=fp32",
         "model.lora_rank=8", "model.target_modules=q_proj,v_proj", "trainer.plot_curves=false",
         "data.val_max_samples=4", "trainer.sample_freq=0", "rollout.dtype=fp32"]


@pytest.fixture(scope="module")
def base_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    archive = subprocess.run(["git", "-C", REPO, "archive", BASE], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


# scores that differ between the samples of a prompt from the start (the tiny model never answers right)
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3)
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The arithmetic run folder, a reward model folder (a sequence classifier on the tiny model), and the judge's
    prompt template."""
    from transformers import AutoModelForSequenceClassification
    root = arithmetic_run_folder(tmp_path_factory.mktemp("rows"), 32, 8)
    reward_model = AutoModelForSequenceClassification.from_pretrained(make_tiny_model(root / "rm"), num_labels=1)
    reward_model.save_pretrained(root / "rm")
    (root / "template.txt").write_text(TEMPLATE)
    (root / "length.py").write_text(LENGTH_REWARD)
    return root


@pytest.fixture(scope="module")
def judge():
    """A stand-in judge: yes to a response with a digit in it."""
    server = StubServer(answer=lambda prompt: "yes" if any(c.isdigit() for c in prompt.split("\nA: ")[-1]) else "no")
    yield server
    server.close()


@pytest.fixture
def env_rows(tmp_path):
    """guess_number's games, each prompt one short user line (the tiny tokenizer spells the demo's long system prompt
    byte by byte)."""
    import data
    rows = [{"prompt": [{"role": "user", "content": f"A number from {lo} to {lo + 9}."}], "ground_truth": str(lo + 3),
             "data_source": "environment", "extra_info": {"index": i, "lo": lo, "hi": lo + 9, "secret": lo + 3}}
            for i, lo in enumerate([1, 5, 7, 2, 9, 4, 3, 8])]
    data.write_parquet(rows, str(tmp_path / "games.parquet"))
    return tmp_path / "games.parquet"


def arithmetic(root):
    return [f"model.path={root}/model", f"data.train_files={root}/train.parquet", f"data.val_files={root}/val.parquet"]


def cases(name, folder, judge, agent_workdir, caller_dir, tools_file, env_rows):  # noqa: F811
    """(config file, overrides) of each route."""
    return {
        "default": ("configs.yaml", arithmetic(folder) + ["rollout.name=vllm", "rollout.enforce_eager=true"]),
        "grpo": ("configs.yaml", arithmetic(folder) + ["rollout.name=hf", "algorithm.adv_estimator=grpo",
                                                       f"reward.function={folder}/length.py:compute_score"]),
        "dapo": ("recipes/dapo.yaml", arithmetic(folder) + ["rollout.name=hf",
                                                            f"reward.function={folder}/length.py:compute_score"]),
        "ahead": ("configs.yaml", arithmetic(folder) + ["rollout.name=vllm", "rollout.enforce_eager=true",
                                                        "rollout.steps_ahead=1", "rollout.background=true"]),
        "tools": ("configs.yaml", [
            f"model.path={caller_dir}", f"data.train_files={agent_workdir}/train.parquet",
            f"data.val_files={agent_workdir}/val.parquet", f"reward.function={agent_workdir}/reward.py:compute_score",
            "rollout.name=hf", "rollout.max_response_length=40", "data.max_prompt_length=48",
            "rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{tools_file}:add]",
            "rollout.multi_turn.format=tag", "algorithm.adv_estimator=grpo"]),
        "environment": ("examples/guess_number.yaml", [
            f"model.path={caller_dir}", f"data.train_files={env_rows}", f"data.val_files={env_rows}",
            "rollout.name=hf", "rollout.max_response_length=40", "data.max_prompt_length=48", "trainer.max_kl=0"]),
        "judge": ("configs.yaml", arithmetic(folder) + [
            "rollout.name=hf", "reward.sources=[judge,function]",
            f"reward.function={folder}/length.py:compute_score", f"reward.judge.base_url={judge.url}",
            f"reward.judge.prompt_template={folder}/template.txt", "reward.judge.parser=yes_no",
            "reward.judge.max_tokens=4", "algorithm.adv_estimator=grpo"]),
        "reward_model": ("configs.yaml", arithmetic(folder) + [
            "rollout.name=hf", "reward.sources=[rule,model]", "reward.weights=[1.0,0.5]",
            f"reward.model_path={folder}/rm"]),
    }[name]


def untimed(rows):
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in rows]


@needs_base
@pytest.mark.parametrize("name", [
    pytest.param("default", marks=[pytest.mark.vllm, needs_vllm]), "grpo", "dapo",
    pytest.param("ahead", marks=[pytest.mark.vllm, needs_vllm]), "tools", "environment", "judge", "reward_model"])
def test_every_route_logs_the_rows_it_logged_before(name, base_tree, folder, judge, agent_workdir,  # noqa: F811
                                                    caller_dir, tools_file, env_rows, tmp_path):  # noqa: F811
    """The route's metrics.jsonl, every row and every key, equal to the base commit's, times aside."""
    config, overrides = cases(name, folder, judge, agent_workdir, caller_dir, tools_file, env_rows)
    procs = {}
    for tree, out in ((REPO, tmp_path / "now"), (str(base_tree), tmp_path / "before")):
        cmd = [sys.executable, "ppo.py", "--config", config, *SMALL, *overrides, f"trainer.output_dir={out}"]
        procs[out] = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    for out, proc in procs.items():
        log = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, f"{out.name}: {log[-4000:]}"
    now, before = read_metrics(tmp_path / "now"), read_metrics(tmp_path / "before")
    assert len(now) == len(before) >= 3
    assert untimed(now) == untimed(before)
