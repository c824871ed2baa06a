"""What a checkpoint holds and what it was trained from: each checkpoint folder's manifest.json lists the size and
sha256 of every file written into it and the fingerprints of the base models (runs.save_checkpoint writes it,
runs.intact_resume and runs.record_bases check it before any model loads).

    {"files": {"state.json": {"size": 159, "sha256": "acb2…"}, "tensors/shard-00001-….safetensors": {…}, …},
     "base_models": {"model.path": {"path": "models/SmolLM2-135M-Instruct", "fingerprint": "6d9d…"}}}
"""
import hashlib
import json
import os
import re
from typing import Optional

from infra.config import ConfigError

MANIFEST = "manifest.json"
BASES_FILE = "base_models.json"  # in output_dir: the run's base models and their fingerprints (runs.record_bases)
BEST = "best"  # output_dir/best: the checkpoint of the best validation (trainer.best_metric)
MANAGED = re.compile(rf"(step_\d+|{BEST}|final|abandoned)(\.tmp)?")  # the folders a run writes, prunes and replaces


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str, base_models: dict) -> None:
    """folder/manifest.json: the size and sha256 of every file in `folder`, and `base_models` ({key: {"path",
    "fingerprint"}}: what the checkpoint was trained from)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = {"size": os.path.getsize(path), "sha256": sha256_of(path)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": files, "base_models": base_models}, f, indent=1)


def checkpoint_problem(folder: str) -> Optional[str]:
    """What is wrong with the checkpoint `folder` (the first damaged file and how), or None when every file its
    manifest lists has its size and sha256. A checkpoint from before manifests needs a readable state.json."""
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.exists(manifest):
        try:
            with open(os.path.join(folder, "state.json")) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{folder}/state.json is damaged ({type(e).__name__})"
        return None
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest} is damaged ({type(e).__name__})"
    for name, want in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) != want["size"]:
            return f"{path} is {os.path.getsize(path)} bytes, {want['size']} when it was written"
        if sha256_of(path) != want["sha256"]:
            return f"{path} has changed since it was written (its sha256 differs)"
    return None


def fingerprint(folder: str) -> Optional[str]:
    """What identifies a model folder's weights beyond its path: sha256 over config.json and, per *.safetensors
    file, its header (every tensor's name, dtype, shape, offsets) and 3 × 1 KiB of every tensor (its start, middle
    and end), so a few MiB are read whatever the model's size. Training or merging changes every element of a
    tensor it touches, so new weights at the same path change this. None for a hub id (no local folder)."""
    if not os.path.isdir(folder):
        return None
    digest = hashlib.sha256()
    for name in ["config.json"] + sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        digest.update(name.encode())
        with open(path, "rb") as f:
            if not name.endswith(".safetensors"):
                digest.update(f.read())
                continue
            try:
                size = int.from_bytes(f.read(8), "little")
                if size > os.path.getsize(path) - 8:
                    raise ValueError("the header is longer than the file")
                header = f.read(size)
                tensors = json.loads(header)
            except ValueError:  # not a safetensors file after all: its size and first MiB
                f.seek(0)
                digest.update(f"{os.path.getsize(path)}".encode() + f.read(1 << 20))
                continue
            digest.update(header)
            for tensor in sorted(k for k in tensors if k != "__metadata__"):
                start, end = tensors[tensor]["data_offsets"]
                for at in (start, (start + end) // 2, max(start, end - 1024)):
                    f.seek(8 + size + at)
                    digest.update(f.read(min(1024, end - at)))
    return digest.hexdigest()


def recorded_bases(checkpoint: str) -> dict:
    """The base models a checkpoint's manifest records ({} for a checkpoint from before manifests)."""
    path = os.path.join(checkpoint, MANIFEST)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("base_models", {})


def changed_base(checkpoint: str, now: dict) -> Optional[str]:
    """The sentence's middle for the first base model of `now` ({key: {"path", "fingerprint"}}, as runs.run_bases)
    whose fingerprint differs from the one `checkpoint`'s manifest recorded, or None: its saved adapter or optimiser
    state then belongs to other weights. Resume (runs.record_bases), a rollback to best/ (train_state.keep_best) and
    tools/export.py all ask this."""
    recorded = recorded_bases(checkpoint)
    for key, base in now.items():
        then = recorded.get(key)
        if then and then["fingerprint"] and base["fingerprint"] and then["fingerprint"] != base["fingerprint"]:
            return (f"{key}: the model at {base['path']} is not the one {checkpoint} was trained from (its config or "
                    f"weights changed since: fingerprint {then['fingerprint'][:12]} then, {base['fingerprint'][:12]} "
                    f"now)")
    return None


def check_outside_runs(path: str) -> None:
    """An export's output folder that is, or lies in, a folder a run writes, prunes or replaces by itself is refused
    in one sentence: a checkpoint anywhere (it has a manifest.json), or a step_<N>/, best/, final/ or abandoned/ of a
    run's output_dir (known by the .lock and base_models.json that runs.start_run writes there). tools/export.py and
    tools/merge_lora.py ask this: the run would later delete or overwrite what they wrote."""
    target = here = os.path.realpath(path)
    while os.path.dirname(here) != here:
        parent = os.path.dirname(here)
        if os.path.isfile(os.path.join(here, MANIFEST)) or (MANAGED.fullmatch(os.path.basename(here)) and any(
                os.path.exists(os.path.join(parent, marker)) for marker in (".lock", BASES_FILE))):
            raise ConfigError(f"the output folder {path} {'is' if here == target else 'lies in'} {here}, which its run "
                              f"writes, prunes or replaces by itself; choose a folder outside the run's checkpoints, "
                              f"best/, final/ and abandoned/")
        here = parent
