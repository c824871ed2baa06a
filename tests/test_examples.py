"""examples/: the real-size recipes, run as written for one step with a tiny model and tiny GSM8K files.

Each recipe is a config file (examples/<name>.yaml) and a shell script: the data step (GSM8K jsonl → parquet through
tools/prepare_data.py), then `accelerate launch ppo.py --config examples/<name>.yaml "$@"`. The test runs the script
itself, appending only what makes it tiny (model, sizes, CPU backends, output folder), and checks that the run used
every other setting of the recipe, so a renamed or retyped key fails here instead of on a GPU an hour in.

Every documented launch line (README.md, the scripts' and config files' headers, slurm/ppo.sbatch, ppo.py's and
reward_model.py's docstrings) goes through `--check` with the process count it launches (issue 29).
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import CORPUS, REPO, make_tiny_model, make_tokenizer, read_metrics

from infra import cli

RECIPES = ["gsm8k_qwen05b_ppo.sh", "gsm8k_qwen05b_grpo_lora.sh"]
GSM8K_LIKE = [  # (question, answer) in GSM8K's distributed jsonl form: reasoning, then "#### <n>"
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 6 pens. How many pens are in 2 boxes?", "6 * 2 = <<6*2=12>>12\n#### 12"),
    ("Sam had 10 cards and gave away 3. How many are left?", "10 - 3 = <<10-3=7>>7\n#### 7"),
    ("Each of 5 kids has 2 balls. How many balls in all?", "5 * 2 = <<5*2=10>>10\n#### 10"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model, and GSM8K-shaped train.jsonl (8 rows) and test.jsonl (4 rows) where the recipes look."""
    import data
    root = tmp_path_factory.mktemp("examples")
    # its tokenizer knows the stand-in rows' words, as a real one does: byte by byte, the tool rows' few-shot
    # prompt would be 199 tokens, over the max_prompt_length the documented lines keep (128)
    texts = [m["content"] for row in data.make_arithmetic_tool(8, seed=0) for m in row["prompt"]]
    make_tiny_model(root / "model", arch="qwen2", tokenizer=make_tokenizer(CORPUS + texts * 20, vocab_size=600))
    (root / "raw").mkdir()
    for name, rows in (("train", GSM8K_LIKE * 2), ("test", GSM8K_LIKE)):
        with open(root / "raw" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows)
    return root


def recipe_overrides(script: str) -> list[str]:
    """The settings of a recipe's config file (examples/<name>.yaml, which its .sh launches), as key=value."""
    with open(os.path.join(REPO, "examples", script.replace(".sh", ".yaml"))) as f:
        flat = cli.flatten(cli.strict_yaml(f))
    return [f"{key}={','.join(map(str, v)) if isinstance(v, list) else v}" for key, v in flat.items()]


def setting(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


@pytest.mark.parametrize("script", RECIPES)
def test_recipe_runs_one_step_with_its_own_overrides(tiny, tmp_path, script):
    """The recipe's data step turns GSM8K jsonl into train/test parquet; its launch runs one PPO step (validation
    before and after) with a tiny model; and the resolved config.yaml holds every override of the recipe that
    the test did not replace, so the recipe's keys and values all parse and reach the run."""
    out, data_dir = tmp_path / "out", tmp_path / "gsm8k"
    env = {**os.environ, "GSM8K_RAW": str(tiny / "raw"), "GSM8K_DATA": str(data_dir), "OMP_NUM_THREADS": "1"}
    tiny_overrides = [
        f"model.path={tiny}/model", "rollout.name=hf", "model.dtype=fp32", "rollout.dtype=fp32",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "data.max_prompt_length=400",
        "rollout.max_response_length=8", "trainer.total_steps=1", f"trainer.output_dir={out}",
        "trainer.plot_curves=false"]
    recipe = recipe_overrides(script)
    assert len(recipe) > 30 and all("=" in o for o in recipe), recipe
    proc = subprocess.run(["bash", f"examples/{script}", *tiny_overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    import pyarrow.parquet as pq
    assert pq.read_table(data_dir / "train.parquet").num_rows == 8
    test_rows = pq.read_table(data_dir / "test.parquet").to_pylist()
    assert len(test_rows) == 4 and test_rows[0]["data_source"] == "openai/gsm8k" and test_rows[0]["ground_truth"] == "7"

    with open(out / "config.yaml") as f:
        resolved = yaml.safe_load(f)
    replaced = {o.split("=", 1)[0] for o in tiny_overrides} | {"data.train_files", "data.val_files"}  # $GSM8K_DATA
    for override in recipe:
        key = override.split("=", 1)[0]
        if key not in replaced:
            wanted = setting(cli.load_config(None, [override]), key)
            assert setting(resolved, key) == wanted, (override, setting(resolved, key))

    lines = read_metrics(out)
    assert [m["step"] for m in lines] == [0, 1]
    assert "val/openai/gsm8k/score" in lines[0] and "val/score/mean" in lines[1]
    assert {"score/mean", "policy/entropy", "actor/grad_norm"} <= set(lines[1])
    if "ppo" in script:
        assert {"loss/value", "critic/grad_norm", "kl/coef"} <= set(lines[1])



# ---- every documented launch line, through --check with its own process count (issue 29)

COMMAND = re.compile(r"(?:[A-Z_]+=\S+ )*(?:accelerate launch|python (?:ppo|reward_model|sft|dpo)\.py --check|"
                     r"bash examples/\S+\.sh|sbatch)(?: [^#\n]*)?")
FAKE_LAUNCH = 'accelerate() { printf "%s\\n" "$@" > "$LAUNCH_ARGS"; }; export -f accelerate\n'


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every launch command in README.md's code blocks, in the comment lines of examples/ and
    slurm/ppo.sbatch, and in ppo.py's and reward_model.py's docstrings; `\\` continuations joined, comments cut."""
    found = []
    for name in ["README.md", "ppo.py", "reward_model.py", "sft.py", "dpo.py", "slurm/ppo.sbatch",
                 *sorted(f"examples/{f}" for f in os.listdir(os.path.join(REPO, "examples")))]:
        text = open(os.path.join(REPO, name)).read().replace("\\\n", " ")
        if name == "README.md":
            text = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
        elif name.endswith(".py"):  # the docstring's indented usage lines
            text = "\n".join(line for line in text[:text.index('"""', 3)].splitlines() if line.startswith("    "))
        else:  # scripts and config files: their indented usage comments, not their own code or prose
            text = "\n".join(line[1:] for line in text.splitlines() if re.match(r"#\s\s", line))
        for line in text.splitlines():
            found += [(name, " ".join(m.split())) for m in COMMAND.findall(line.strip())
                      if re.search(r"\b(ppo|reward_model|sft|dpo)\.py|examples/|slurm/", m)
                      and "prepare_gsm8k" not in m]  # the data step launches nothing
    return found


def accelerate_args(command: str, tmp_path) -> list[str]:
    """The arguments `accelerate` is called with: the command's own, or those its script passes (run with a stand-in
    accelerate, srun and scontrol; the GSM8K data step finds its files in place)."""
    words = shlex.split(command)
    env = dict(os.environ)
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "accelerate":
        return words[1:]
    if words[0] == "python":  # `WORLD_SIZE=N python ppo.py --check …`: N processes
        return ["--num_processes", env.get("WORLD_SIZE", "1"), *words[1:]]
    out = tmp_path / "launch_args"
    out.unlink(missing_ok=True)
    env.update(LAUNCH_ARGS=str(out), GSM8K_DATA=str(tmp_path / "gsm8k"), PATH=f"{tmp_path / 'bin'}:{env['PATH']}")
    if words[0] == "bash":
        subprocess.run(["bash", "-c", FAKE_LAUNCH + shlex.join(words)], cwd=REPO, env=env, check=True, timeout=60)
    else:  # sbatch [--nodes N] [--gpus-per-node G] slurm/ppo.sbatch …: the job's script on N nodes
        script = open(os.path.join(REPO, "slurm", "ppo.sbatch")).read().replace("exec .venv/bin/accelerate", "accelerate")
        nodes = re.search(r"#SBATCH --nodes=(\d+)", script).group(1)
        opts = words[1:words.index("slurm/ppo.sbatch")]
        nodes = opts[opts.index("--nodes") + 1] if "--nodes" in opts else nodes
        env.update(SLURM_JOB_NUM_NODES=nodes, SLURM_JOB_NODELIST="node0", SLURM_SUBMIT_DIR=REPO)
        subprocess.run(["bash", "-c", FAKE_LAUNCH + script, "ppo.sbatch",
                        *words[words.index("slurm/ppo.sbatch") + 1:]], cwd=REPO, env=env, check=True, timeout=60)
    return out.read_text().splitlines()[1:]  # after "launch"


def launched(args: list[str]) -> tuple[int, dict, str, list[str]]:
    """(processes, the launcher's environment for the script, script, its arguments) of `accelerate launch ARGS`: the
    process count from --num_processes, else the config file's num_processes, else 1."""
    script = next(i for i, a in enumerate(args) if a.endswith(".py"))
    options, file_cfg = args[:script], {}
    if "--config_file" in options:
        with open(os.path.join(REPO, options[options.index("--config_file") + 1])) as f:
            file_cfg = yaml.safe_load(f)
    processes = int(options[options.index("--num_processes") + 1]) if "--num_processes" in options else \
        file_cfg.get("num_processes", 1)
    env = {}
    if file_cfg.get("distributed_type") == "FSDP":  # what accelerate passes on from an FSDP config file
        fsdp = file_cfg["fsdp_config"]
        env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": str(fsdp["fsdp_version"]),
               "ACCELERATE_MIXED_PRECISION": file_cfg.get("mixed_precision", "no"),
               "FSDP_CPU_RAM_EFFICIENT_LOADING": str(fsdp.get("fsdp_cpu_ram_efficient_loading", True)).lower()}
    return processes, env, args[script], [a for a in args[script + 1:] if a != "--check"]  # the test adds it


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, tiny):
    """What a documented line names but this machine lacks: a tiny model, GSM8K-shaped parquet files (300 rows:
    enough for a 256-prompt step), arithmetic, tool and preference data, a judge endpoint (a rollout server's too); and
    srun and scontrol for sbatch."""
    import data
    from test_judge import StubServer
    root = tmp_path_factory.mktemp("stand_ins")
    rows = [{"prompt": [{"role": "user", "content": q}], "ground_truth": a.rsplit("#### ", 1)[1],
             "data_source": "openai/gsm8k", "extra_info": {"split": "train"}} for q, a in GSM8K_LIKE * 75]
    (root / "gsm8k").mkdir()
    for name in ("train", "test"):
        data.write_parquet(rows, str(root / "gsm8k" / f"{name}.parquet"))
    data.write_parquet(data.make_arithmetic(64, seed=0), str(root / "arithmetic.parquet"))
    data.write_parquet(data.make_arithmetic_tool(64, seed=0), str(root / "tool.parquet"))
    data.write_parquet(data.make_arithmetic_preferences(64, seed=0), str(root / "pairs.parquet"))
    (root / "bin").mkdir()
    for name, text in (("srun", '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 "$@"\n'),
                       ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (root / "bin" / name).write_text(text)
        (root / "bin" / name).chmod(0o755)
    judge = StubServer(models=("judge",))
    yield dict(root=root, model=str(tiny / "model"), judge=judge.url)
    judge.close()


def stand_in_overrides(cfg, s: dict) -> list[str]:
    """key=value for each input the config names that is not here (a hub id, data/gsm8k, outputs/…): the tiny stand-in
    of the same kind. Sizes and every other key stay as written."""
    root, out = s["root"], []
    paths = {"model.path": s["model"], "critic.model_path": s["model"], "reward.model_path": s["model"],
             "reward_model.model_path": s["model"], "reward_model.train_files": f"{root}/pairs.parquet",
             "reward_model.val_files": f"{root}/pairs.parquet",
             **{f"{stage}.{key}": value for stage in ("sft", "dpo") for key, value in (
                 ("model_path", s["model"]), ("train_files", f"{root}/pairs.parquet"),
                 ("val_files", f"{root}/pairs.parquet"), ("val_prompts", f"{root}/arithmetic.parquet"))}}
    flat = cli.flatten(cli.to_dict(cfg))
    policy = flat.get("model.path") if os.path.exists(str(flat.get("model.path"))) else s["model"]
    paths["algorithm.teacher.path"] = policy  # a teacher must share the policy's vocabulary
    for key in ("data.train_files", "data.val_files"):
        kind = next((k for k in ("gsm8k", "tool") if k in str(flat.get(key))), "arithmetic")
        paths[key] = {"gsm8k": f"{root}/gsm8k/train.parquet", "tool": f"{root}/tool.parquet",
                      "arithmetic": f"{root}/arithmetic.parquet"}[kind]
    out = [f"{k}={v}" for k, v in paths.items() if flat.get(k) and not os.path.exists(str(flat[k]))]
    if flat.get("reward.type") == "judge" or "judge" in (flat.get("reward.sources") or []):
        out.append(f"reward.judge.base_url={s['judge']}")
    if flat.get("rollout.server.url"):  # asked for its models at start-up: the stub lists one
        out.append(f"rollout.server.url={s['judge'].removesuffix('/v1')}")
    return out


def test_every_documented_launch_line_passes_its_check(tmp_path, stand_ins, monkeypatch, capsys):
    """Each launch command the README, examples/, slurm/ppo.sbatch and the entry points' docstrings show goes through
    `--check` for the process count it launches (accelerate's --num_processes, its config file's, an example's
    NUM_PROCESSES, sbatch's nodes × GPUs): its config, sizes, data, reward inputs and model folders pass, with no
    model loaded. The FSDP2 × 8 line, slurm's 16 processes and GRPO-LoRA on 8 GPUs were refused before (issue 29)."""
    import transformers

    import dpo
    import ppo
    import reward_model
    import sft
    from infra.config import Config, RewardModelStage
    from infra.config_offline import DPOStage, SFTStage
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail(f"{cls.__name__} loaded by --check")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "gsm8k").symlink_to(stand_ins["root"] / "gsm8k")
    (tmp_path / "bin").symlink_to(stand_ins["root"] / "bin")
    commands, counts, checked = documented_commands(), {}, {}
    assert len(commands) >= 15, commands
    for where, command in commands:
        processes, env, script, args = launched(accelerate_args(command, tmp_path))
        counts[command] = processes
        if (key := (processes, script, *args, *env.items())) in checked:  # the same launch, written elsewhere
            continue
        checked[key] = command
        module, root = {"ppo.py": (ppo, Config), "reward_model.py": (reward_model, RewardModelStage),
                        "sft.py": (sft, SFTStage), "dpo.py": (dpo, DPOStage)}[script]
        args += stand_in_overrides(cli.parse_args(args, module.__doc__, root), stand_ins)
        with monkeypatch.context() as m:
            for key, value in {**env, "WORLD_SIZE": str(processes)}.items():
                m.setenv(key, value)
            m.setattr(sys, "argv", [script, "--check", *args])
            try:
                cli.run_script(module.main, module.__doc__, root, script, check=module.check_only)
            except SystemExit as e:
                pytest.fail(f"{where}: `{command}` on {processes} processes: {e.code}")
        assert f"{script} --check: {processes} process(es)" in capsys.readouterr().out, (where, command)
    assert counts["NUM_PROCESSES=8 bash examples/gsm8k_qwen05b_grpo_lora.sh"] == 8
    assert counts["sbatch slurm/ppo.sbatch"] == 16
    assert counts["sbatch --nodes 4 slurm/ppo.sbatch trainer.total_steps=500"] == 32
    assert 8 in {p for c, p in counts.items() if "fsdp2.yaml" in c}


def test_the_check_refuses_what_the_run_would_refuse(stand_ins, monkeypatch, capsys):
    """`WORLD_SIZE=8 python ppo.py --check --config configs.yaml` (a tiny model and data): exit code 1 with the one
    sentence the run itself would stop with (the demo's 4 prompts do not divide over 8 processes), and no line of
    success."""
    import ppo
    from infra.config import Config
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--check", "--config", "configs.yaml", f"model.path={stand_ins['model']}",
                                      f"data.train_files={stand_ins['root']}/gsm8k/train.parquet", "data.val_files=null"])
    with pytest.raises(SystemExit) as stopped:
        cli.run_script(ppo.main, ppo.__doc__, Config, "ppo.py", check=ppo.check_only)
    assert stopped.value.code == "ppo.py: data.train_batch_size across processes: 4 is not divisible by 8"
    assert "--check:" not in capsys.readouterr().out
