"""From a command line to a checked config: `--config FILE key=value …` → the dataclasses of config.py.

    cfg = load_config("configs.yaml", ["trainer.total_steps=20", "actor.optim.lr=1e-6"])

Values are type-checked and range-checked (config.RANGES), an unknown key fails with the nearest valid key named,
and `--help` prints every key with its default and documentation.
"""
import ast
import dataclasses
import difflib
import math
import os
import reprlib
import signal
import sys
import textwrap
import types
import typing
import unicodedata
from typing import Literal, Optional

import torch
import yaml

from infra import config, config_offline, config_rl, verl_keys
from infra.config import Config, ConfigError, FIXED_ON_RESUME, LENGTH_OF, RANGE_OF, RewardModelStage
from infra.config_offline import DPOStage, SFTStage

ROOTS = (Config, RewardModelStage, SFTStage, DPOStage)  # each entry point's root: ppo, reward_model, sft, dpo

def shown(value) -> str:
    """repr(value) in at most 300 characters, built without expanding the rest: how an error quotes a value."""
    short = reprlib.Repr()  # Python 3.11's takes no arguments
    short.maxlevel, short.maxstring, short.maxother = 3, 160, 160
    short.maxdict = short.maxlist = short.maxtuple = short.maxset = 6
    return short.repr(value)[:300]


class StrictYAMLError(yaml.YAMLError):
    """A key given twice in one mapping, or an alias; `line` is where (1-based)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line


class StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, stricter. PyYAML keeps the last of two equal keys, so a second `trainer:` block silently
    replaces the first; and it expands aliases (*name) without bound, so a few lines can ask for gigabytes (the
    "billion laughs"). Both are refused here: a config file spells out every value once."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise StrictYAMLError(event.start_mark.line + 1, f"`*{event.anchor}` is a YAML alias, which config "
                                                             f"files may not use; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first = {}  # key → the line it first appears on
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: SafeLoader's own error names it
            if key in first:
                name = key[:80] if isinstance(key, str) else shown(key)
                raise StrictYAMLError(line, f"`{name}` is given twice in the same section (first on line "
                                            f"{first[key]}); keep one")
            first[key] = line
        return super().construct_mapping(node, deep)


def strict_yaml(text):
    """The YAML value of `text` (a string or an open file), read by StrictLoader."""
    return yaml.load(text, Loader=StrictLoader)


def all_keys(cls, prefix="") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            keys += all_keys(f.type, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _unknown(key: str, root) -> ConfigError:
    """The key as written, with any invisible or non-ASCII character escaped (a zero-width space as \\u200b) and
    named, so that `rollout.n\\u200b` does not read as the valid key it looks like; and the nearest valid key."""
    near = difflib.get_close_matches(key, all_keys(root), n=1, cutoff=0.5)
    hint = f"; did you mean `{near[0]}`?" if near else "; see `--help` for the valid keys"
    odd = sorted({c for c in key if not (c.isascii() and c.isprintable())})
    if odd:
        names = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in odd)
        shown_key = key.encode("ascii", "backslashreplace").decode()
        return ConfigError(f"unknown config key `{shown_key}`: it holds {names}, which may be invisible{hint}")
    return ConfigError(f"unknown config key `{key}`{hint}")


def _coerce(value, tp, key: str):
    """Check `value` against the annotation `tp`, converting where YAML or the CLI is loose."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(value, [a for a in args if a is not type(None)][0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key `{key}` must be one of {list(args)}, got {shown(value)}")
        return value
    if origin is list:
        if isinstance(value, str):  # from the CLI: a,b,c  or  [a, b, c]
            try:
                value = strict_yaml(value) if value.startswith("[") else value.split(",")
            except yaml.YAMLError as e:
                raise ConfigError(f"config key `{key}`: {shown(value)} is not a YAML list ({e})") from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key `{key}` must be a list, got {shown(value)}")
        return [_coerce(v, args[0], key) for v in value]
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"config key `{key}` must be true or false, got {shown(value)}")
        return value
    if tp in (int, float):
        try:
            number = tp(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or (tp is int and isinstance(value, float) and value != int(value)):
            raise ConfigError(f"config key `{key}` must be {'an integer' if tp is int else 'a number'}, "
                              f"got {shown(value)}")
        return number
    if tp is str:
        return str(value)
    raise ConfigError(f"config key `{key}` has an unsupported type {tp}")


def _build(cls, values: dict, prefix: str, root, default=None):
    """`values` over `default` (an instance of cls; None: cls's own defaults). A section keeps the defaults its parent
    gave it (ActorConfig's optim has lr_scheduler="constant", OptimConfig's own default is "cosine"), however few
    of its keys a file or an override sets."""
    default = cls() if default is None else default
    if not isinstance(values, dict):
        raise ConfigError(f"config section `{prefix.rstrip('.') or '(top)'}` must be a mapping, got {shown(values)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        if name not in names:
            raise _unknown(prefix + name, root)
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, {} if value is None else value, prefix + name + ".", root, getattr(default, name))
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    return dataclasses.replace(default, **kwargs)


def _set_dotted(tree: dict, key: str, value: str, root):
    cls, node, parts = root, tree, key.split(".")
    for part in parts[:-1]:
        tp = typing.get_type_hints(cls).get(part)
        if tp is None or not dataclasses.is_dataclass(tp):
            raise _unknown(key, root)
        if node.get(part) is None:
            node[part] = {}
        elif not isinstance(node[part], dict):
            raise ConfigError(f"config section `{key.rsplit('.', 1)[0]}` must be a mapping, got "
                              f"{shown(node[part])}")
        cls, node = tp, node[part]
    if parts[-1] not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown(key, root)
    node[parts[-1]] = value


def load_config(path: Optional[str] = None, overrides: tuple = (), root=Config):
    """configs.yaml (if given) → dotted CLI overrides (`a.b=value`) → a checked `root` dataclass."""
    tree = {}
    if path is not None:
        try:
            with open(path) as f:
                tree = strict_yaml(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
        except StrictYAMLError as e:
            raise ConfigError(f"config file {path} line {e.line}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())[:300]}") from None
        if tree is None:
            tree = {}
        elif not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections (model:, data:, …), "
                              f"got {shown(tree)[:80]}")
    other = {f.name for r in ROOTS if r is not root for f in dataclasses.fields(r)}
    tree = {k: v for k, v in tree.items() if k not in other}  # configs.yaml holds both entry points' sections
    if "actor_rollout_ref" in tree:  # a verl YAML file: its keys are read as verl's launch line's
        tree, overrides = {}, [*verl_keys.tree_items(tree), *overrides]
    try:  # verl's launch keys and values, in this library's terms (infra/verl_keys.py), each said on the console
        overrides, translated = verl_keys.translate_all(list(overrides), tree)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for line in translated if os.environ.get("RANK", "0") == "0" else ():
        print(line, flush=True)
    given = {}  # key → its value on the command line so far
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override `{item}` must look like key=value, e.g. trainer.total_steps=20")
        key, value = (part.strip() for part in item.split("=", 1))
        if key in given and given[key] != value:  # examples/*.sh put "$@" after their own: a later one wins
            warn0(f"`{key}` is given twice on the command line ({shown(given[key])}, then {shown(value)}): the last "
                  f"one, {shown(value)}, is used")
        given[key] = value
        _set_dotted(tree, key, value, root)
    cfg = _build(root, tree, "", root)
    check_ranges(cfg)
    return cfg


def in_interval(x: float, interval: str) -> bool:
    """Is x in an interval written "[a, b)" / "(a, b]" …?"""
    low, high = (float(v) for v in interval[1:-1].split(","))
    return (low <= x if interval[0] == "[" else low < x) and (x <= high if interval[-1] == "]" else x < high)


def check_ranges(cfg, prefix: str = "") -> None:
    """Every number of the config (nested sections included) inside its RANGES interval, and every list of a
    fixed length (LENGTH_OF) of that length, or a ConfigError."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_ranges(value, prefix + f.name + ".")
            continue
        if f.name in LENGTH_OF and len(value) != LENGTH_OF[f.name]:
            raise ConfigError(f"config key `{prefix + f.name}` must hold {LENGTH_OF[f.name]} values, got "
                              f"{len(value)}: {shown(value)}")
        interval = RANGE_OF.get(f.name, "[0, inf)")
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, (int, float)) and not isinstance(x, bool) and not (
                    math.isfinite(x) and in_interval(x, interval)):
                raise ConfigError(f"config key `{prefix + f.name}` must be in {interval}, got {x}")


def _docs_by_class() -> dict[str, dict[str, str]]:
    """{class name: {field: the string literal under it}} for every dataclass of infra/config*.py."""
    docs = {}
    for node in [node for module in (config, config_rl, config_offline) for node in ast.parse(open(module.__file__).read()).body]:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {stmt.target.id: nxt.value.value for stmt, nxt in zip(node.body, node.body[1:])
                               if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                               and isinstance(nxt.value, ast.Constant)}
    return docs


def field_docs(cls, prefix: str = "", docs=None) -> dict[str, str]:
    """Every key of `cls` → its documentation; a field redeclared without one (a new default) keeps its base's."""
    docs, out = docs or _docs_by_class(), {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(field_docs(tp, prefix + f.name + ".", docs))
        else:
            out[prefix + f.name] = next(docs[c.__name__][f.name] for c in cls.__mro__
                                        if f.name in docs.get(c.__name__, {}))
    return out


def to_yaml(roots: tuple = ()) -> str:
    """configs.yaml: every key of ppo.py, reward_model.py, sft.py and dpo.py with its default and, above it, its documentation.
    Generated by `python tools/configs_yaml.py > configs.yaml`: infra/config.py's dataclasses are the one source of every default."""
    lines = ["# Every key of ppo.py, reward_model.py, sft.py and dpo.py, with its default. Generated from infra/config.py (edit the",
             "# defaults there, then: python tools/configs_yaml.py > configs.yaml). An experiment writes only what it",
             "# changes, in its own YAML file or on the command line:",
             "#   accelerate launch ppo.py --config configs.yaml trainer.total_steps=20"]
    for root in roots or ROOTS:
        docs = field_docs(root)

        def walk(obj, prefix, indent):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    lines.extend([""] * (indent == "") + [f"{indent}{f.name}:"])
                    walk(value, f"{prefix}{f.name}.", indent + "  ")
                    continue
                doc = " ".join(docs[prefix + f.name].split())
                lines.extend(f"{indent}# {part}" for part in textwrap.wrap(doc, 116 - len(indent)))
                text = yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()
                lines.append(f"{indent}{f.name}: {text}")
        walk(root(), "", "")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str], doc: str, root=Config):
    """`--config FILE key=value ...` → Config. `--help` prints `doc` and every key with its default."""
    if "-h" in argv or "--help" in argv:
        print(doc.strip() + "\n\nConfig keys (default) — description:")
        defaults = root()
        for key, text in field_docs(root).items():
            value = defaults
            for part in key.split("."):
                value = getattr(value, part)
            print(f"  {key} ({value!r}) — {text}")
        sys.exit(0)
    paths, overrides, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file, e.g. --config configs.yaml")
            paths, i = paths + [argv[i + 1]], i + 2
        elif argv[i].startswith("--config="):
            paths, i = paths + [argv[i].split("=", 1)[1]], i + 1
        else:
            overrides.append(argv[i].removeprefix("--"))
            i += 1
    if len(paths) > 1:  # the last file used to win, the others silently unread
        raise ConfigError(f"--config is given {len(paths)} times ({', '.join(paths)}), and only one file is read: "
                          f"give one, with the others' changes in it or as key=value overrides")
    return load_config(paths[0] if paths else None, overrides, root)


def warn0(message: str) -> None:
    """"warning: <message>" on the console, printed by rank 0 only (RANK, as run_script reads it)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", flush=True)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} → {"a.b": 1}"""
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def resume_changes(cfg, saved_path: str, unused: frozenset = frozenset()) -> list[str]:
    """How `cfg` differs from the config.yaml saved by the run being resumed: "key old → new" for each key that
    may change, a ConfigError for one in FIXED_ON_RESUME that the run uses (`unused`: keys it does not, e.g. the
    critic's backbone in a run without a critic). A key the saved file lacks (an older version) is skipped."""
    with open(saved_path) as f:
        saved = flatten(strict_yaml(f) or {})
    now = flatten(to_dict(cfg))
    changed = [k for k, v in now.items() if k in saved and saved[k] != v]
    for key in changed:
        if key in FIXED_ON_RESUME - unused:
            raise ConfigError(f"`{key}` cannot change on resume (it was {shown(saved[key])} in {saved_path}, now "
                              f"{shown(now[key])}): set it back, or start a new run in another output_dir")
    return [f"{k} {shown(saved[k])} → {shown(now[k])}" for k in changed]


def save(cfg, path: str) -> None:
    """The resolved config, overrides applied: `--config` this file to rerun the same experiment."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def run_script(main, doc: str, root, name: str, check=None) -> None:
    """`accelerate launch <name> --config FILE key=value …` → main(config). With `--check`, check(config, processes)
    instead: everything that comes before a model loads, for the process count the launcher gives (WORLD_SIZE;
    `accelerate launch --num_processes 8 <name> --check …`, or WORLD_SIZE=8 python <name> --check …), then its one
    line, exit 0. A user's mistake (a ConfigError,
    data.DataError among them) ends the run in one sentence, printed once, by rank 0; Ctrl-C while loading ends it
    quietly (130), a stop signal that could not wait for the end of a step (runs.Interrupted) with its sentence and
    128 + signum.
    A finished multi-process CPU run leaves without the interpreter's teardown (see the end)."""
    rank0, argv = os.environ.get("RANK", "0") == "0", sys.argv[1:]
    try:
        if check is not None and "--check" in argv:
            line = check(parse_args([a for a in argv if a != "--check"], doc, root),
                         int(os.environ.get("WORLD_SIZE", "1")))
            if rank0:
                print(f"{name} --check: {line}", flush=True)
            return
        main(parse_args(argv, doc, root))
    except ConfigError as e:
        sys.exit(f"{name}: {e}" if rank0 else 1)
    except KeyboardInterrupt as e:  # Ctrl-C while loading, or runs.Interrupted: a stop that could not wait
        if rank0:
            print(f"{name}: {str(e) or 'interrupted; the last checkpoint is kept'}", file=sys.stderr)
        sys.exit(128 + getattr(e, "signum", signal.SIGINT))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        # Done, and every process has passed the last barrier. Under FSDP2, torch keeps the gloo process group
        # alive after destroy_process_group (its device mesh stays referenced), so its threads would still run
        # while the interpreter tears down, which once aborted a finished process (SIGABRT): skip teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
