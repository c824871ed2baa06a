"""data.py: parquet layouts, prompt rendering, truncation, errors and the demo generators; tools/prepare_data.py, the CLI."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = ("<s>{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer(chat_template=TEMPLATE):
    """A word-level tokenizer that, like Llama's, adds <s> to raw text; its template writes <s> itself."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = "what is 1 2 3 4 5 6 7 8 9 + ? reply with only the number hello be brief".split()
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="</s>", additional_special_tokens=specials[3:])
    tok.chat_template = chat_template
    return tok


def write(tmp_path, name, rows):
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


OURS = [{"prompt": "What is 1 + 2 ?", "ground_truth": "3", "data_source": "arithmetic", "extra_info": {"index": 0}},
        {"prompt": "What is 4 + 5 ?", "ground_truth": "9", "data_source": "arithmetic", "extra_info": {"index": 1}}]
VERL = [{"data_source": r["data_source"], "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]}, "extra_info": r["extra_info"]}
        for r in OURS]


# ---- load_rl_dataset


def test_ours_and_verl_layouts_load_the_same_rows(tmp_path):
    """A string prompt with ground_truth and verl's messages with reward_model.ground_truth give equal rows
    (but for `prompt` and `columns`, which are kept as stored)."""
    tok = tiny_tokenizer()
    ours, stats = data.load_rl_dataset(write(tmp_path, "ours.parquet", OURS), tok, 64, "error")
    verl, _ = data.load_rl_dataset(write(tmp_path, "verl.parquet", VERL), tok, 64, "error")
    drop = lambda rows: [{k: v for k, v in r.items() if k not in ("prompt", "columns")} for r in rows]
    assert drop(ours) == drop(verl) and ours[0]["prompt"] == OURS[0]["prompt"] and verl[0]["prompt"] == VERL[0]["prompt"]
    assert [r["ground_truth"] for r in ours] == ["3", "9"] and ours[0]["extra_info"] == {"index": 0}
    assert stats == {"rows": 2, "kept": 2, "truncated": 0, "filtered": 0}
    assert [r["columns"] for r in ours] == OURS and [r["columns"] for r in verl] == VERL  # every column, as stored


def test_chat_template_is_applied_once_without_a_double_bos(tmp_path):
    """The rendered prompt is the template's text; its ids start with one <s> (the template's), not two."""
    rows, _ = data.load_rl_dataset(write(tmp_path, "d.parquet", OURS), tiny_tokenizer(), 64, "error")
    assert rows[0]["prompt_text"] == "<s><|user|> What is 1 + 2 ? <|assistant|>"
    ids = rows[0]["prompt_ids"]
    assert ids[0] == 0 and ids[1] != 0 and ids.count(0) == 1


def test_without_a_template_a_string_prompt_is_raw_text_with_the_tokenizers_bos(tmp_path):
    """No chat_template: the prompt text is used as is and tokenized with the tokenizer's own BOS."""
    tok = tiny_tokenizer(chat_template=None)
    rows, _ = data.load_rl_dataset(write(tmp_path, "d.parquet", OURS), tok, 64, "error")
    assert rows[0]["prompt_text"] == "What is 1 + 2 ?"
    assert rows[0]["prompt_ids"] == tok("What is 1 + 2 ?")["input_ids"] and rows[0]["prompt_ids"][0] == 0


def test_defaults_and_numeric_ground_truth(tmp_path):
    """Without data_source/extra_info the row gets "unknown"/{}; a numeric ground_truth becomes a string."""
    path = write(tmp_path, "d.parquet", [{"prompt": "hello", "ground_truth": 72}, {"prompt": "hello", "ground_truth": None}])
    rows, _ = data.load_rl_dataset(path, tiny_tokenizer(), 64, "error")
    assert [(r["ground_truth"], r["data_source"], r["extra_info"]) for r in rows] == [("72", "unknown", {}), (None, "unknown", {})]



def test_a_nan_ground_truth_is_missing_never_the_text_nan():
    """NaN (how pandas writes a missing number) reads as None, not "nan" (which a rule could match); a rule that
    compares with the ground truth refuses null, NaN, empty and "nan" rows, naming the row and the rule; without
    such a rule (rule_of gives None: a custom function, a reward model) the row is kept."""
    assert data.ground_truth_of({"ground_truth": float("nan")}) is None
    assert data.ground_truth_of({"reward_model": {"ground_truth": 3.0}}) == "3"
    rule_of = {"math": "verl_rules.dapo"}.get
    for truth, reads in ((None, "null"), (float("nan"), "NaN"), ("  ", "empty"), ([], "empty"),
                         ("-NaN", "the text '-NaN' (a missing number written out)")):
        with pytest.raises(data.DataError) as e:
            data.check_ground_truth({"ground_truth": truth, "data_source": "math"}, "f.parquet row 3: ", rule_of)
        assert str(e.value) == (f"f.parquet row 3: the ground truth is {reads}, but data_source 'math' is scored by "
                                f"verl_rules.dapo, which compares each response with it; fill it in or drop the row")
    data.check_ground_truth({"ground_truth": None, "data_source": "other"}, "", rule_of)
    data.check_ground_truth({"ground_truth": "7", "data_source": "math"}, "", rule_of)


LONG = [{"prompt": "hello"}, {"prompt": " ".join(["hello"] * 20)}, {"prompt": "be brief"}]


def test_truncation_error_names_file_row_length_and_fix(tmp_path):
    """truncation=error: the message names the file, the row, its length and the two settings that fix it."""
    path = write(tmp_path, "long.parquet", LONG)
    with pytest.raises(data.DataError) as e:
        data.load_rl_dataset(path, tiny_tokenizer(), 10, "error")
    msg = str(e.value)
    assert path in msg and "row 1" in msg and "23 tokens" in msg  # <s> <|user|> 20×hello <|assistant|>
    assert "data.max_prompt_length" in msg and "data.truncation=left" in msg and "data.truncation=filter" in msg


def test_truncation_left_keeps_the_last_tokens_and_counts(tmp_path):
    """truncation=left keeps the last max_prompt_length tokens (the generation prompt survives) and counts the row."""
    tok = tiny_tokenizer()
    rows, stats = data.load_rl_dataset(write(tmp_path, "long.parquet", LONG), tok, 10, "left")
    full = tok(data.render_prompt(LONG[1]["prompt"], tok), add_special_tokens=False)["input_ids"]
    assert rows[1]["prompt_ids"] == full[-10:] and rows[1]["prompt_text"].endswith("<|assistant|>")
    assert stats == {"rows": 3, "kept": 3, "truncated": 1, "filtered": 0}


def test_truncation_filter_drops_and_counts(tmp_path):
    """truncation=filter drops over-long rows and counts them; nothing left is an error."""
    rows, stats = data.load_rl_dataset(write(tmp_path, "long.parquet", LONG), tiny_tokenizer(), 10, "filter")
    assert len(rows) == 2 and stats == {"rows": 3, "kept": 2, "truncated": 0, "filtered": 1}
    with pytest.raises(data.DataError, match="filtered; raise data.max_prompt_length"):
        data.load_rl_dataset(write(tmp_path, "long.parquet", LONG), tiny_tokenizer(), 2, "filter")


def test_error_missing_file(tmp_path):
    """A missing file is named, with the command that writes the demo data."""
    with pytest.raises(data.DataError, match=r"data file .*nope.parquet does not exist.*python tools/prepare_data.py --task"):
        data.load_rl_dataset(str(tmp_path / "nope.parquet"), tiny_tokenizer(), 64, "error")


def test_error_missing_prompt_column_lists_the_columns(tmp_path):
    """Without `prompt` the message lists the columns the file has."""
    path = write(tmp_path, "d.parquet", [{"question": "hi", "answer": "1"}])
    with pytest.raises(data.DataError, match=r"missing column `prompt`; found columns \['question', 'answer'\]"):
        data.load_rl_dataset(path, tiny_tokenizer(), 64, "error")


def test_error_empty_file(tmp_path):
    """A file with 0 rows is an error naming the file."""
    path = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(data.DataError, match=r"empty.parquet: the file has 0 rows"):
        data.load_rl_dataset(path, tiny_tokenizer(), 64, "error")


def test_error_prompt_neither_text_nor_messages_names_the_row(tmp_path):
    """A prompt that is a number or a list of dicts without role/content names its row."""
    with pytest.raises(data.DataError, match=r"row 0: `prompt` must be a string or a list of \{role, content\} messages, got int"):
        data.load_rl_dataset(write(tmp_path, "a.parquet", [{"prompt": 1}, {"prompt": 7}]), tiny_tokenizer(), 64, "error")
    bad = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"text": "hi"}]}]
    with pytest.raises(data.DataError, match=r"row 1: `prompt` must be"):
        data.load_rl_dataset(write(tmp_path, "b.parquet", bad), tiny_tokenizer(), 64, "error")


def test_error_truncation_value():
    """An unknown truncation mode is refused before reading anything."""
    with pytest.raises(data.DataError, match="data.truncation must be error, left or filter"):
        data.load_rl_dataset("x.parquet", None, 64, "right")


# ---- load_preferences


def test_preferences_drop_identical_pairs_and_default_margin(tmp_path):
    """Pairs with chosen == rejected are dropped and counted; margin defaults to 0.0."""
    path = write(tmp_path, "p.parquet", [{"prompt": "q", "chosen": "3", "rejected": "4", "margin": 1.5},
                                         {"prompt": "q", "chosen": "3", "rejected": "3", "margin": None},
                                         {"prompt": "", "chosen": "a", "rejected": "b", "margin": None}])
    rows, stats = data.load_preferences(path)
    assert rows == [{"prompt": "q", "chosen": "3", "rejected": "4", "margin": 1.5},
                    {"prompt": "", "chosen": "a", "rejected": "b", "margin": 0.0}]
    assert stats == {"rows": 3, "kept": 2, "identical_dropped": 1}


def test_preferences_errors(tmp_path):
    """Missing file, a missing column (named), and an empty file each raise a sentence saying so."""
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_preferences(str(tmp_path / "nope.parquet"))
    with pytest.raises(data.DataError, match="missing column `rejected`"):
        data.load_preferences(write(tmp_path, "a.parquet", [{"prompt": "q", "chosen": "3"}]))
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({k: pa.array([], pa.string()) for k in ("prompt", "chosen", "rejected")}), empty)
    with pytest.raises(data.DataError, match="0 rows"):
        data.load_preferences(empty)


# ---- writing and the generators


def test_write_parquet_is_atomic_and_round_trips(tmp_path):
    """write_parquet leaves only the final file (no temporary) and reads back the same rows."""
    path = str(tmp_path / "sub" / "x.parquet")
    data.write_parquet(OURS, path)
    assert os.listdir(tmp_path / "sub") == ["x.parquet"] and pq.read_table(path).to_pylist() == OURS


def test_write_parquet_keeps_keys_that_only_later_rows_have(tmp_path):
    """A key absent from the first row is still written (null where missing), never silently dropped."""
    path = str(tmp_path / "x.parquet")
    data.write_parquet([{"prompt": "a"}, {"prompt": "b", "margin": 1.0}], path)
    assert pq.read_table(path).to_pylist() == [{"prompt": "a", "margin": None}, {"prompt": "b", "margin": 1.0}]


def test_split_rows_is_seeded_and_holds_out_the_fraction():
    """split_rows holds out round(n·f) rows, partitions the input, and is reproducible with its seed."""
    rows = [{"i": i} for i in range(100)]
    train, val = data.split_rows(rows, 0.05, seed=0)
    assert len(val) == 5 and sorted(r["i"] for r in train + val) == list(range(100))
    assert (train, val) == data.split_rows(rows, 0.05, seed=0) != data.split_rows(rows, 0.05, seed=1)


def test_generators_are_deterministic_and_correct():
    """Same seed, same rows; ground truths are the sums; chosen is right and rejected is not what the rule scores 1."""
    from reward_rules.library import arithmetic_score

    assert data.make_arithmetic(50, 3) == data.make_arithmetic(50, 3) != data.make_arithmetic(50, 4)
    for r in data.make_arithmetic(200, 0):
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert r["ground_truth"] == str(a + b) and r["prompt"] == data.arithmetic_prompt(a, b)
        assert r["data_source"] == "arithmetic" and sorted([a // 10, b // 10]) == [0, 1]  # one-digit and 10–19
    prefs = data.make_arithmetic_preferences(200, 0)
    assert prefs == data.make_arithmetic_preferences(200, 0)
    gts = [r["ground_truth"] for r in data.make_arithmetic(200, 0)]
    assert [p["prompt"] for p in prefs] == [r["prompt"] for r in data.make_arithmetic(200, 0)]  # same questions, order
    assert all(arithmetic_score(p["chosen"], g) == 1.0 and arithmetic_score(p["rejected"], g) == 0.0
               for p, g in zip(prefs, gts))


# ---- the CLI


def run_cli(*args):
    return subprocess.run([sys.executable, "tools/prepare_data.py", *args], cwd=REPO, capture_output=True, text=True)


def write_jsonl(tmp_path, rows):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def convert(tmp_path, rows, val_fraction="0.25"):
    out = tmp_path / "out"
    proc = run_cli("--input", write_jsonl(tmp_path, rows), "--output", str(out), "--val-fraction", val_fraction)
    assert proc.returncode == 0, proc.stderr
    return proc, pq.read_table(out / "train.parquet").to_pylist() + pq.read_table(out / "val.parquet").to_pylist()


def test_cli_task_arithmetic_writes_train_and_val(tmp_path):
    """--task arithmetic writes train/val with the asked sizes and prints the paths and counts."""
    out = tmp_path / "arith"
    proc = run_cli("--task", "arithmetic", "--output", str(out), "--train-size", "30", "--val-size", "6")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}/train.parquet (30 rows)" in proc.stdout and f"wrote {out}/val.parquet (6 rows)" in proc.stdout
    assert pq.read_table(out / "train.parquet").to_pylist() == data.make_arithmetic(36, 0)[:30]
    rows, _ = data.load_rl_dataset(str(out / "val.parquet"), tiny_tokenizer(), 128, "error")
    assert rows[0]["prompt_text"].startswith("<s><|system|> Add the numbers. <|user|> 6 + 7 <|assistant|> 6 + 7 = 13 ")


def test_cli_task_arithmetic_preferences(tmp_path):
    """--task arithmetic-preferences writes a preference parquet that load_preferences accepts."""
    out = tmp_path / "prefs"
    assert run_cli("--task", "arithmetic-preferences", "--output", str(out), "--train-size", "20").returncode == 0
    rows, stats = data.load_preferences(str(out / "train.parquet"))
    assert stats["rows"] == 20 and set(rows[0]) == {"prompt", "chosen", "rejected", "margin", "kind"}


def test_cli_converts_our_jsonl(tmp_path):
    """Our RL rows keep prompt and ground_truth (numbers as strings) and default data_source to unknown."""
    rows = [{"prompt": f"What is {i} + 1 ?", "ground_truth": i + 1} for i in range(8)]
    _, out = convert(tmp_path, rows)
    assert sorted((r["prompt"], r["ground_truth"], r["data_source"]) for r in out) == \
        sorted((r["prompt"], str(r["ground_truth"]), "unknown") for r in rows)


def test_cli_converts_gsm8k_as_verl_does(tmp_path):
    """GSM8K: prompt = question + verl's instruction, ground_truth = the number after #### without commas."""
    rows = [{"question": f"Q{i}?", "answer": f"work\n#### 1,00{i}"} for i in range(4)]
    proc, out = convert(tmp_path, rows)
    row = next(r for r in out if r["extra_info"]["question"] == "Q2?")
    assert row["prompt"] == 'Q2? Let\'s think step by step and output the final answer after "####".'
    assert row["ground_truth"] == "1002" and row["data_source"] == "openai/gsm8k"
    assert "(3 rows)" in proc.stdout and "(1 rows)" in proc.stdout


def test_cli_converts_preferences(tmp_path):
    """prompt/chosen/rejected rows become a preference parquet unchanged."""
    rows = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(4)]
    _, out = convert(tmp_path, rows)
    assert sorted(r["prompt"] for r in out) == ["q0", "q1", "q2", "q3"] and {r["chosen"] for r in out} == {"good"}


def test_cli_splits_hh_rlhf_at_the_last_assistant_turn(tmp_path):
    """HH-RLHF: the shared text through the last "\\n\\nAssistant:" is the prompt; prompt + chosen is the original."""
    prefix = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: add 2 and 2\n\nAssistant:"
    rows = [{"chosen": prefix + " 4", "rejected": prefix + " 5 I think"}] * 4
    _, out = convert(tmp_path, rows)
    assert out[0] == {"prompt": prefix, "chosen": " 4", "rejected": " 5 I think"}


def test_cli_bad_rows_fail_with_the_line_number(tmp_path):
    """A GSM8K answer without ####, a row of another kind, or invalid JSON fails naming its line."""
    good = {"question": "q", "answer": "#### 1"}
    for bad, reason in ([{"question": "q", "answer": "no marker"}, "no \"#### <number>\""],
                        [{"prompt": "x"}, "the file's first row is gsm8k"]):
        proc = run_cli("--input", write_jsonl(tmp_path, [good, bad]), "--output", str(tmp_path / "o"))
        assert proc.returncode != 0 and "line 2:" in proc.stderr and reason in proc.stderr
    (tmp_path / "in.jsonl").write_text(json.dumps(good) + "\n{oops\n")
    proc = run_cli("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"))
    assert proc.returncode != 0 and "in.jsonl line 2:" in proc.stderr


def test_cli_output_must_be_a_folder(tmp_path):
    """--output names a folder; a .parquet path is refused with the reason."""
    proc = run_cli("--task", "arithmetic", "--output", str(tmp_path / "train.parquet"))
    assert proc.returncode != 0 and "--output is a folder" in proc.stderr


# ---- inputs that must fail in one sentence naming the file and row (issue 12)


def write_invalid_utf8(path):
    """A parquet whose string column `prompt` holds the bytes ff fe, which are not UTF-8 (arrow writes them as given)."""
    offsets = pa.py_buffer(b"\x00\x00\x00\x00\x02\x00\x00\x00\x04\x00\x00\x00")  # rows "hi" and ff fe
    pq.write_table(pa.table({"prompt": pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"hi\xff\xfe")])}),
                   str(path))
    return str(path)


def test_a_directory_given_as_a_data_file_is_named_as_one(tmp_path):
    """A folder where a parquet file belongs says "is a directory" (not "does not exist") and names the file to give."""
    with pytest.raises(data.DataError, match=rf"data file {tmp_path} is a directory; name the parquet file inside it"):
        data.load_rl_dataset(str(tmp_path), tiny_tokenizer(), 64, "error")
    with pytest.raises(data.DataError, match="is a directory"):
        data.load_preferences(str(tmp_path))


def test_invalid_utf8_in_a_string_column(tmp_path):
    """Text that is not UTF-8 fails naming the file (and arrow's column/position), not as a UnicodeDecodeError."""
    path = write_invalid_utf8(tmp_path / "bad.parquet")
    with pytest.raises(data.DataError, match=r"bad.parquet holds text that is not valid UTF-8 \(.*\); re-encode it"):
        data.load_rl_dataset(path, tiny_tokenizer(), 64, "error")


def test_a_prompt_of_zero_tokens_names_its_row(tmp_path):
    """Without a chat template or BOS an empty prompt is 0 tokens, which nothing can be generated from."""
    tok = tiny_tokenizer(chat_template=None)
    tok._tokenizer.post_processor = None  # no <s> either
    path = write(tmp_path, "d.parquet", [{"prompt": "hello"}, {"prompt": ""}])
    with pytest.raises(data.DataError, match=r"d.parquet row 1: the prompt is 0 tokens once rendered"):
        data.load_rl_dataset(path, tok, 64, "error")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "", "rejected": "4"}, "row 1: `chosen` and `rejected` must not be empty"),
    ({"prompt": "q", "chosen": "3", "rejected": "  "}, "row 1: `chosen` and `rejected` must not be empty"),
    ({"prompt": "q", "chosen": "3", "rejected": "4", "margin": "high"}, "row 1: `margin` must be a finite number or null"),
    ({"prompt": "q", "chosen": "3", "rejected": "4", "margin": float("inf")}, "`margin` must be a finite number or null, got inf"),
    ({"prompt": "q", "chosen": "3", "rejected": "4", "margin": float("nan")}, "`margin` must be a finite number or null, got nan"),
])
def test_bad_preference_pairs_name_their_row(tmp_path, row, message):
    """An empty chosen/rejected teaches nothing; a margin that is text, inf or NaN would make the loss non-finite."""
    first = {"prompt": "q", "chosen": "3", "rejected": "4", **({"margin": None} if "margin" in row else {})}
    path = write(tmp_path, "p.parquet", [first, row])
    with pytest.raises(data.DataError) as e:
        data.load_preferences(path)
    assert message in str(e.value) and "p.parquet" in str(e.value)
