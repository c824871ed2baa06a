"""config.py and cli.py: the dataclasses are the one source of defaults (configs.yaml is generated from them);
overrides are typed and checked; each entry point has its own keys."""
import subprocess
import sys

import pytest

from infra import cli
from infra import config
from conftest import REPO


def test_configs_yaml_is_generated_from_the_dataclasses():
    """configs.yaml is what `python tools/configs_yaml.py` writes from the dataclasses (their defaults and docs): edit a default
    in infra/config.py, regenerate, and this passes again; edit configs.yaml by hand and it fails."""
    with open(f"{REPO}/configs.yaml") as f:
        assert f.read() == cli.to_yaml(), "configs.yaml is stale: run `python tools/configs_yaml.py > configs.yaml`"
    for root in (config.Config, config.RewardModelStage):
        assert cli.to_dict(cli.load_config(f"{REPO}/configs.yaml", root=root)) == cli.to_dict(root())


def test_every_field_has_a_docstring():
    """Each key of both entry points has a one-line description: the docstring under the field (or its base's)."""
    for root in (config.Config, config.RewardModelStage):
        docs = cli.field_docs(root)
        assert set(docs) == set(cli.all_keys(root))
        assert all(text.strip() for text in docs.values())


def test_each_entry_point_has_its_own_keys():
    """ppo.py knows no reward_model.* key and reward_model.py no PPO key; LoRA and run fields are shared, with the
    reward model's own defaults."""
    with pytest.raises(config.ConfigError, match="unknown config key `reward_model.lora_rank`"):
        cli.load_config(f"{REPO}/configs.yaml", ["reward_model.lora_rank=4"])
    with pytest.raises(config.ConfigError, match="unknown config key `trainer.total_steps`"):
        cli.load_config(f"{REPO}/configs.yaml", ["trainer.total_steps=4"], root=config.RewardModelStage)
    rm = cli.load_config(None, ["reward_model.lora_rank=4"], root=config.RewardModelStage).reward_model
    assert (rm.lora_rank, rm.lora_alpha, rm.output_dir) == (4, 32, "outputs/reward_model")
    assert cli.field_docs(config.RewardModelStage)["reward_model.lora_alpha"] == \
        cli.field_docs(config.Config)["model.lora_alpha"]


def test_dotted_overrides_are_parsed_and_typed():
    """Numbers, booleans, lists, nested keys and null all come through with their declared types."""
    cfg = cli.load_config(f"{REPO}/configs.yaml", [
        "trainer.total_steps=20", "actor.optim.lr=1e-6", "algorithm.kl_ctrl.type=adaptive",
        "model.target_modules=q_proj,v_proj", "data.shuffle=false", "reward.clip=null", "actor.optim.betas=[0.8, 0.9]"])
    assert cfg.trainer.total_steps == 20 and cfg.actor.optim.lr == 1e-6
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.model.target_modules == ["q_proj", "v_proj"]
    assert cfg.data.shuffle is False and cfg.reward.clip is None and cfg.actor.optim.betas == [0.8, 0.9]


@pytest.mark.parametrize("override, message", [
    ("trainer.total_step=3", "unknown config key `trainer.total_step`; did you mean `trainer.total_steps`?"),
    ("trainer.total_steps=1.5", "`trainer.total_steps` must be an integer"),
    ("data.shuffle=maybe", "`data.shuffle` must be true or false"),
    ("actor.optim=3", "config section `actor.optim` must be a mapping"),
    ("total_steps", "must look like key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    """A wrong key or value fails with one sentence that names it (and the nearest valid key)."""
    with pytest.raises(config.ConfigError) as e:
        cli.load_config(f"{REPO}/configs.yaml", [override])
    assert message in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator='ppo' is not one of gae, grpo, rloo, reinforce_plus_plus"),
    ("actor.policy_loss=ppo2", "actor.policy_loss='ppo2' is not one of vanilla"),
    ("algorithm.kl_penalty=k4", "algorithm.kl_penalty='k4' is not one of k1, k2, k3, abs"),
    ("algorithm.kl_loss_type=k5", "algorithm.kl_loss_type='k5' is not one of k1, k2, k3, abs"),  # verl's low_var_kl is k3
])
def test_a_name_outside_its_table_fails_at_start_up(override, message):
    """A name that picks a function from a stage's table (advantages.ESTIMATORS, losses.POLICY_LOSSES,
    kl.ESTIMATORS) and is not in it fails in ppo.check_names, the first thing main does, naming the table's
    entries: never a silent fallback to another estimator."""
    import ppo
    with pytest.raises(config.ConfigError) as e:
        ppo.check_names(cli.load_config(None, [override]))
    assert message in str(e.value)


def test_missing_config_file():
    with pytest.raises(config.ConfigError, match="config file nope.yaml does not exist"):
        cli.load_config("nope.yaml")


def test_help_lists_every_key():
    """`python ppo.py --help` prints each key with its default and description, and exits 0."""
    out = subprocess.run([sys.executable, "ppo.py", "--help"], cwd=REPO, capture_output=True, text=True, check=True)
    assert f"trainer.total_steps ({config.Config().trainer.total_steps}) — training steps" in out.stdout
    assert all(key in out.stdout for key in cli.all_keys(config.Config))


# ---- value ranges, malformed files, and what may change on resume (issue 12)


@pytest.mark.parametrize("override, message", [
    ("actor.optim.lr=-1e-6", "`actor.optim.lr` must be in (0, inf), got -1e-06"),
    ("actor.optim.lr=nan", "`actor.optim.lr` must be in (0, inf), got nan"),
    ("rollout.temperature=-1", "`rollout.temperature` must be in [0, inf), got -1.0"),
    ("data.train_batch_size=0", "`data.train_batch_size` must be in [1, inf), got 0"),
    ("actor.ppo_micro_batch_size_per_device=-2", "`actor.ppo_micro_batch_size_per_device` must be in [1, inf)"),
    ("rollout.n=0", "`rollout.n` must be in [1, inf), got 0"),
    ("rollout.max_response_length=0", "`rollout.max_response_length` must be in [1, inf)"),
    ("model.lora_rank=-8", "`model.lora_rank` must be in [0, inf), got -8"),
    ("rollout.top_p=0", "`rollout.top_p` must be in (0, 1], got 0.0"),
    ("rollout.top_p=1.5", "`rollout.top_p` must be in (0, 1], got 1.5"),
    ("trainer.total_steps=0", "`trainer.total_steps` must be in [1, inf), got 0"),
    ("actor.optim.betas=[0.9, 1.0]", "`actor.optim.betas` must be in [0, 1), got 1.0"),
    ("reward_model.batch_size=-16", "`reward_model.batch_size` must be in [1, inf)"),
])
def test_numbers_out_of_range_name_the_key_and_the_range(override, message):
    """Every number is checked against its interval when the config is loaded: the sentence names the key,
    the interval and the value."""
    root = config.RewardModelStage if override.startswith("reward_model.") else config.Config
    with pytest.raises(config.ConfigError) as e:
        cli.load_config(f"{REPO}/configs.yaml", [override], root=root)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_range_names_a_numeric_field_and_the_defaults_pass():
    """RANGES names only numeric fields (a typo would silently check nothing), and the defaults are in range."""
    defaults = {key: value for root in cli.ROOTS for key, value in cli.to_dict(root()).items()}  # every entry point
    numeric = {key.rsplit(".", 1)[-1] for key, value in cli.flatten(defaults).items()
               if isinstance(value, (int, float, list)) and not isinstance(value, bool)} | {"clip"}
    assert set(config.RANGE_OF) <= numeric, set(config.RANGE_OF) - numeric
    cli.check_ranges(config.Config())
    assert cli.load_config(None, ["reward.overlong_penalty=-1", "rollout.top_k=-1", "reward.clip=null"])


@pytest.mark.parametrize("text, message", [
    ("- model\n- data\n", "must hold a mapping of sections (model:, data:, …), got ['model', 'data']"),
    ("3\n", "must hold a mapping of sections (model:, data:, …), got 3"),
    ("model: 3\n", "config section `model` must be a mapping, got 3"),
    ("model: 0\n", "config section `model` must be a mapping, got 0"),
    ("model: [a]\n", "config section `model` must be a mapping, got ['a']"),
])
def test_a_yaml_file_that_is_not_a_mapping_of_sections(tmp_path, text, message):
    """A top level that is not a mapping, or a scalar where a section belongs, fails naming it (a falsy
    scalar such as 0 too: it used to read as an empty section)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        cli.load_config(str(path))
    assert message in str(e.value)


def test_an_override_into_a_scalar_section_and_a_folder_as_config(tmp_path):
    """`model.path=x` on top of `model: 3` fails rather than replacing the scalar; a folder as --config says so."""
    (tmp_path / "c.yaml").write_text("model: 3\n")
    with pytest.raises(config.ConfigError, match="config section `model` must be a mapping, got 3"):
        cli.load_config(str(tmp_path / "c.yaml"), ["model.path=x"])
    with pytest.raises(config.ConfigError, match="cannot be read: Is a directory"):
        cli.load_config(str(tmp_path))


def test_resume_changes_list_free_keys_and_refuse_fixed_ones(tmp_path):
    """Against the saved config.yaml: lr and total_steps may change and are listed "key old → new"; a LoRA rank
    may not (one sentence), for PPO's keys and the reward model's alike; the critic's backbone only where there
    is a critic."""
    saved = tmp_path / "config.yaml"
    cli.save(cli.load_config(None, ["actor.optim.lr=1e-3"]), str(saved))
    now = cli.load_config(None, ["actor.optim.lr=5e-4", "trainer.total_steps=90"])
    assert cli.resume_changes(now, str(saved)) == ["actor.optim.lr 0.001 → 0.0005", "trainer.total_steps 60 → 90"]
    with pytest.raises(config.ConfigError, match="`model.lora_rank` cannot change on resume"):
        cli.resume_changes(cli.load_config(None, ["model.lora_rank=8"]), str(saved))
    grpo = tmp_path / "grpo.yaml"  # no critic: its backbone is not fixed
    cli.save(cli.load_config(None, ["algorithm.adv_estimator=grpo"]), str(grpo))
    assert cli.resume_changes(cli.load_config(None, ["algorithm.adv_estimator=grpo", "critic.model_path=x"]),
                              str(grpo), unused=frozenset({"critic.model_path"})) == ["critic.model_path None → 'x'"]
    with pytest.raises(config.ConfigError, match="`critic.model_path` cannot change on resume"):
        cli.resume_changes(cli.load_config(None, ["critic.model_path=x"]), str(saved))
    rm_saved = tmp_path / "rm.yaml"
    cli.save(cli.load_config(None, root=config.RewardModelStage), str(rm_saved))
    with pytest.raises(config.ConfigError, match=r"`reward_model.lora_rank` cannot change on resume \(it was 16"):
        cli.resume_changes(cli.load_config(None, ["reward_model.lora_rank=4"], root=config.RewardModelStage),
                           str(rm_saved))


def test_a_section_keeps_its_parents_defaults_when_one_key_is_set(tmp_path):
    """actor.optim's default schedule is constant (ActorConfig's default_factory), OptimConfig's own is cosine: an
    override of actor.optim.lr, alone or in a file that sets nothing else, keeps the actor's constant schedule."""
    assert cli.load_config(None, ["actor.optim.lr=1e-3"]).actor.optim.lr_scheduler == "constant"
    small = tmp_path / "small.yaml"
    small.write_text("actor:\n  optim:\n    lr: 0.001\n")
    cfg = cli.load_config(str(small))
    assert (cfg.actor.optim.lr, cfg.actor.optim.lr_scheduler) == (0.001, "constant")
    assert cfg.critic.optim.warmup_ratio == 0.0
    assert cli.load_config(str(small)).critic.optim == config.Config().critic.optim
