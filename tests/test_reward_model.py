"""reward_model.py: the Bradley–Terry loss, the last-token read-out, training end to end (a subprocess
on a tiny model made in the test), resume, scoring with the reward model's own tokenizer, bad input."""
import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, make_tiny_model, make_tokenizer, read_metrics

import data
from reward_model import bradley_terry_loss, load_pairs
from data import render
from scorers.model import last_token_index, RewardModel, RewardModelScorer


def write_pairs(path, n, seed=0, **extra_columns):
    """n learnable pairs: an arithmetic question; chosen ends in "good", rejected in "bad"."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = torch.randint(0, 12, (2,), generator=g).tolist()
        rows.append({"prompt": f"What is {a} + {b}?", "chosen": f"{a + b} good", "rejected": f"{a + b} bad"})
    pq.write_table(pa.Table.from_pylist([{**r, **extra_columns} for r in rows]), str(path))
    return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    make_tiny_model(root / "model")
    write_pairs(root / "train.parquet", 64, seed=0)
    write_pairs(root / "val.parquet", 16, seed=1)
    return root


def run_rm(root, out, *overrides, expect_ok=True):
    cmd = [sys.executable, "reward_model.py", "--config", "configs.yaml", f"reward_model.model_path={root}/model",
           f"reward_model.train_files={root}/train.parquet", f"reward_model.val_files={root}/val.parquet",
           f"reward_model.output_dir={out}", "reward_model.batch_size=8", "reward_model.micro_batch_size_per_device=4",
           "reward_model.optim.lr=2e-3", "reward_model.lora_rank=8", "reward_model.stats_max_pairs=0", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: threads only add overhead
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_loss_hand_computed():
    """L = −log σ(r_c − r_r − m) + η(r_c + r_r)²: r_c=2, r_r=1 gives log(1+e⁻¹) = 0.31326; m=0.5 gives
    log(1+e^−0.5) = 0.47408; η=0.1 adds 0.1·3² = 0.9."""
    r_c, r_r = torch.tensor([2.0]), torch.tensor([1.0])
    assert bradley_terry_loss(r_c, r_r, 0.0, 0.0).item() == pytest.approx(0.31326, abs=1e-5)
    assert bradley_terry_loss(r_c, r_r, torch.tensor([0.5]), 0.0).item() == pytest.approx(0.47408, abs=1e-5)
    assert bradley_terry_loss(r_c, r_r, 0.0, 0.1).item() == pytest.approx(0.31326 + 0.9, abs=1e-5)
    x = torch.randn(6), torch.randn(6), torch.rand(6)
    plain = [math.log(1 + math.exp(-(c - r - m))) for c, r, m in zip(*(t.tolist() for t in x))]
    assert torch.allclose(bradley_terry_loss(*x, 0.0), torch.tensor(plain), atol=1e-5)


def test_last_real_token_with_pad_equal_to_eos(tmp_path):
    """With pad == eos and right padding, a text that ends in EOS is read at that EOS (where pad-id pooling,
    HF's rule, would read the token before it), and padding changes no score: batched == one at a time."""
    from transformers import AutoModelForSequenceClassification
    tok = make_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id
    hf = AutoModelForSequenceClassification.from_pretrained(make_tiny_model(tmp_path / "m"), num_labels=1,
                                                            pad_token_id=tok.pad_token_id)
    model = RewardModel(hf).eval()
    seqs = [tok("What is 2 + 3?").input_ids + [tok.eos_token_id], tok("hello world").input_ids]
    T = max(map(len, seqs))
    input_ids = torch.tensor([s + [tok.pad_token_id] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    assert last_token_index(mask).tolist() == [len(s) - 1 for s in seqs]
    by_pad_id = (torch.arange(T) * (input_ids != tok.pad_token_id)).argmax(-1)
    assert by_pad_id[0] == len(seqs[0]) - 2  # the trap this guards against
    with torch.no_grad():
        batched = model(input_ids, mask)
        alone = torch.cat([model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in seqs])
        hidden = hf.model(torch.tensor([seqs[0]])).last_hidden_state[0, -1]
    assert torch.allclose(batched, alone, atol=1e-5)
    assert torch.allclose(batched[0], hf.score(hidden)[0], atol=1e-5)


def test_training_learns_and_writes_a_loadable_reward_model(workdir, tmp_path):
    """On pairs a tiny model can learn ("… good" over "… bad"), 30 LoRA steps lift validation accuracy from
    about chance to ≥ 0.9 (measured: 1.0); final/ loads as a plain sequence classifier whose scores over the
    training responses have exactly the mean/std in reward_stats.json; identical pairs are counted."""
    from transformers import AutoModelForSequenceClassification
    rows = pq.read_table(str(workdir / "train.parquet")).to_pylist()
    rows += [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "2"}] * 3
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    out = tmp_path / "out"
    proc = run_rm(workdir, out, f"reward_model.train_files={tmp_path}/train.parquet", "reward_model.total_steps=30",
                  "reward_model.eval_freq=10")
    assert "'identical_dropped': 3" in proc.stdout
    lines = read_metrics(out)
    assert [m["step"] for m in lines] == list(range(1, 31))
    assert all(k in lines[0] for k in ("rm/loss", "rm/accuracy", "rm/margin", "rm/chosen_mean",
                                       "rm/rejected_mean", "lr", "time/step_s"))
    val = [m["val/rm/accuracy"] for m in lines if "val/rm/accuracy" in m]
    assert len(val) == 3 and val[-1] >= 0.9, val
    assert lines[-1]["val/rm/loss"] < 0.5 and lines[-1]["val/rm/margin"] > 0
    assert AutoModelForSequenceClassification.from_pretrained(out / "final").config.num_labels == 1
    assert (out / "final_adapter" / "adapter_config.json").exists()
    scorer = RewardModelScorer(str(out / "final"), micro_batch_size=16)
    kept = [r for r in rows if r["chosen"] != r["rejected"]]
    scores = scorer.score([r["prompt"] for r in kept] * 2, [r["chosen"] for r in kept] + [r["rejected"] for r in kept])
    stats = json.loads((out / "final" / "reward_stats.json").read_text())
    assert stats["mean"] == pytest.approx(scores.mean().item(), abs=1e-4)
    assert stats["std"] == pytest.approx(scores.std(unbiased=False).item(), abs=1e-4)
    assert (scores[:len(kept)] > scores[len(kept):]).float().mean() >= 0.9


def test_resume_gives_the_same_metrics(workdir, tmp_path):
    """4 steps in one run equal 2 steps, stopped, then resumed to 4 from its step_2 checkpoint: every metric
    line but the timings is identical (constant lr, so the shorter first run has the same schedule)."""
    args = ["reward_model.optim.lr_scheduler=constant", "reward_model.optim.warmup_ratio=0",
            "reward_model.save_freq=2", "reward_model.eval_freq=2"]
    run_rm(workdir, tmp_path / "a", "reward_model.total_steps=4", *args)
    run_rm(workdir, tmp_path / "b", "reward_model.total_steps=2", *args)
    proc = run_rm(workdir, tmp_path / "b", "reward_model.total_steps=4", *args)
    assert "resumed from" in proc.stdout and "step_2" in proc.stdout
    strip = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(tmp_path / "a")]
    resumed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(tmp_path / "b")]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert resumed == strip


def test_scorer_with_its_own_tokenizer(tmp_path):
    """A reward model whose tokenizer differs from the policy's scores raw prompts (text or chat messages)
    and decoded responses as if each were rendered with its own chat template and scored alone by hand;
    normalize uses reward_stats.json, clip bounds the result."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    policy_tok = make_tokenizer()
    rm_tok = make_tokenizer(corpus=["a completely different corpus of words for another vocabulary"] * 20 +
                            [f"{i} plus {i} is {2 * i}" for i in range(50)], vocab_size=300)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(rm_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=rm_tok.pad_token_id)
    hf = AutoModelForSequenceClassification.from_config(config).eval()
    hf.save_pretrained(tmp_path / "rm")
    rm_tok.save_pretrained(tmp_path / "rm")
    (tmp_path / "rm" / "reward_stats.json").write_text(json.dumps({"mean": 0.5, "std": 2.0}))

    prompts = ["What is 2 + 3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
               "What is 11 + 11?"]
    responses = [policy_tok.decode(policy_tok(r).input_ids) for r in ["5", "hello world", "The answer is 22"]]
    assert policy_tok(responses[2]).input_ids != rm_tok(responses[2]).input_ids
    by_hand = []
    for p, r in zip(prompts, responses):
        messages = ([{"role": "user", "content": p}] if isinstance(p, str) else p) + [{"role": "assistant", "content": r}]
        ids = rm_tok(rm_tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
        with torch.no_grad():
            by_hand.append(hf.score(hf.model(torch.tensor([ids])).last_hidden_state[0, -1]).item())
    by_hand = torch.tensor(by_hand)

    scorer = RewardModelScorer(str(tmp_path / "rm"), micro_batch_size=2)
    assert torch.allclose(scorer.score(prompts, responses), by_hand, atol=1e-5)
    assert scorer.score([], []).shape == (0,)
    normed = RewardModelScorer(str(tmp_path / "rm"), 2, normalize=True, clip=0.01).score(prompts, responses)
    assert torch.allclose(normed, ((by_hand - 0.5) / 2.0).clamp(-0.01, 0.01), atol=1e-6)
    assert render("", "Human: hi\n\nAssistant: yo", rm_tok) == "Human: hi\n\nAssistant: yo"


def test_bad_input_fails_with_a_sentence(workdir, tmp_path):
    """A missing `rejected` column ends reward_model.py with one line naming the file and the column, not a
    traceback; an empty file names itself; identical and over-long pairs are counted, not fatal."""
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "chosen": "a"}]), str(tmp_path / "bad.parquet"))
    proc = run_rm(workdir, tmp_path / "out", f"reward_model.train_files={tmp_path}/bad.parquet", expect_ok=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"{tmp_path}/bad.parquet: missing column `rejected`" in proc.stderr

    tok = make_tokenizer()
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "chosen": pa.array([], pa.string()),
                             "rejected": pa.array([], pa.string())}), str(tmp_path / "empty.parquet"))
    with pytest.raises(data.DataError, match="empty.parquet: the file has 0 rows"):
        load_pairs(str(tmp_path / "empty.parquet"), tok, 64, "drop", True)

    rows = [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "2", "margin": 1.0},
            {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3", "margin": 1.0},
            {"prompt": "What is 1 + 1? " * 20, "chosen": "2", "rejected": "3", "margin": 1.0}]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "mixed.parquet"))
    pairs, stats = load_pairs(str(tmp_path / "mixed.parquet"), tok, 64, "drop", True)
    assert stats == {"rows": 3, "kept": 2, "identical_dropped": 1, "truncated": 0, "overlong_dropped": 1, "used": 1}
    assert pairs[0][2] == 1.0
    pairs, stats = load_pairs(str(tmp_path / "mixed.parquet"), tok, 64, "truncate", False)
    assert stats["truncated"] == 1 and len(pairs[1][0]) == 64 and pairs[1][2] == 0.0
    assert pairs[1][0][-3:] == pairs[0][0][-3:]  # truncation keeps the end, where the reward is read


def test_demo_pairs_teach_the_rule():
    """Every demo pair (tools/prepare_data.py --task arithmetic-preferences) has a chosen answer the `arithmetic` rule scores 1
    and a rejected one it scores 0; in tens, ones and bare pairs both answers have the same form and length, so
    only the sum separates them; every kind is there in about its share."""
    from reward_rules.library import arithmetic_score
    rows = data.make_arithmetic_preferences(2000, seed=0)
    counts = {}
    for row in rows:
        truth = str(sum(int(x) for x in row["prompt"][-1]["content"].split(" + ")))  # the question "a + b"
        assert arithmetic_score(row["chosen"], truth) == 1.0 and arithmetic_score(row["rejected"], truth) == 0.0, row
        if row["kind"] != "format":
            assert len(row["chosen"]) == len(row["rejected"]) and row["chosen"].count("=") == row["rejected"].count("=")
        counts[row["kind"]] = counts.get(row["kind"], 0) + 1
    for kind, share in data.PREFERENCE_KINDS.items():
        assert abs(counts[kind] / len(rows) - share) < 0.03, (kind, counts)


def test_validation_accuracy_per_kind(workdir, tmp_path):
    """Pairs with a `kind` column get val/rm/accuracy/<kind> beside val/rm/accuracy, and the per-kind
    accuracies, weighted by their pair counts, add up to the overall one."""
    rows = pq.read_table(str(workdir / "val.parquet")).to_pylist()
    kinds = ["even" if i % 2 == 0 else "odd" for i in range(len(rows))]
    pq.write_table(pa.Table.from_pylist([{**r, "kind": k} for r, k in zip(rows, kinds)]), str(tmp_path / "val.parquet"))
    out = tmp_path / "out"
    run_rm(workdir, out, f"reward_model.val_files={tmp_path}/val.parquet", "reward_model.total_steps=2",
           "reward_model.eval_freq=1", "reward_model.save_freq=0")
    for line in read_metrics(out):
        by_kind = [line[f"val/rm/accuracy/{k}"] * kinds.count(k) for k in ("even", "odd")]
        assert sum(by_kind) / len(rows) == pytest.approx(line["val/rm/accuracy"], abs=1e-9)


def test_shared_prefix_forward_equals_one_plain_forward(tmp_path):
    """Conversations that open alike (right-padded, different lengths) get the same rewards, and the same
    gradients, whether their common prefix runs once and is cached or every row runs whole."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification
    from scorers.model import shared_prefix_length
    tok = make_tokenizer()
    hf = AutoModelForSequenceClassification.from_pretrained(make_tiny_model(tmp_path / "m"), num_labels=1,
                                                            pad_token_id=tok.pad_token_id)
    hf = get_peft_model(hf, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    for p in hf.parameters():  # LoRA B starts at 0: give it values so gradients reach A too
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    model = RewardModel(hf)
    seqs = [tok(f"What is 2 + 3? Reply with only the number. {x}").input_ids for x in ("5", "6 good", "55")]
    T = max(map(len, seqs))
    input_ids = torch.tensor([s + [tok.pad_token_id] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    assert shared_prefix_length(input_ids, mask) > 5  # the question is shared, so the cached path is taken
    cached = model(input_ids, mask)
    grads = torch.autograd.grad(cached.sum(), [p for p in hf.parameters() if p.requires_grad])
    base = hf.get_base_model()
    hidden = base.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    plain = base.score(hidden[torch.arange(3), last_token_index(mask)]).squeeze(-1)
    plain_grads = torch.autograd.grad(plain.sum(), [p for p in hf.parameters() if p.requires_grad])
    assert torch.allclose(cached, plain, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, plain_grads))
