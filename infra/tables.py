"""Tables read before any model loads: a dataset file's rows with every check a row needs (DataError: one sentence
naming the file, the row and the fix), and preference pairs in every layout a researcher brings. No tokenizer here:
data.py renders and tokenises what these return.
"""
import json
import math
import numbers
import os
import re

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from infra.config import ConfigError


class DataError(ConfigError):
    """A dataset that cannot be used as given; the message names the file, the row and the fix."""


def read_table(path: str, columns: list[str]) -> pa.Table:
    """The table at `path` (parquet, jsonl, or a folder written by datasets' save_to_disk), with `columns` and at
    least one row; else a DataError naming what is wrong."""
    if not os.path.exists(path):
        raise DataError(f"data file {path} does not exist; write one with `python tools/prepare_data.py --task "
                        f"arithmetic --output data/arithmetic` or convert jsonl with `python tools/prepare_data.py --input x.jsonl "
                        f"--output DIR`")
    try:
        table = saved_dataset(path) if os.path.isdir(path) else (
            pa_json.read_json(path) if path.endswith((".jsonl", ".json")) else pq.read_table(path))
        table.validate(full=True)  # bad UTF-8 fails here, by column, not as a decode error while reading rows
    except (pa.ArrowInvalid, OSError) as e:
        if "UTF8" in str(e):
            raise DataError(f"data file {path} holds text that is not valid UTF-8 ({e}); re-encode it") from None
        kind = "jsonl" if path.endswith((".jsonl", ".json")) else "parquet"
        raise DataError(f"data file {path} is not a readable {kind} file: {e}") from None
    for name in columns:
        if name not in table.column_names:
            raise DataError(f"{path}: missing column `{name}`; found columns {table.column_names}")
    if table.num_rows == 0:
        raise DataError(f"{path}: the file has 0 rows")
    return table


def saved_dataset(path: str) -> pa.Table:
    """The rows of a folder that datasets' Dataset.save_to_disk wrote (state.json naming its Arrow stream files),
    read with pyarrow alone; a DatasetDict's folder, or any other folder, is a DataError naming what to give."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise DataError(f"data file {path} is a datasets DatasetDict; name one split's folder, e.g. "
                        f"{os.path.join(path, splits[0] if splits else 'train')}")
    if not os.path.exists(os.path.join(path, "state.json")):
        raise DataError(f"data file {path} is a directory; name the parquet file inside it, e.g. {path}/train.parquet, "
                        f"or give a folder that datasets' save_to_disk wrote")
    with open(os.path.join(path, "state.json")) as f:
        files = [os.path.join(path, entry["filename"]) for entry in json.load(f)["_data_files"]]
    tables = []
    for name in files:
        with pa.memory_map(name) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables)


def check_prompt(prompt, where: str) -> None:
    """Raise unless prompt is text or a chat: a non-empty list of {"role": str, "content": str} dicts."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)):
        return
    raise DataError(f"{where}`prompt` must be a string or a list of {{role, content}} messages, "
                    f"got {type(prompt).__name__} {str(prompt)[:80]!r}")


def load_preferences(path: str) -> tuple[list[dict], dict]:
    """Preference pairs in any layout (preference_row), for reward_model.py, sft.py and dpo.py; returns (rows, stats).

    rows: {prompt (text or chat messages), chosen, rejected (the responses alone, strings), margin (0.0 when
    absent), kind (where given, a label, e.g. "tens")}. An empty text prompt keeps chosen and rejected whole
    conversations as they are (reward_model.py reads them so). Pairs with chosen == rejected teach nothing and are
    dropped. stats: {"rows": read, "kept": returned, "identical_dropped": dropped}.
    """
    table = read_table(path, ["chosen", "rejected"])
    rows, identical = [], 0
    for i, row in enumerate(table.to_pylist()):
        pair = preference_row(row, f"{path} row {i}: ")
        if not (pair["chosen"].strip() and pair["rejected"].strip()):
            raise DataError(f"{path} row {i}: `chosen` and `rejected` must not be empty; drop the row or fill it in")
        margin = row.get("margin")
        if margin is not None and not (isinstance(margin, numbers.Real) and not isinstance(margin, bool)
                                       and math.isfinite(margin)):
            raise DataError(f"{path} row {i}: `margin` must be a finite number or null, got {margin!r}")
        if pair["chosen"] == pair["rejected"]:
            identical += 1
            continue
        kind = {"kind": row["kind"]} if row.get("kind") else {}  # optional: validation accuracy is also per kind
        rows.append({**pair, "margin": float(margin or 0.0), **kind})
    if not rows:
        raise DataError(f"{path}: all {identical} pairs have chosen == rejected; nothing to learn from")
    return rows, {"rows": table.num_rows, "kept": len(rows), "identical_dropped": identical}


HH_TURN = re.compile(r"\n\n(Human|Assistant): ")  # HH-RLHF's text: "\n\nHuman: …\n\nAssistant: …"


def preference_row(row: dict, where: str) -> dict:
    """One pair → {prompt, chosen, rejected}, the responses as strings, from the layouts researchers bring:
        ours, TRL's standard     prompt (text or messages), chosen and rejected strings
        TRL's conversational     prompt messages, chosen and rejected each [one assistant message]
        TRL's implicit prompt    no prompt; chosen and rejected whole conversations (messages): the prompt is
                                 their shared opening, each reply its last message
        HH-RLHF                  no prompt; chosen and rejected whole conversations as "\n\nHuman: …\n\nAssistant: …"
                                 text, read as messages and then as an implicit prompt"""
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if prompt is None and isinstance(chosen, str) and isinstance(rejected, str):
        chosen, rejected = hh_messages(chosen, where), hh_messages(rejected, where)
    if isinstance(chosen, list) and isinstance(rejected, list):
        for side, messages in (("chosen", chosen), ("rejected", rejected)):
            check_prompt(messages, f"{where}`{side}` ")
        if prompt is None:  # the shared opening, never the last message: that is each side's reply
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        chosen, rejected = reply(chosen, "chosen", where), reply(rejected, "rejected", where)
    if prompt is None:
        raise DataError(f"{where}there is no `prompt` column, and `chosen` / `rejected` are not whole conversations "
                        f"(chat messages, or HH-RLHF's \\n\\nHuman: … \\n\\nAssistant: … text); add the prompts")
    check_prompt(prompt, where)
    if not (isinstance(chosen, str) and isinstance(rejected, str)):
        raise DataError(f"{where}`chosen` and `rejected` must be strings or chat messages, got "
                        f"{type(chosen).__name__} and {type(rejected).__name__}")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def hh_messages(text: str, where: str) -> list[dict]:
    """HH-RLHF's "\n\nHuman: a\n\nAssistant: b…" → [{user: a}, {assistant: b}, …]."""
    parts = HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise DataError(f"{where}there is no `prompt` column and `chosen` is text that is not an HH-RLHF conversation "
                        f"(\\n\\nHuman: … \\n\\nAssistant: …); add a `prompt` column")
    return [{"role": "user" if who == "Human" else "assistant", "content": said.strip()}
            for who, said in zip(parts[1::2], parts[2::2])]


def reply(messages: list, side: str, where: str) -> str:
    """The text of a side given as [one assistant message]."""
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise DataError(f"{where}`{side}` must hold one assistant message after the prompt, got "
                        f"{[m['role'] for m in messages]}")
    return messages[0]["content"]


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
