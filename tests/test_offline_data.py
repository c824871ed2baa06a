"""The preference layouts every stage reads (ours, TRL's standard, conversational and implicit prompt, HH-RLHF), from
parquet, jsonl or a datasets save_to_disk folder, and bad input answered in one sentence before any model loads."""
import json
import os
import subprocess
import sys

import pytest

from conftest import make_tiny_model, REPO

import data

Q = [{"role": "user", "content": "What is 2 + 3?"}]
LAYOUTS = {  # one pair, "5" over "6", as each layout writes it
    "ours": {"prompt": Q, "chosen": "5", "rejected": "6"},
    "standard": {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
    "conversational": {"prompt": Q, "chosen": [{"role": "assistant", "content": "5"}],
                       "rejected": [{"role": "assistant", "content": "6"}]},
    "implicit": {"chosen": Q + [{"role": "assistant", "content": "5"}],
                 "rejected": Q + [{"role": "assistant", "content": "6"}]},
    "hh-rlhf": {"chosen": "\n\nHuman: What is 2 + 3?\n\nAssistant: 5", "rejected": "\n\nHuman: What is 2 + 3?\n\nAssistant: 6"},
}


def write(rows, path: str) -> str:
    """rows as parquet, jsonl, or a datasets save_to_disk folder, by the path's form."""
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif path.endswith(".parquet"):
        data.write_parquet(rows, path)
    else:
        import datasets
        datasets.Dataset.from_list(rows).save_to_disk(path)
    return path


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("form", ["train.parquet", "train.jsonl", "saved"])
def test_every_layout_reads_as_the_same_pair(tmp_path, layout, form):
    """Each layout, in each file form, reads as the one pair ("5" over "6") to the one question: a text prompt as
    text, every chat form as the same user message."""
    rows, stats = data.load_preferences(write([LAYOUTS[layout]] * 3, str(tmp_path / form)))
    assert stats == {"rows": 3, "kept": 3, "identical_dropped": 0}
    assert {k: rows[0][k] for k in ("prompt", "chosen", "rejected")} == {
        "prompt": "What is 2 + 3?" if layout == "standard" else Q, "chosen": "5", "rejected": "6"}


def test_hh_multi_turn_keeps_the_shared_conversation_as_prompt():
    """An HH-RLHF pair whose conversations share two turns: those turns are the prompt, the differing last turn each
    side's answer."""
    opening = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2 + 2?\n\nAssistant: "
    pair = data.preference_row({"chosen": opening + "4", "rejected": opening + "5"}, "x: ")
    assert pair == {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                               {"role": "user", "content": "2 + 2?"}], "chosen": "4", "rejected": "5"}


@pytest.fixture(scope="module")
def stage_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline_data")
    make_tiny_model(root / "model")
    write([LAYOUTS["hh-rlhf"], {**LAYOUTS["hh-rlhf"], "rejected": LAYOUTS["hh-rlhf"]["rejected"][:-1] + "7"}] * 4,
          str(root / "hh.jsonl"))
    write([LAYOUTS["implicit"]] * 8, str(root / "saved"))
    write(data.make_arithmetic(4, seed=0), str(root / "prompts.parquet"))
    return root


def check(script, section, root, *overrides):
    cmd = [sys.executable, script, "--check", "--config", "configs.yaml", f"{section}.model_path={root}/model",
           f"{section}.batch_size=4", f"{section}.micro_batch_size_per_device=4", *overrides]
    if script != "reward_model.py":
        cmd.append(f"{section}.val_prompts={root}/prompts.parquet")
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script, section", [("reward_model.py", "reward_model"), ("sft.py", "sft"), ("dpo.py", "dpo")])
def test_every_stage_reads_hh_jsonl_and_a_saved_dataset(stage_files, script, section):
    """reward_model.py, sft.py and dpo.py --check accept HH-RLHF jsonl for training and a save_to_disk folder of
    implicit-prompt pairs for validation (the same reader, data.load_preferences)."""
    proc = check(script, section, stage_files, f"{section}.train_files={stage_files}/hh.jsonl",
                 f"{section}.val_files={stage_files}/saved")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no model loaded" in proc.stdout and "'kept': 8" in proc.stdout


@pytest.mark.parametrize("case", ["identical", "missing column", "not a causal LM", "DatasetDict", "no prompt"])
def test_bad_input_is_one_sentence_before_any_model(stage_files, tmp_path, case):
    """Each of these ends dpo.py --check (no model is loaded) with one line naming the file or key and the fix."""
    root, extra = stage_files, []
    if case == "identical":
        train, expected = write([LAYOUTS["ours"] | {"rejected": "5"}] * 4, str(tmp_path / "same.parquet")), \
            "all 4 pairs have chosen == rejected"
    elif case == "missing column":
        train, expected = write([{"prompt": "q", "chosen": "a"}] * 4, str(tmp_path / "m.jsonl")), \
            "m.jsonl: missing column `rejected`"
    elif case == "not a causal LM":
        from transformers import AutoModelForSequenceClassification
        AutoModelForSequenceClassification.from_pretrained(root / "model", num_labels=1).save_pretrained(tmp_path / "rm")
        train, expected = str(root / "hh.jsonl"), "holds a LlamaForSequenceClassification, not a causal language model"
        extra = [f"dpo.model_path={tmp_path}/rm", f"dpo.tokenizer_path={root}/model"]
    elif case == "DatasetDict":
        import datasets
        datasets.DatasetDict({"train": datasets.Dataset.from_list([LAYOUTS["ours"]])}).save_to_disk(tmp_path / "dd")
        train, expected = str(tmp_path / "dd"), f"is a datasets DatasetDict; name one split's folder, e.g. {tmp_path}/dd/train"
    else:
        train, expected = write([{"chosen": "a", "rejected": "b"}] * 4, str(tmp_path / "np.parquet")), \
            "np.parquet row 0: there is no `prompt` column"
    proc = check("dpo.py", "dpo", root, f"dpo.train_files={train}", "dpo.val_files=null", *extra)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_overlong_rows_are_counted_and_truncated_or_dropped(stage_files):
    """A prompt longer than max_length: truncate keeps its last tokens (the response whole), drop drops the row;
    both are counted in the stats the stage prints."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(stage_files / "model")
    rows = [{"prompt": "What is 2 + 3? " * 30, "chosen": "5", "rejected": "6"}, LAYOUTS["standard"]]
    kept, stats = data.tokenize_completions(rows, ("chosen", "rejected"), tok, 48, "truncate", "f")
    assert stats == {"rows": 2, "truncated": 1, "overlong_dropped": 0, "used": 2}
    assert len(kept[0][0]) + max(map(len, kept[0][1])) == 48 and kept[0][1] == kept[1][1]
    kept, stats = data.tokenize_completions(rows, ("chosen", "rejected"), tok, 48, "drop", "f")
    assert stats["overlong_dropped"] == 1 and len(kept) == 1
