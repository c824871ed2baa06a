"""rollout.name=server against vLLM's real OpenAI-compatible server (rollout_kinds/server.py): weight pushes, LoRA and full,
that make the server answer as HF generate on the trainer's weights; ppo.py training through it, in step and running
ahead (rollout.steps_ahead=1, the thread against the same schedule in turn, 2 FSDP2 processes against 1); and a
child server that stops with its run.

One server for the module (started by rollout_server.ServerProcess, the code ppo.py starts its child with), fp32, on
a tiny model with LoRA enabled; every test that pushes full weights (a full fine-tune, or a LoRA actor merged) puts
the base back after it. The SIGTERM test starts a second server, as ppo.py's own child.
"""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import REPO, arithmetic_run_folder, as_rows, free_port, read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed")]
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / 8.0
'''
UNTIMED = ("time/", "perf/")


class OneProcess:
    """What ServerRollout reads of accelerate's Accelerator, for one process."""
    device, process_index, num_processes, is_main_process = torch.device("cpu"), 0, 1, True

    @staticmethod
    def unwrap_model(model):
        return model

    def wait_for_everyone(self):
        pass


def config(root, *overrides):
    from infra.cli import load_config
    return load_config(os.path.join(REPO, "configs.yaml"), [
        f"model.path={root}/model", "rollout.name=server", "model.dtype=fp32", "rollout.dtype=fp32",
        "rollout.max_response_length=8", "data.max_prompt_length=128", "model.lora_rank=8",
        "model.target_modules=q_proj,v_proj", f"trainer.output_dir={root}/pushes", *overrides])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """<root> with a tiny model, data and a reward; the module's server (LoRA enabled, rank 8) at its url."""
    from rollout_kinds.server import ServerProcess

    root = tmp_path_factory.mktemp("server")
    arithmetic_run_folder(root, 40, 8)
    (root / "reward.py").write_text(REWARD_FILE)
    process = ServerProcess(config(root), torch.float32, 32 << 20, str(root / "server.log"))
    yield root, process.url
    process.stop()


def prompts(root) -> list[list[int]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    return [tokenizer(f"What is {a} + {b}?")["input_ids"] for a, b in [(3, 4), (10, 5), (7, 7)]]


def hf_greedy(model, prompts: list, eos: int) -> list[list[int]]:
    """HF generate's greedy answers on the trainer's weights, up to EOS (8 tokens at most)."""
    answers = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=eos)[0, len(p):]
            answers.append(out.tolist()[:out.tolist().index(eos) + 1] if eos in out.tolist() else out.tolist())
    return answers


def served_greedy(rollout, prompts: list) -> list[list[int]]:
    out = rollout.generate(as_rows(prompts), 1, 0.0)
    return [row[mask.bool()].tolist() for row, mask in zip(out.responses, out.response_mask)]


def train_a_step(model, ids: list[int], lr: float) -> None:
    """One Adam step of next-token loss on `ids`, so that the weights (LoRA's B included) move."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def base_restored(server):
    """Full-weight pushes change the module server's base: it reloads model.path afterwards."""
    yield
    from rollout_kinds.server import Client
    root, url = server
    Client(url, 1, 300.0, 1 << 30).reload_weights(str(root / "model"))


@pytest.mark.parametrize("push", ["adapter", "merged"])
def test_lora_pushes_make_the_server_answer_as_hf_generate(server, base_restored, push):
    """A LoRA actor pushed after each of 3 updates (adapter: a new adapter each time, through /v1/load_lora_adapter;
    merged: W + s·B·A as full weights, reloaded in place): the server's greedy answers equal HF generate's on the
    trainer's weights, and the updates did change them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rollout_kinds.server import ServerRollout
    root, url = server
    cfg = config(root, f"rollout.server.url={url}", f"rollout.server.lora_push={push}")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    rollout, asked = ServerRollout(cfg, model, tokenizer, OneProcess()), prompts(root)
    assert (rollout.model_name != rollout.client.base) == (push == "adapter")  # what the requests name
    answers = [served_greedy(rollout, asked)]
    assert answers[0] == hf_greedy(model, asked, tokenizer.eos_token_id)
    for version in (1, 2, 3):
        train_a_step(model, asked[0] + asked[1], lr=0.05)
        rollout.sync_weights(model, version)
        answers.append(served_greedy(rollout, asked))
        assert answers[-1] == hf_greedy(model, asked, tokenizer.eos_token_id), version
    assert answers[-1] != answers[0]
    rollout.close()


def ppo_args(root, url, out, *overrides):
    return ["ppo.py", "--config", "configs.yaml", f"model.path={root}/model", f"data.train_files={root}/train.parquet",
            f"data.val_files={root}/val.parquet", f"reward.function={root}/reward.py:compute_score",
            "rollout.name=server", f"rollout.server.url={url}", "rollout.max_response_length=8",
            "data.max_prompt_length=128", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "trainer.total_steps=3", "trainer.save_freq=0", "trainer.test_freq=3", "trainer.sample_freq=0",
            "data.val_max_samples=4", "trainer.max_kl=0", "model.dtype=fp32", "rollout.dtype=fp32",
            "actor.optim.lr=1e-2", "model.lora_rank=8", "model.target_modules=q_proj,v_proj",
            "algorithm.adv_estimator=grpo", "trainer.plot_curves=false", f"trainer.output_dir={out}", *overrides]


def run(cmd, timeout=600):
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def untimed(out) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(UNTIMED)} for m in read_metrics(out)]


def test_ppo_trains_through_the_server_with_the_trainers_weights(server, tmp_path):
    """ppo.py with rollout.name=server, in step (k = 0), 3 steps of GRPO with LoRA: the sampler's log-probs of
    the sampled tokens equal the trainer's at every step (fp32), so each push carried the weights just trained; the
    pushed folders are gone at the end."""
    root, url = server
    run([sys.executable, *ppo_args(root, url, tmp_path / "out")])
    steps = [m for m in read_metrics(tmp_path / "out") if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3] and "val/score/mean" in steps[-1]
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in steps), [m["rollout/logprob_diff_max"] for m in steps]
    assert steps[-1]["kl/mean"] != 0 and not (tmp_path / "out" / "rollout_weights").exists()


def test_one_step_ahead_logs_what_the_same_schedule_in_turn_logs(server, tmp_path):
    """rollout.steps_ahead=1: the background thread's run logs, row for row, what rollout.background=false logs
    (the same batches from the same weights and seeds, generated in turn); staleness 0 at step 1, then 1; the
    sampler's log-probs are one update behind the trainer's, and the token-level correction (rollout_is auto)
    weighs them."""
    root, url = server
    ahead = ("rollout.steps_ahead=1", "trainer.total_steps=4", "trainer.test_freq=2")
    run([sys.executable, *ppo_args(root, url, tmp_path / "thread", *ahead)])
    run([sys.executable, *ppo_args(root, url, tmp_path / "in_turn", *ahead, "rollout.background=false")])
    thread = untimed(tmp_path / "thread")
    assert thread == untimed(tmp_path / "in_turn")
    steps = [m for m in thread if m["step"] > 0]
    assert [m["rollout/staleness_max"] for m in steps] == [0, 1, 1, 1]
    assert steps[0]["rollout/logprob_diff_max"] < 1e-3 < steps[2]["rollout/logprob_diff_max"]
    assert all(m["rollout/is_weight_mean"] != 1.0 for m in steps[1:])


FSDP_SAME_TOKENS = ("rollout.temperature=0", "rollout.ignore_eos=true", "actor.ppo_epochs=2", "trainer.test_freq=0",
                    "trainer.val_before_train=false", "actor.entropy_coef=0.01", "rollout.steps_ahead=1",
                    "algorithm.use_kl_loss=true")


def test_two_fsdp2_processes_one_step_ahead_log_what_one_logs(server, tmp_path):
    """rollout.steps_ahead=1 under FSDP2 with 2 processes (gloo), each sending its own prompts to the server, rank 0
    pushing the gathered adapter: the run finishes and logs what 1 process logs (greedy, full-length responses, as
    tests/test_fsdp.py compares), so every process's samples and versions stayed in step."""
    root, url = server
    run([sys.executable, *ppo_args(root, url, tmp_path / "one", *FSDP_SAME_TOKENS)])
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2.yaml",
                "--num_processes", "2", "--main_process_port", str(free_port()),
                *ppo_args(root, url, tmp_path / "two", *FSDP_SAME_TOKENS)])
    assert "parallel: fsdp2 over 2 processes" in proc.stdout
    one, two = ([m for m in read_metrics(tmp_path / out) if m["step"] > 0] for out in ("one", "two"))
    assert [m["step"] for m in two] == [1, 2, 3] and [m["rollout/staleness_max"] for m in two] == [0, 1, 1]
    for a, b in zip(one, two):
        for key in ("score/mean", "kl/mean", "loss/policy", "policy/entropy", "actor/grad_norm",
                    "rollout/logprob_diff_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_full_weight_pushes_make_the_server_answer_as_hf_generate(server, base_restored):
    """A fully trained actor pushed after each of 3 updates (safetensors in a folder, /collective_rpc reload_weights,
    then /reset_prefix_cache): the server's greedy answers equal HF generate's on the trainer's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_kinds.server import ServerRollout
    root, url = server
    cfg = config(root, f"rollout.server.url={url}", "model.lora_rank=0")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    rollout, asked = ServerRollout(cfg, model, tokenizer, OneProcess()), prompts(root)
    first = served_greedy(rollout, asked)
    for version in (1, 2, 3):
        train_a_step(model, asked[0] + asked[2], lr=0.01)
        rollout.sync_weights(model, version)
        assert served_greedy(rollout, asked) == hf_greedy(model, asked, tokenizer.eos_token_id), version
    assert served_greedy(rollout, asked) != first
    rollout.close()


def test_ppo_full_finetune_through_the_server(server, base_restored, tmp_path):
    """ppo.py with a full fine-tune (model.lora_rank=0) through the server, 3 steps: the sampler's log-probs equal the
    trainer's at every step, as with LoRA."""
    root, url = server
    run([sys.executable, *ppo_args(root, url, tmp_path / "out", "model.lora_rank=0", "actor.optim.lr=1e-4")])
    steps = [m for m in read_metrics(tmp_path / "out") if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in steps), [m["rollout/logprob_diff_max"] for m in steps]


def test_a_child_server_stops_with_its_run_on_sigterm(server, tmp_path):
    """ppo.py starting its own server (no rollout.server.url), one step ahead: SIGTERM after the first step ends the
    run with a checkpoint (exit 143), the server's log is in the run folder, and no process the run started is left."""
    root, _ = server
    out = tmp_path / "out"
    cmd = [sys.executable, *ppo_args(root, "null", out, "rollout.steps_ahead=1", "trainer.total_steps=50",
                                     "trainer.test_freq=0", "trainer.val_before_train=false")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    started, commands, lines = [], [], []
    for line in proc.stdout:
        lines.append(line)
        if not started and "step 1  " in line:
            started = psutil.Process(proc.pid).children(recursive=True)  # the server and its engine, the workers
            commands = [" ".join(p.cmdline()) for p in started]
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 143, "".join(lines)[-3000:]
    assert any("vllm.entrypoints.openai.api_server" in command for command in commands), commands
    deadline = time.time() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started) and time.time() < deadline:
        time.sleep(0.5)
    assert not [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert (out / "rollout_server.log").stat().st_size > 0 and any(p.name.startswith("step_") for p in out.iterdir())
