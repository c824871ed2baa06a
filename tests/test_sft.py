"""sft.py: the loss equals a plain token-mean cross-entropy over the assistant's tokens, in every batch layout; the
three row layouts; training end to end on a tiny model (a subprocess); the chain SFT → reward model, SFT → DPO → PPO through final/."""
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from conftest import arithmetic_run_folder, make_tokenizer, read_metrics
from test_dpo import run_stage, workdir  # noqa: F401 (the fixture)
from test_reward_model import run_rm

import data
import sft
from infra.batches import Forward
from infra.layouts import use_varlen_attention
from infra.tables import load_sft_rows


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_loss_is_the_plain_token_mean_cross_entropy(tiny_model_dir, layout):
    """Σ over micro-batches of sft.token_nll(…, N) equals F.cross_entropy over the assistant's tokens of every row,
    averaged over all of them, computed here on each whole conversation (prompt + response) without padding; the
    prompt's tokens count for nothing. Rows of different lengths, two sharing a prompt, in micro-batches of 2."""
    from transformers import AutoModelForCausalLM
    tok = make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "What is 2 + 3?", "response": "5"}, {"prompt": "What is 2 + 3?", "response": "The answer is 5"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
             "response": "hello world"}, {"prompt": "What is 11 + 1?", "response": "12 good"}]
    tokenized, _ = data.tokenize_completions(rows, ("response",), tok, 64, "drop", "rows")
    N = sum(len(r[0]) for _, r in tokenized)
    plain = 0.0
    for prompt, (response,) in tokenized:
        ids = torch.tensor([prompt + response])
        logits = model(ids).logits[0, len(prompt) - 1:-1]  # the positions that predict the response
        plain += F.cross_entropy(logits, torch.tensor(response), reduction="sum")
    plain /= N
    if layout == "packed":  # as sft.py does: attention within each group of the packed row
        use_varlen_attention(model)
    fwd = Forward(1.0, None, layout)
    ours = sum(sft.token_nll(fwd.logprobs(model, mb)[0], mb["response_mask"], N)
               for mb in (sft.rows_batch(tokenized[i:i + 2], "cpu", tok.pad_token_id) for i in (0, 2)))
    assert ours.item() == pytest.approx(plain.item(), abs=1e-5)
    assert tokenized[0][1][0][-2:] == tok("<|im_end|>\n", add_special_tokens=False).input_ids  # learns to stop


def test_three_layouts_of_rows(tmp_path):
    """messages (every assistant turn a row, the chat before it its prompt), prompt + response, and preference
    pairs (chosen) give the same {prompt, response} rows; a chat without an assistant turn fails in a sentence."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2 + 2"}, {"role": "assistant", "content": "4"}]
    pq.write_table(pa.Table.from_pylist([{"messages": chat}]), str(tmp_path / "chat.parquet"))
    rows, stats = load_sft_rows(str(tmp_path / "chat.parquet"))
    assert rows == [{"prompt": chat[:1], "response": "hello"}, {"prompt": chat[:3], "response": "4"}]
    assert stats["layout"] == "messages"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2 + 2", "response": "4"}]), str(tmp_path / "pr.parquet"))
    assert load_sft_rows(str(tmp_path / "pr.parquet"))[0] == [{"prompt": "2 + 2", "response": "4"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": "2 + 2", "chosen": "4", "rejected": "5"}]),
                   str(tmp_path / "pairs.parquet"))
    assert load_sft_rows(str(tmp_path / "pairs.parquet"))[0] == [{"prompt": "2 + 2", "response": "4"}]
    pq.write_table(pa.Table.from_pylist([{"messages": chat[:1]}]), str(tmp_path / "none.parquet"))
    with pytest.raises(data.DataError, match="none.parquet row 0: `messages` has no assistant turn"):
        load_sft_rows(str(tmp_path / "none.parquet"))


def test_sft_then_dpo_then_ppo_chain_through_final(workdir, tmp_path):  # noqa: F811
    """sft.py trains (its loss falls) and writes final/, a plain causal LM; reward_model.py and dpo.py train from it
    (their model_path), and ppo.py from dpo's final/ (model.path): each stage's final/ is the next one's model."""
    sft_out, dpo_out = tmp_path / "sft", tmp_path / "dpo"
    run_stage("sft.py", "sft", workdir, sft_out, "sft.total_steps=6", "sft.eval_freq=0", "sft.optim.lr=3e-3")
    lines = read_metrics(sft_out)
    assert [m["step"] for m in lines] == list(range(7)) and "val/score/mean" in lines[0]
    assert all(math.isfinite(m["loss"]) for m in lines[1:]) and lines[-1]["loss"] < lines[1]["loss"]
    assert "val/loss" in lines[-1] and (sft_out / "final" / "config.json").exists()
    run_rm(workdir, tmp_path / "rm", f"reward_model.model_path={sft_out}/final", "reward_model.total_steps=1")
    assert (tmp_path / "rm" / "final" / "config.json").exists()  # SFT → reward model
    run_stage("dpo.py", "dpo", workdir, dpo_out, "dpo.total_steps=2", "dpo.eval_freq=0", "dpo.val_before_train=false",
              f"dpo.model_path={sft_out}/final")
    assert (dpo_out / "final" / "model.safetensors").exists()
    ppo_dir = arithmetic_run_folder(tmp_path / "ppo_data", train=8, val=4)
    import subprocess, sys, os  # noqa: E401
    from conftest import REPO
    proc = subprocess.run([sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={dpo_out}/final",
                           f"data.train_files={ppo_dir}/train.parquet", f"data.val_files={ppo_dir}/val.parquet",
                           f"trainer.output_dir={tmp_path / 'ppo'}", "trainer.total_steps=1", "rollout.name=hf",
                           "rollout.n=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                           "rollout.max_response_length=4", "trainer.val_before_train=false", "model.dtype=fp32",
                           "algorithm.adv_estimator=grpo", "trainer.test_freq=0", "model.lora_rank=4"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "ppo") if m["step"] > 0] == [1]
