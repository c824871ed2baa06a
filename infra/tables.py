"""Tables read before any model loads: a dataset file's rows with every check a row needs (DataError: one sentence
naming the file, the row and the fix), and preference pairs in every layout a researcher brings. No tokenizer here:
data.py renders and tokenises what these return.
"""
import math
import numbers
import os

import pyarrow as pa
import pyarrow.parquet as pq

from infra.config import ConfigError


class DataError(ConfigError):
    """A dataset that cannot be used as given; the message names the file, the row and the fix."""


def read_table(path: str, columns: list[str]) -> pa.Table:
    """The table at `path`, with `columns` and at least one row; else a DataError naming what is wrong."""
    if os.path.isdir(path):
        raise DataError(f"data file {path} is a directory; name the parquet file inside it, "
                        f"e.g. {path}/train.parquet")
    if not os.path.isfile(path):
        raise DataError(f"data file {path} does not exist; write one with `python tools/prepare_data.py --task "
                        f"arithmetic --output data/arithmetic` or convert jsonl with `python tools/prepare_data.py --input x.jsonl "
                        f"--output DIR`")
    try:
        table = pq.read_table(path)
        table.validate(full=True)  # bad UTF-8 fails here, by column, not as a decode error while reading rows
    except (pa.ArrowInvalid, OSError) as e:
        if "UTF8" in str(e):
            raise DataError(f"data file {path} holds text that is not valid UTF-8 ({e}); re-encode it") from None
        raise DataError(f"data file {path} is not a readable parquet file: {e}") from None
    for name in columns:
        if name not in table.column_names:
            raise DataError(f"{path}: missing column `{name}`; found columns {table.column_names}")
    if table.num_rows == 0:
        raise DataError(f"{path}: the file has 0 rows")
    return table


def check_prompt(prompt, where: str) -> None:
    """Raise unless prompt is text or a chat: a non-empty list of {"role": str, "content": str} dicts."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)):
        return
    raise DataError(f"{where}`prompt` must be a string or a list of {{role, content}} messages, "
                    f"got {type(prompt).__name__} {str(prompt)[:80]!r}")


def load_preferences(path: str) -> tuple[list[dict], dict]:
    """Read preference pairs for the reward-model stage; returns (rows, stats).

    Columns: prompt (text or chat messages), chosen, rejected (the *responses only*, strings: the caller prepends
    the prompt; with an empty prompt they are whole HH-RLHF-style conversations), optional margin (float, 0.0 when
    absent) and kind (a label, e.g. "tens"). Pairs with chosen == rejected teach nothing and are dropped.
    stats: {"rows": read, "kept": returned, "identical_dropped": dropped}.
    """
    table = read_table(path, ["prompt", "chosen", "rejected"])
    rows, identical = [], 0
    for i, row in enumerate(table.to_pylist()):
        check_prompt(row["prompt"], f"{path} row {i}: ")
        if not (isinstance(row["chosen"], str) and isinstance(row["rejected"], str)):
            raise DataError(f"{path} row {i}: `chosen` and `rejected` must be strings")
        if not (row["chosen"].strip() and row["rejected"].strip()):
            raise DataError(f"{path} row {i}: `chosen` and `rejected` must not be empty; drop the row or fill it in")
        margin = row.get("margin")
        if margin is not None and not (isinstance(margin, numbers.Real) and not isinstance(margin, bool)
                                       and math.isfinite(margin)):
            raise DataError(f"{path} row {i}: `margin` must be a finite number or null, got {margin!r}")
        if row["chosen"] == row["rejected"]:
            identical += 1
            continue
        kind = {"kind": row["kind"]} if row.get("kind") else {}  # optional: validation accuracy is also per kind
        rows.append({**{k: row[k] for k in ("prompt", "chosen", "rejected")}, "margin": float(margin or 0.0), **kind})
    if not rows:
        raise DataError(f"{path}: all {identical} pairs have chosen == rejected; nothing to learn from")
    return rows, {"rows": table.num_rows, "kept": len(rows), "identical_dropped": identical}


def load_sft_rows(path: str) -> tuple[list[dict], dict]:
    """Rows for supervised fine-tuning, {"prompt", "response"}, from any of three layouts: `messages` (a chat;
    every assistant turn is a row, the conversation before it its prompt), `prompt` + `response`, or preference
    pairs (their `chosen` side, load_preferences). stats: {"rows": read, "layout", "used"}."""
    columns = read_table(path, []).column_names
    if "messages" in columns:
        rows = []
        for i, row in enumerate(read_table(path, ["messages"]).to_pylist()):
            chat = row["messages"]
            check_prompt(chat, f"{path} row {i}: `messages` ")
            turns = [t for t, m in enumerate(chat) if m["role"] == "assistant" and t > 0]
            if not turns:
                raise DataError(f"{path} row {i}: `messages` has no assistant turn after another message; every "
                                f"conversation needs one to learn from")
            rows += [{"prompt": chat[:t], "response": chat[t]["content"]} for t in turns]
        return rows, {"rows": len(rows), "layout": "messages", "used": len(rows)}
    if "response" in columns:
        table = read_table(path, ["prompt", "response"]).to_pylist()
        for i, row in enumerate(table):
            check_prompt(row["prompt"], f"{path} row {i}: ")
            if not isinstance(row["response"], str) or not row["response"].strip():
                raise DataError(f"{path} row {i}: `response` must be a non-empty string")
        return table, {"rows": len(table), "layout": "prompt+response", "used": len(table)}
    rows, stats = load_preferences(path)
    return [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows], {**stats, "layout": "chosen"}


read_parquet = read_table  # the name data.py's readers use
