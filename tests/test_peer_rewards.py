"""What users of TRL and OpenRLHF already have drops in as they wrote it (issue 49): a reward function in its own
project's signature, named by reward.function, recognised by its parameters, called once per batch with the keywords
that project gives, checked by a sample call before the policy loads, and its reward arriving in one real step on
the tiny model. (verl's per-sample compute_score: tests/test_verl_rewards.py.)"""
import json
import os
import subprocess
import sys

import pytest

import data
import rewards
from conftest import REPO, make_tiny_model, pip_install, read_metrics

# TRL's reward functions as its docs write them (GRPOTrainer, "Using a custom reward function"): conversational data,
# each completion a list of messages, the dataset's other columns as keywords; None = no reward for that sample
TRL_REWARDS = '''
import json, os


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    import re
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


def graded(prompts, completions, answer, difficulty, **kwargs):
    """A reward only for the hard prompts (None elsewhere); what it was given, logged beside this file."""
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "answer": answer,
                            "difficulty": difficulty, "completion_ids": kwargs.get("completion_ids")}) + "\\n")
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]  # standard or conversational data
    return [len(t) / 10 if d == "hard" else None for t, d in zip(texts, difficulty)]


def unpacked(prompts, completions):
    return [0.5] * len(completions)


def wrong_arity(prompts, completions, **kwargs):
    return 1.0
'''

# OpenRLHF's reward-function file as its README writes it (--remote_rm_url reward_func.py, --label_key answer)
OPENRLHF_REWARDS = '''
import torch


def reward_func(queries, prompts, labels):
    """
    queries: List[str] - Full text (prompt + response); prompts: List[str] - Original prompts only;
    labels: List[str] - Ground truth labels (from --label_key)
    """
    reward = torch.tensor([float(len(q) - len(p)) / 8 for q, p in zip(queries, prompts)])
    assert all(q.startswith(p) for q, p in zip(queries, prompts)) and labels == ["2", "3", "4", "5"][:len(labels)] \\
        or all(l in ("2", "3", "4", "5") for l in labels)
    return {
        "rewards": reward,
        "scores": reward,
        "extra_logs": {"custom_metric": reward.mean().item()},
    }


def plain(queries, prompts, labels, **kwargs):
    return torch.ones(len(queries))
'''


def ppo_args(model, train, out) -> list[str]:
    """One step of ppo.py on the tiny model, HF rollout, 4 prompts × 2 samples."""
    return ["--config", "configs.yaml", f"model.path={model}", f"data.train_files={train}", "data.val_files=null",
            "rollout.name=hf", "rollout.max_response_length=8", "data.max_prompt_length=64", "data.train_batch_size=4",
            "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.total_steps=1", "trainer.save_freq=0",
            "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false", "trainer.val_before_train=false",
            "trainer.max_kl=0", f"trainer.output_dir={out}", "model.dtype=fp32"]


def run_ppo(model, train, out, *overrides):
    return subprocess.run([sys.executable, "ppo.py", *ppo_args(model, train, out), *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def trl_rows():
    """TRL's conversational prompt-only layout, with columns of the user's own (no data_source, no ground_truth)."""
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "answer": str(i + 2),
             "difficulty": "hard" if i % 2 else "easy"} for i in range(4)]


def test_trl_reward_functions_are_recognised_and_get_trls_keywords(tmp_path):
    """Recognised by `completions`; called once for the batch with prompts, completions (strings for standard data,
    message lists for conversational data) and every other column; None scores 0 as "no reward"; a function taking
    no **kwargs gets only what it names; a wrong return is an error for every sample, never a silent score."""
    (tmp_path / "r.py").write_text(TRL_REWARDS)
    standard = [{"prompt": "What is 1 + 2?", "prompt_text": "What is 1 + 2?", "ground_truth": None,
                 "data_source": "unknown", "extra_info": {}, "columns": {"prompt": "What is 1 + 2?", "answer": "3",
                                                                         "difficulty": d}} for d in ("hard", "easy")]
    graded = rewards.load_reward_function(f"{tmp_path}/r.py:graded", 10)
    assert graded.style == "trl"
    scores, extras, errors = rewards.score_responses(graded, standard, ["It is 3", "3"])
    assert (scores, extras, errors) == ([0.7, 0.0], {"no_reward": [0.0, 1.0]}, 0)
    call = json.loads((tmp_path / "calls.jsonl").read_text())
    assert call == {"prompts": ["What is 1 + 2?"] * 2, "completions": ["It is 3", "3"], "answer": ["3", "3"],
                    "difficulty": ["hard", "easy"], "completion_ids": None}
    assert rewards.score_responses(rewards.load_reward_function(f"{tmp_path}/r.py:unpacked", 10), standard,
                                   ["a", "b"])[0] == [0.5, 0.5]
    with pytest.raises(rewards.RewardError, match="must return a list of rewards .*, got 1.0"):
        rewards.score_responses(rewards.load_reward_function(f"{tmp_path}/r.py:wrong_arity", 10), standard, ["a", "b"])


def test_a_trl_reward_function_trains_one_step_on_its_own_columns(tmp_path):
    """TRL's conversational data with its own columns and three of TRL's reward functions as its docs write them: the
    step runs, each reward arrives (reward/function/mean, reward/no_reward = the share of None), and the function saw
    the columns, message-list completions and their token ids."""
    model = make_tiny_model(tmp_path / "model")
    data.write_parquet(trl_rows(), str(tmp_path / "t.parquet"))
    (tmp_path / "r.py").write_text(TRL_REWARDS)
    proc = run_ppo(model, tmp_path / "t.parquet", tmp_path / "out", f"reward.function={tmp_path}/r.py:graded")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    step = [line for line in read_metrics(tmp_path / "out") if line["step"] == 1][0]
    assert step["reward/errors"] == 0 and step["reward/no_reward"] == 0.5 and step["reward/function/mean"] > 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    batch = calls[-1]  # the first is the sample call at start-up
    assert len(calls) == 2 and len(calls[0]["prompts"]) == 1 and len(batch["prompts"]) == 8
    assert sorted(batch["answer"]) == sorted([r["answer"] for r in trl_rows()] * 2)
    assert batch["prompts"][0][0]["role"] == "user" and batch["completions"][0][0]["role"] == "assistant"
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in batch["completion_ids"])


TRL = "trl==0.19.1"  # as tests/test_crosscheck_dpo.py installs it


def test_trls_own_reward_function_from_the_real_package_trains_one_step(tmp_path):
    """TRL's shipped think_format_reward (trl.rewards, installed from PyPI), named as TRL users name it in
    reward_funcs: recognised, scoring conversational completions as TRL scores them (1 for "<think>…</think>…", 0
    else), and through ppo.py one step where the reward arrives with no error."""
    root = pip_install(TRL)
    (tmp_path / "r.py").write_text("from trl.rewards import think_format_reward\n")
    sys.path.insert(0, root)  # the worker imports the file with this process's sys.path
    try:
        fn = rewards.load_reward_function(f"{tmp_path}/r.py:think_format_reward", 10)
        rows = [{"prompt": m["prompt"], "prompt_text": "", "ground_truth": None, "data_source": "unknown",
                 "extra_info": {}, "columns": m} for m in trl_rows()[:2]]
        assert fn.style == "trl" and rewards.score_responses(fn, rows, ["<think>\nso\n</think>\n4", "4"]) == (
            [1.0, 0.0], {"no_reward": [0.0, 0.0]}, 0)
    finally:
        sys.path.remove(root)
    model = make_tiny_model(tmp_path / "model")
    data.write_parquet(trl_rows(), str(tmp_path / "t.parquet"))
    proc = subprocess.run([sys.executable, "ppo.py", *ppo_args(model, tmp_path / "t.parquet", tmp_path / "out"),
                           f"reward.function={tmp_path}/r.py:think_format_reward"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    step = [line for line in read_metrics(tmp_path / "out") if line["step"] == 1][0]
    assert step["reward/errors"] == 0 and step["reward/no_reward"] == 0 and "reward/function/mean" in step


def test_a_trl_reward_function_that_fails_its_sample_call_stops_before_the_policy_loads(tmp_path):
    """TRL's reward function given as verl's would be called (the issue's "missing 2 required positional arguments"
    once called per sample) is recognised, called once on the first row, and its wrong return (a number, not a list)
    stops the run in one sentence naming the file, the function and the error; the model's weights are garbage, so
    reaching any model load would fail otherwise."""
    model = make_tiny_model(tmp_path / "model")
    with open(os.path.join(model, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    data.write_parquet(trl_rows(), str(tmp_path / "t.parquet"))
    (tmp_path / "r.py").write_text(TRL_REWARDS)
    proc = run_ppo(model, tmp_path / "t.parquet", tmp_path / "out", f"reward.function={tmp_path}/r.py:wrong_arity")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ppo.py: reward.function={tmp_path}/r.py:wrong_arity: the trl-style reward function failed its sample call "
        f"on the data's first row: a batched reward function must return a list of rewards (float or None), one per "
        f"completion (1), got 1.0")


# a verl and a TRL reward function in one file that notes each process importing it, and each TRL call
COUNTED = '''
import os

HERE = os.path.dirname(__file__)
with open(os.path.join(HERE, "imports.txt"), "a") as f:
    f.write(f"{os.getpid()}\\n")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def reward_len(completions, **kwargs):
    with open(os.path.join(HERE, "calls.txt"), "a") as f:
        f.write(f"{len(completions)}\\n")
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]
'''


def test_the_start_up_checks_import_a_reward_function_in_one_worker_process(tmp_path):
    """`ppo.py --check` with a reward.function imports the file in one worker process, which serves both start-up
    checks: that it imports, and a TRL function's sample call (made once; verl's compute_score is not called). A
    second worker, started only to learn the function's style, used to import it once more."""
    model = make_tiny_model(tmp_path / "model")
    data.write_parquet(trl_rows(), str(tmp_path / "t.parquet"))
    (tmp_path / "r.py").write_text(COUNTED)
    for name, sample_calls in [("compute_score", []), ("reward_len", ["1"])]:
        for log in ("imports.txt", "calls.txt"):
            (tmp_path / log).unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "ppo.py", "--check", *ppo_args(model, tmp_path / "t.parquet",
                                                                              tmp_path / "out"),
                               f"reward.function={tmp_path}/r.py:{name}"], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        calls = (tmp_path / "calls.txt").read_text().split() if (tmp_path / "calls.txt").exists() else []
        assert len((tmp_path / "imports.txt").read_text().split()) == 1 and calls == sample_calls, name


def test_an_openrlhf_reward_func_file_trains_one_step(tmp_path):
    """OpenRLHF's reward_func(queries, prompts, labels) returning {"rewards", "scores", "extra_logs"}: recognised by
    `queries`, the step runs and the reward arrives, with its extra_logs and scores logged; the tensor-only return
    scores as well."""
    (tmp_path / "reward_func.py").write_text(OPENRLHF_REWARDS)
    row = {"prompt": "p", "prompt_text": "<q>", "ground_truth": "2", "data_source": "x", "extra_info": {}}
    fn = rewards.load_reward_function(f"{tmp_path}/reward_func.py:reward_func", 10)
    assert fn.style == "openrlhf"
    assert rewards.score_responses(fn, [row, row], ["abcdefgh", ""]) == (
        [1.0, 0.0], {"scores": [0.5, 0.5], "custom_metric": [0.5, 0.5]}, 0)
    plain = rewards.load_reward_function(f"{tmp_path}/reward_func.py:plain", 10)
    assert rewards.score_responses(plain, [row] * 3, ["a", "b", "c"]) == ([1.0] * 3, {}, 0)
    model = make_tiny_model(tmp_path / "model")
    rows = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(4)]  # OpenRLHF's --label_key answer
    data.write_parquet([{**r, "ground_truth": r["answer"]} for r in rows], str(tmp_path / "t.parquet"))
    proc = run_ppo(model, tmp_path / "t.parquet", tmp_path / "out", f"reward.function={tmp_path}/reward_func.py")
    assert proc.returncode != 0  # reward_func is not compute_score: the file's function is named, as OpenRLHF names it
    proc = run_ppo(model, tmp_path / "t.parquet", tmp_path / "out",
                   f"reward.function={tmp_path}/reward_func.py:reward_func")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    step = [line for line in read_metrics(tmp_path / "out") if line["step"] == 1][0]
    assert step["reward/errors"] == 0 and step["reward/custom_metric"] == pytest.approx(step["reward/function/mean"])
    assert step["reward/scores"] == pytest.approx(step["reward/function/mean"]) and step["reward/function/mean"] > 0


def test_the_style_can_be_named_and_a_batched_call_that_raises_fails_every_sample(tmp_path):
    """reward.function_style names the convention where the parameters do not tell it (OpenRLHF's three then go by
    position, as OpenRLHF passes them); a wrong name, or a batched call that raises, is
    an error for each of its samples, so a batch where it always raises stops (RewardError), never trains on zeros."""
    (tmp_path / "r.py").write_text("def score(qs, ps, labels):\n    return [1.0] * len(qs)\n"
                                   "def boom(prompts, completions, **kw):\n    raise RuntimeError('judge is down')\n")
    row = {"prompt": "p", "prompt_text": "p", "ground_truth": "2", "data_source": "x", "extra_info": {}, "columns": {}}
    assert rewards.load_reward_function(f"{tmp_path}/r.py:score", 10).style == "verl"
    named = rewards.load_reward_function(f"{tmp_path}/r.py:score", 10, style="openrlhf")
    assert rewards.score_responses(named, [row, row], ["a", "b"]) == ([1.0, 1.0], {}, 0)  # by position, as OpenRLHF
    named = rewards.load_reward_function(f"{tmp_path}/r.py:score", 10, style="trl")
    with pytest.raises(rewards.RewardError, match="missing 3 required positional arguments"):
        rewards.score_responses(named, [row], ["a"])  # named wrongly: its own sentence, not a silent 0
    with pytest.raises(rewards.RewardError, match="failed on all 2 samples .* RuntimeError: judge is down"):
        rewards.score_responses(rewards.load_reward_function(f"{tmp_path}/r.py:boom", 10), [row, row], ["a", "b"])


# ---- verl's launch keys (infra/verl_keys.py)

# verl's examples/grpo_trainer/run_qwen2-7b.sh, its overrides as written there ($HOME's data paths aside)
VERL_GRPO_LINE = """algorithm.adv_estimator=grpo data.train_files={train} data.val_files={train}
    data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024
    data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
    trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2_7b_function_rm
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15"""

# the 56 keys verl's example scripts (examples/**/*.sh, verl of January 2026) set most often, with a value each
VERL_TOP_56 = """trainer.project_name=p trainer.logger=["console","wandb"] trainer.experiment_name=e
    data.train_files={train} data.val_files={train} trainer.total_epochs=3 data.train_batch_size=4 trainer.nnodes=1
    trainer.n_gpus_per_node=1 data.truncation=error data.max_response_length=1024 data.max_prompt_length=1024
    algorithm.adv_estimator=grpo actor_rollout_ref.rollout.name=vllm actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B
    actor_rollout_ref.actor.ppo_mini_batch_size=128 actor_rollout_ref.actor.optim.lr=1e-6 trainer.save_freq=5
    trainer.test_freq=5 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.actor.use_kl_loss=True
    algorithm.use_kl_in_reward=False data.filter_overlong_prompts=True trainer.critic_warmup=0
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.val_before_train=True actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.rollout.enable_chunked_prefill=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
    data.return_raw_chat=True actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 critic.optim.lr=1e-5 critic.model.path=/m
    trainer.default_local_dir=/tmp/ckpt algorithm.kl_ctrl.kl_coef=0.001
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24000
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2 actor_rollout_ref.rollout.max_num_batched_tokens=8192
    data.prompt_key=prompt critic.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24000 critic.model.use_remove_padding=True"""


@pytest.fixture
def verl_data(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 2?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)}} for i in range(2048)]
    data.write_parquet(rows, str(tmp_path / "train.parquet"))
    return str(tmp_path / "train.parquet")


def test_verls_example_launch_line_loads_as_this_librarys_config(verl_data, capsys):
    """run_qwen2-7b.sh's overrides, as verl's example writes them, load: each key becomes ours (one console line
    each that changed), verl's low_var_kl is k3, filter_overlong_prompts wins over truncation as in verl, 15 epochs of
    2048 rows at 1024 a batch are 30 steps, and the keys that only place the run are left out with the reason."""
    from infra.cli import load_config
    cfg = load_config("configs.yaml", VERL_GRPO_LINE.format(train=verl_data).split())
    assert (cfg.algorithm.adv_estimator, cfg.actor.optim.lr, cfg.rollout.n, cfg.rollout.max_response_length) == (
        "grpo", 1e-6, 5, 1024)
    assert (cfg.algorithm.use_kl_loss, cfg.algorithm.kl_loss_coef, cfg.algorithm.kl_loss_type) == (True, 0.001, "k3")
    assert (cfg.data.truncation, cfg.trainer.total_steps, cfg.actor.ppo_micro_batch_size_per_device) == (
        "filter", 30, 40)
    assert (cfg.model.path, cfg.model.gradient_checkpointing, cfg.actor.entropy_coef) == (
        "Qwen/Qwen2-7B-Instruct", True, 0.0)
    assert cfg.trainer.logger == ["console", "wandb"] and cfg.critic.warmup_steps == 0
    out = capsys.readouterr().out
    assert "verl key actor_rollout_ref.actor.kl_loss_type=low_var_kl → algorithm.kl_loss_type=k3" in out
    assert "verl key trainer.n_gpus_per_node=8 is left out: the processes are accelerate's" in out
    assert "verl key trainer.total_epochs=15 → trainer.total_steps=30" in out


def test_the_56_keys_verls_examples_use_most_each_translate_or_say_why(verl_data):
    """Each of the 56 keys verl's example scripts set most often, alone on a command line: it loads as one of this
    library's keys, or is left out or refused with the sentence saying why — never a "did you mean" guessed from its
    spelling, never a key that is not ours."""
    from infra import verl_keys
    from infra.cli import all_keys, load_config
    from infra.config import Config, ConfigError
    ours = set(all_keys(Config))
    items = VERL_TOP_56.format(train=verl_data).split()
    assert len(items) == 56 and len({item.split("=")[0] for item in items}) == 56
    for item in items:
        key = item.split("=")[0]
        try:
            translated, _ = verl_keys.translate_all([item], {"data": {"train_files": verl_data}})
            load_config("configs.yaml", [item, f"data.train_files={verl_data}"])
        except ConfigError as e:
            assert str(e).startswith(f"verl's `{key}` has no setting here: ") and "did you mean" not in str(e), e
            continue
        assert all(t.split("=")[0] in ours for t in translated), (item, translated)
    assert all(target in ours for targets in verl_keys.ALIASES.values()
               for target in ((targets,) if isinstance(targets, str) else targets))
    from infra.config import RewardModelStage
    from infra.config_offline import DPOStage, SFTStage
    every = ours | {key for root in (RewardModelStage, SFTStage, DPOStage) for key in all_keys(root)}
    tables = [*verl_keys.ALIASES, *verl_keys.IGNORED, *verl_keys.NO_SETTING]
    assert not [k for k in tables if any(o == k or (k.endswith(".") and o.startswith(k)) for o in every)]  # ours kept


def test_verls_kl_estimator_names_are_understood_and_others_say_why():
    """verl's names for the KL estimators (core_algos.kl_penalty) on verl's keys and on ours: kl = k1, mse = k2,
    low_var_kl = k3, abs; "full" is refused with the reason; a misspelt key of ours still gets the right "did you
    mean", and a verl key with no setting names its reason, not a look-alike key."""
    from infra.cli import load_config
    from infra.config import ConfigError
    for verl, ours in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("abs", "abs"), ("k3", "k3")):
        cfg = load_config("configs.yaml", [f"algorithm.kl_penalty={verl}",
                                           f"actor_rollout_ref.actor.kl_loss_type={verl}"])
        assert (cfg.algorithm.kl_penalty, cfg.algorithm.kl_loss_type) == (ours, ours)
    cfg = load_config("configs.yaml", ["algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                                        "algorithm.rollout_correction.rollout_is=null"])  # verl's names here too
    assert (cfg.algorithm.rollout_rs, cfg.algorithm.rollout_is) == ("sequence_mean", "off")
    with pytest.raises(ConfigError, match="algorithm.kl_penalty=full: the full-vocabulary KL needs every token's"):
        load_config("configs.yaml", ["algorithm.kl_penalty=full"])
    with pytest.raises(ConfigError, match=r"did you mean `actor.optim.lr`\?"):
        load_config("configs.yaml", ["actor.optim.llr=1e-6"])
    with pytest.raises(ConfigError, match=r"verl's `actor_rollout_ref.rollout.mode` has no setting here: the rollout"):
        load_config("configs.yaml", ["actor_rollout_ref.rollout.mode=async"])
    with pytest.raises(ConfigError, match=r"verl's `actor_rollout_ref.actor.optim.lr_warmup_steps` is not one this "):
        load_config("configs.yaml", ["actor_rollout_ref.actor.optim.lr_warmup_steps=10"])  # not "did you mean lr"


def test_a_verl_launch_line_passes_ppos_start_up_checks(tmp_path, verl_data):
    """verl's run_qwen2-7b.sh line, with the tiny model, HF rollout and batch sizes that fit 2 CPU processes' worth of
    data, goes through `ppo.py --check`: every start-up check passes on the translated config."""
    model = make_tiny_model(tmp_path / "model")
    line = VERL_GRPO_LINE.format(train=verl_data).split()
    swap = {"actor_rollout_ref.model.path": model, "actor_rollout_ref.rollout.name": "hf",
            "data.train_batch_size": "8", "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
            "data.max_prompt_length": "64", "data.max_response_length": "8"}
    line = [f"{k}={swap.get(k, v)}" for k, v in (item.split("=", 1) for item in line)]
    proc = subprocess.run([sys.executable, "ppo.py", "--config", "configs.yaml", "--check", *line,
                           f"trainer.output_dir={tmp_path}/out", "trainer.logger=[console]"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "verl key actor_rollout_ref.rollout.n=5 → rollout.n=5" in proc.stdout
    assert "verl key trainer.total_epochs=15 → trainer.total_steps=3840" in proc.stdout


VERL_YAML = """defaults:
  - ppo_trainer
  - _self_
data:
  train_batch_size: 8
  max_response_length: 256
  filter_overlong_prompts: true
actor_rollout_ref:
  model:
    path: Qwen/Qwen2.5-0.5B-Instruct
  actor:
    optim:
      lr: 1.0e-6
    ppo_mini_batch_size: 4
    kl_loss_type: low_var_kl
  rollout:
    n: 4
algorithm:
  adv_estimator: grpo
  kl_penalty: mse
trainer:
  logger: ["console", "wandb"]
  total_training_steps: 50
  save_freq: -1
"""


def test_a_verl_yaml_file_loads_as_its_launch_line_would(tmp_path, capsys):
    """A config file in verl's layout (Hydra's defaults list, actor_rollout_ref's nesting) given to --config reads as
    the same keys on verl's command line would: translated, each said, and the command line's overrides on top."""
    from infra.cli import load_config
    (tmp_path / "verl.yaml").write_text(VERL_YAML)
    cfg = load_config(str(tmp_path / "verl.yaml"), ["actor_rollout_ref.rollout.n=8"])
    assert (cfg.model.path, cfg.actor.optim.lr, cfg.actor.ppo_mini_batch_size, cfg.rollout.n) == (
        "Qwen/Qwen2.5-0.5B-Instruct", 1e-6, 4, 8)
    assert (cfg.algorithm.kl_loss_type, cfg.algorithm.kl_penalty, cfg.data.truncation) == ("k3", "k2", "filter")
    assert (cfg.rollout.max_response_length, cfg.trainer.total_steps, cfg.trainer.save_freq) == (256, 50, 0)
    assert cfg.trainer.logger == ["console", "wandb"]
    assert "is left out: Hydra's composition list" in capsys.readouterr().out
