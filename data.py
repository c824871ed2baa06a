"""Datasets as parquet files: reading RL prompts (ours and verl's layout) and preference pairs, with every check a row
needs before training; writing them; and the embedded demos' rows. tools/prepare_data.py is the command that writes
them (the demos, or a jsonl file converted):

    python tools/prepare_data.py --task arithmetic --output data/arithmetic     # the PPO demo

RL parquet layouts read by `load_rl_dataset`: ours (prompt as a string or chat messages, optional ground_truth,
data_source, extra_info), or verl's unchanged (prompt as chat messages, reward_model.ground_truth, data_source,
extra_info, ability).

The demo asks "a + b" (one operand from 10 to 19, the other one-digit) in a one-shot chat, and the
`arithmetic` reward (reward_rules/library.py) wants "a + b = c" or the bare sum. SmolLM2-135M-Instruct gets about half
of these sums wrong ("15 + 2 = 27"): room to learn one rule, the tens digit.
"""
import math
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from infra.tables import check_prompt, DataError, load_preferences, preference_row, read_parquet  # noqa: F401 (data.X)

# The demo prompt is a one-shot chat. Asked plainly ("What is 6 + 6?"), SmolLM2-135M-Instruct answers in
# sentences; shown "2 + 3" → "5" it answers a bare number but is right only 0.2 of the time; shown the
# equation written out it is right on 0.95 of one-digit sums (measured on 100-200 prompts each).
ARITHMETIC_SYSTEM = "Add the numbers."
ARITHMETIC_SHOT = ("6 + 7", "6 + 7 = 13")


def raw_ground_truth(row: dict):
    """Ours: row["ground_truth"]; verl's: row["reward_model"]["ground_truth"]; as stored."""
    gt = row.get("ground_truth")
    if gt is None and isinstance(row.get("reward_model"), dict):
        gt = row["reward_model"].get("ground_truth")
    return gt


def ground_truth_of(row: dict):
    """The row's ground truth (raw_ground_truth). Numbers become strings; NaN and ±inf (NaN is how pandas writes a
    missing number) become None, never the text "nan"."""
    gt = raw_ground_truth(row)
    if isinstance(gt, float) and not math.isfinite(gt):
        return None
    if isinstance(gt, float) and gt.is_integer():
        gt = int(gt)  # a column with nulls is stored as float: 72.0 must still read "72"
    if isinstance(gt, (int, float)) and not isinstance(gt, bool):
        gt = str(gt)
    return gt


def missing_ground_truth(gt):
    """How a stored ground truth that no rule can compare with reads ("null", "NaN", "empty", "the text 'nan' …"),
    or None when it is usable."""
    if gt is None:
        return "null"
    if isinstance(gt, float) and not math.isfinite(gt):
        return str(gt).replace("nan", "NaN")
    if (isinstance(gt, str) and not gt.strip()) or (isinstance(gt, (list, dict)) and not gt):
        return "empty"
    if isinstance(gt, str) and gt.strip().lstrip("+-").lower() == "nan":
        return f"the text {gt!r} (a missing number written out)"
    return None


def check_ground_truth(row: dict, where: str, rule_of, default_source: str = "unknown") -> None:
    """A row whose data_source (default_source where it has none) is scored by a rule that compares with the ground
    truth (rule_of(data_source): the rule's name, or None) must have one; else a DataError naming the row and the
    rule."""
    rule = rule_of(row.get("data_source") or default_source) if rule_of else None
    problem = rule and missing_ground_truth(raw_ground_truth(row))
    if problem:
        raise DataError(f"{where}the ground truth is {problem}, but data_source {row.get('data_source')!r} is scored "
                        f"by {rule}, which compares each response with it; fill it in or drop the row")


def render_prompt(prompt, tokenizer) -> str:
    """Chat messages go through the chat template; a string is one user message when there is a template."""
    if isinstance(prompt, str):
        if tokenizer.chat_template is None:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def tokenize_prompts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of rendered prompts, with exactly the special tokens the template wrote (raw text gets the
    tokenizer's usual ones). A doubled leading BOS (text that began with the BOS string) is collapsed to one:
    it is never what the model saw in training."""
    templated = tokenizer.chat_template is not None
    ids = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
    bos = tokenizer.bos_token_id
    return [x[1:] if bos is not None and len(x) > 1 and x[0] == x[1] == bos else x for x in ids]


def load_rl_dataset(path: str, tokenizer, max_prompt_length: int, truncation: str,
                    rule_of=None, default_source: str = "unknown") -> tuple[list[dict], dict]:
    """Read RL prompts (ours or verl's layout) and tokenize them (prompt_rows); returns (rows, stats)."""
    if truncation not in ("error", "left", "filter"):
        raise DataError(f"data.truncation must be error, left or filter, got {truncation!r}")
    return prompt_rows(read_parquet(path, ["prompt"]).to_pylist(), path, tokenizer, max_prompt_length, truncation,
                       rule_of, default_source)


def prompt_rows(raw: list[dict], where: str, tokenizer, max_prompt_length: int, truncation: str,
                rule_of=None, default_source: str = "unknown") -> tuple[list[dict], dict]:
    """Stored rows (`where`: their file, for messages) checked and tokenized; returns (rows, stats). `rule_of(
    data_source)`: the name of the rule that will compare its responses with the ground truth, or None
    (check_ground_truth); default_source: the data_source of a row without one ("environment" where an environment
    scores the rows).

    rows: {"prompt_ids", "prompt_text", "ground_truth", "data_source", "extra_info", "prompt" (as stored, for a
    reward model that renders it with its own template), "columns" (every column of the stored row, as stored: what
    an environment's reset(**row) and a TRL-style reward function's keywords receive, apart from the library's own
    keys, so a user's column never collides with one of them)}; stats: {"rows", "kept", "truncated", "filtered"}.
    A prompt over max_prompt_length tokens: truncation="error" raises, "left" keeps its last tokens (prompt_text
    is then their decoding), "filter" drops the row.
    """
    texts = []
    for i, row in enumerate(raw):
        check_prompt(row["prompt"], f"{where} row {i}: ")
        check_ground_truth(row, f"{where} row {i}: ", rule_of, default_source)
        if not isinstance(row["prompt"], str) and tokenizer.chat_template is None:
            raise DataError(f"{where} row {i}: the prompt is a list of chat messages but the tokenizer has no "
                            f"chat_template; use a tokenizer with one (model.tokenizer_path) or store prompts as text")
        texts.append(render_prompt(row["prompt"], tokenizer))
    rows, truncated, filtered = [], 0, 0
    for i, (row, text, ids) in enumerate(zip(raw, texts, tokenize_prompts(texts, tokenizer))):
        if not ids:
            raise DataError(f"{where} row {i}: the prompt is 0 tokens once rendered; give it some text")
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise DataError(f"{where} row {i}: the prompt is {len(ids)} tokens, more than data.max_prompt_length="
                                f"{max_prompt_length}; raise data.max_prompt_length, or set data.truncation=left "
                                f"(keep the last tokens) or data.truncation=filter (drop such rows)")
            if truncation == "filter":
                filtered += 1
                continue
            ids, truncated = ids[-max_prompt_length:], truncated + 1
            text = tokenizer.decode(ids, skip_special_tokens=False)
        rows.append({"prompt_ids": ids, "prompt_text": text, "ground_truth": ground_truth_of(row),
                     "data_source": row.get("data_source") or default_source, "extra_info": row.get("extra_info") or {},
                     "prompt": row["prompt"], "columns": row})
    if not rows:
        raise DataError(f"{where}: all {len(raw)} prompts are longer than data.max_prompt_length={max_prompt_length} "
                        f"and were filtered; raise data.max_prompt_length")
    return rows, {"rows": len(raw), "kept": len(rows), "truncated": truncated, "filtered": filtered}


# data.curriculum: what makes the training rows as a run goes, instead of train_files (infra.config.load_target)
CURRICULUM = "agents.reasoning_gym:Curriculum"  # reasoning-gym's curricula


def load_prompts(cfg_data, tokenizer, print0, rule_of=None, default_source: str = "unknown") -> tuple[list, list]:
    """Training and validation prompts, tokenised once (load_rl_dataset), with their counts printed."""
    train_rows, stats = load_rl_dataset(cfg_data.train_files, tokenizer, cfg_data.max_prompt_length,
                                        cfg_data.truncation, rule_of, default_source)
    print0(f"train prompts: {stats}")
    val_rows = []
    if cfg_data.val_files:
        val_rows, stats = load_rl_dataset(cfg_data.val_files, tokenizer, cfg_data.max_prompt_length,
                                          cfg_data.truncation, rule_of, default_source)
        val_rows = val_rows[:cfg_data.val_max_samples or None]
        print0(f"val prompts: {stats}, using {len(val_rows)}")
    return train_rows, val_rows


def draw_prompts(state, train_rows: list, cfg, rank: int, count: int) -> list[dict]:
    """Step 1: the next global batch of the seeded data order (state's position moves on), this process's `count`."""
    inds = state.next_prompts(len(train_rows), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    return [train_rows[i] for i in inds[rank * count:(rank + 1) * count]]


# ---- writing
def render(prompt, response: str, tokenizer) -> str:
    """One conversation as text, the reward model's input in training and in PPO alike: the chat template over
    [prompt…, assistant: response]; a text prompt is one user turn, an empty one means the response is a whole
    conversation (HH-RLHF), and without a template the text is prompt + response."""
    if isinstance(prompt, str) and prompt == "":
        return response
    if tokenizer.chat_template is None:
        if not isinstance(prompt, str):
            raise DataError("the prompt is a list of chat messages but the reward model's tokenizer has no "
                                 "chat_template; use a tokenizer with one or store prompts as text")
        return prompt + response
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)


def load_pairs(path: str, tokenizer, max_length: int, overlong: str, use_margin: bool):
    """Preference pairs read, rendered and tokenised → [(chosen_ids, rejected_ids, margin, kind)] (margin 0 unless
    use_margin), and stats: how many pairs were identical (dropped), truncated, too long (dropped); reward_model.py's docstring, 3."""
    rows, stats = load_preferences(path)
    texts = [render(r["prompt"], r[k], tokenizer) for r in rows for k in ("chosen", "rejected")]
    ids = tokenize_prompts(texts, tokenizer)  # the template's special tokens, no extra BOS
    pairs, truncated, dropped = [], 0, 0
    for row, chosen, rejected in zip(rows, ids[0::2], ids[1::2]):
        if max(len(chosen), len(rejected)) > max_length:
            if overlong == "drop":
                dropped += 1
                continue
            chosen, rejected, truncated = chosen[-max_length:], rejected[-max_length:], truncated + 1
        pairs.append((chosen, rejected, row["margin"] if use_margin else 0.0, row.get("kind")))
    if not pairs:
        raise DataError(f"{path}: all {len(rows)} pairs are longer than reward_model.max_length={max_length}; "
                             f"raise it or set reward_model.overlong=truncate")
    return pairs, {**stats, "truncated": truncated, "overlong_dropped": dropped, "used": len(pairs)}


def tokenize_completions(rows: list[dict], sides: tuple, tokenizer, max_length: int, overlong: str, where: str):
    """sft.py's and dpo.py's rows → [(prompt_ids, [response_ids of each side])], and stats. The prompt is rendered
    with the generation prompt (render_prompt), each response as the rest of its whole conversation (render) after
    that text, tokenised alone, as TRL splits them: its ids end with what the template writes after an assistant
    turn (SmolLM2's <|im_end|>), so the model learns to stop. A row longer than max_length (prompt + its longest
    response): overlong=drop drops it, truncate keeps the prompt's last tokens (at least half of max_length when the
    response is longer) and the responses' first; both counted."""
    out, truncated, dropped = [], 0, 0
    prompts = [render_prompt(r["prompt"], tokenizer) for r in rows]
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        wholes = [render(row["prompt"], row[side], tokenizer) for side in sides]
        if not row["prompt"] or not all(w.startswith(prompt) for w in wholes):
            raise DataError(f"{where} row {i}: the conversation rendered by the chat template does not begin with its "
                            f"prompt rendered alone, so the response tokens cannot be told apart; give a non-empty "
                            f"prompt and a tokenizer whose template renders prompts as a prefix")
        responses = tokenizer([w[len(prompt):] for w in wholes], add_special_tokens=False)["input_ids"]
        prompt_ids = tokenize_prompts([prompt], tokenizer)[0]
        longest = max(len(r) for r in responses)
        if len(prompt_ids) + longest > max_length:
            if overlong == "drop":
                dropped += 1
                continue
            keep = max(max_length - longest, min(len(prompt_ids), max_length // 2))
            prompt_ids, truncated = prompt_ids[-keep:], truncated + 1
            responses = [r[:max_length - len(prompt_ids)] for r in responses]
        out.append((prompt_ids, responses))
    if not out:
        raise DataError(f"{where}: all {len(rows)} rows are longer than max_length={max_length} tokens; raise it or "
                        f"set overlong=truncate")
    return out, {"rows": len(rows), "truncated": truncated, "overlong_dropped": dropped, "used": len(out)}


def write_parquet(rows: list[dict], path: str) -> None:
    """Write rows to `path` atomically: a temporary name first, then os.replace. A key missing from some
    rows is null there (pa.Table.from_pylist alone would keep only the first row's keys)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = dict.fromkeys(k for row in rows for k in row)
    try:
        table = pa.Table.from_pylist([{k: row.get(k) for k in keys} for row in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"cannot write {path}: a column holds values of different types ({e})") from None
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def split_rows(rows: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle with `seed` and hold out round(n·val_fraction) rows (at least 1 when the fraction is > 0)."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_val = 0 if val_fraction == 0 else max(1, round(len(rows) * val_fraction))
    return rows[n_val:], rows[:n_val]


# ---- the embedded demo: a number from 10 to 19 plus a one-digit number
def arithmetic_question(rng: random.Random) -> tuple[int, int]:
    """Two operands, in either order: one from 10 to 19, one from 0 to 9."""
    a, b = rng.randint(10, 19), rng.randint(0, 9)
    return (a, b) if rng.random() < 0.5 else (b, a)


def arithmetic_prompt(a: int, b: int) -> list[dict]:
    """The chat asking for a + b: the system instruction, one worked example, the question."""
    return [{"role": "system", "content": ARITHMETIC_SYSTEM}, {"role": "user", "content": ARITHMETIC_SHOT[0]},
            {"role": "assistant", "content": ARITHMETIC_SHOT[1]}, {"role": "user", "content": f"{a} + {b}"}]


def make_arithmetic(n: int, seed: int, answers: bool = True) -> list[dict]:
    """n addition prompts in our RL layout; the strict `arithmetic` reward wants only the number. answers: each row's
    extra_info.answer is the answer written out as the worked example writes it ("6 + 7 = 13"), the reference text
    of val/perplexity (data.val_reference)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = arithmetic_question(rng)
        written = {"answer": f"{a} + {b} = {a + b}"} if answers else {}
        rows.append({"prompt": arithmetic_prompt(a, b), "ground_truth": str(a + b), "data_source": "arithmetic",
                     "extra_info": {"index": i, "a": a, "b": b, **written}})
    return rows


PREFERENCE_KINDS = {  # kind of pair → its share: each teaches one thing the `arithmetic` rule checks
    "tens": 0.4,     # "15 + 2 = 17" over "15 + 2 = 27": the tens digit (carry or not), the demo policy's mistake
    "ones": 0.2,     # over the sum off by 1 or 2
    "bare": 0.15,    # "17" over "27" or "18": the rule takes the bare number too, when it is right
    "format": 0.25,  # the clean equation over the right sum said another way, or more than once
}


def make_arithmetic_preferences(n: int, seed: int) -> list[dict]:
    """n pairs on the demo's questions, each of a `kind` (PREFERENCE_KINDS, logged per kind by reward_model.py):
    chosen scores 1 under the `arithmetic` rule and rejected 0, and within tens, ones and bare pairs both
    have the same form and length, so only the sum tells them apart."""
    rng, pair_rng = random.Random(seed), random.Random(f"rejected-{seed}")  # same questions as make_arithmetic
    kinds, shares = zip(*PREFERENCE_KINDS.items())
    rows = []
    for _ in range(n):
        a, b = arithmetic_question(rng)
        c, kind = a + b, pair_rng.choices(kinds, shares)[0]
        equation = f"{a} + {b} = {c}"
        wrong_tens = c - 10 if c >= 20 else c + 10  # the carry got wrong: 15 + 2 = 27, 18 + 5 = 13
        step = pair_rng.choice([-2, -1, 1, 2])
        wrong_ones = c + step if c + step >= 10 else c - step  # two digits, as c has
        chosen, rejected = {
            "tens": (equation, f"{a} + {b} = {wrong_tens}"),
            "ones": (equation, f"{a} + {b} = {wrong_ones}"),
            "bare": (str(c), str(pair_rng.choice([wrong_tens, wrong_ones]))),
            "format": (equation, pair_rng.choice([f"The answer is {c}.", f"{equation}\n{equation}", f"{c} = {a} + {b}",
                                                  f"{equation}. The sum of {a} and {b} is {c}."])),
        }[kind]
        rows.append({"prompt": arithmetic_prompt(a, b), "chosen": chosen, "rejected": rejected, "kind": kind})
    return rows


# ---- the agent demo: three-digit sums, a calculator tool (examples/calculator.py), one worked call in the prompt
# SmolLM2-135M-Instruct gets such sums right in its head about once in ten. Shown one call, greedy, it calls the tool
# on a third of them and copies the tool's answer (validation before training: 0.31 well-formed calls, 0.38 right on
# 100 prompts); shown two calls it already calls on 0.94 (measured by hand), which would leave little to learn.
ARITHMETIC_TOOL_SYSTEM = "You have a calculator. To use it, write <calc>expression</calc>."
ARITHMETIC_TOOL_SHOT = (123, 456)


def arithmetic_tool_prompt(a: int, b: int) -> list[dict]:
    """The chat asking for a + b: the calculator's instruction, one worked example (question, call, the tool's
    answer, the reply), the question."""
    x, y = ARITHMETIC_TOOL_SHOT
    return [{"role": "system", "content": ARITHMETIC_TOOL_SYSTEM}, {"role": "user", "content": f"What is {x} + {y}?"},
            {"role": "assistant", "content": f"<calc>{x} + {y}</calc>"}, {"role": "tool", "content": str(x + y)},
            {"role": "assistant", "content": str(x + y)}, {"role": "user", "content": f"What is {a} + {b}?"}]


def make_arithmetic_tool(n: int, seed: int) -> list[dict]:
    """n prompts a + b, both from 100 to 999, scored by the strict `arithmetic` rule on the last turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": arithmetic_tool_prompt(a, b), "ground_truth": str(a + b), "data_source": "arithmetic",
                     "extra_info": {"index": i, "a": a, "b": b}})
    return rows


# ---- the environment demo (make env): guess a secret number from a range of ten, told after each guess higher or
# lower and what it can still be (examples/guess_number.py). Shown one worked game, SmolLM2-135M-Instruct's first
# guess ignores the range it is given (19 or 16 for any range) and it sometimes echoes the answer ("18 to 27"):
# greedy, it wins 0.035 of 200 games in a scratch vLLM script (0.07 when told only higher or lower) and 0.01 of the
# validation games through ppo.py. Binary search wins every game in 4, a uniform guess among the numbers it is told
# 0.76 of them.
GUESS_SYSTEM = ("Guess my secret number. Reply with one number only. After each guess I say higher or lower, and "
                "the numbers it can still be.")
GUESS_SHOT = [{"role": "user", "content": "A number from 1 to 10."}, {"role": "assistant", "content": "5"},
              {"role": "user", "content": "higher: 6 to 10"}, {"role": "assistant", "content": "8"},
              {"role": "user", "content": "lower: 6 to 7"}, {"role": "assistant", "content": "7"},
              {"role": "user", "content": "correct"}]


def make_guess_number(n: int, seed: int) -> list[dict]:
    """n games: a range of ten from lo (1 to 90) and a secret in it, in extra_info for the environment; the rows'
    data_source "environment" (its rewards are the score) and ground truth the secret."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        lo = rng.randint(1, 90)
        secret = rng.randint(lo, lo + 9)
        prompt = [{"role": "system", "content": GUESS_SYSTEM}, *GUESS_SHOT,
                  {"role": "user", "content": f"A number from {lo} to {lo + 9}."}]
        rows.append({"prompt": prompt, "ground_truth": str(secret), "data_source": "environment",
                     "extra_info": {"index": i, "lo": lo, "hi": lo + 9, "secret": secret}})
    return rows
