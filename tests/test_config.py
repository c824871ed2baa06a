"""config.py: configs.yaml is the single source of defaults; overrides are typed and checked."""
import subprocess
import sys

import pytest

import config
from conftest import REPO


def test_configs_yaml_equals_the_documented_defaults():
    """configs.yaml and the dataclass defaults (which `--help` prints) say the same thing."""
    assert config.to_dict(config.load_config(f"{REPO}/configs.yaml")) == config.to_dict(config.Config())


def test_every_field_has_a_docstring():
    """Each key has a one-line description: the docstring under the field."""
    docs = config.field_docs(config.Config)
    assert set(docs) == set(config.all_keys(config.Config))
    assert all(text.strip() for text in docs.values())


def test_dotted_overrides_are_parsed_and_typed():
    """Numbers, booleans, lists, nested keys and null all come through with their declared types."""
    cfg = config.load_config(f"{REPO}/configs.yaml", [
        "trainer.total_steps=20", "actor.optim.lr=1e-6", "algorithm.kl_ctrl.type=adaptive",
        "model.target_modules=q_proj,v_proj", "data.shuffle=false", "reward.clip=null", "actor.optim.betas=[0.8, 0.9]"])
    assert cfg.trainer.total_steps == 20 and cfg.actor.optim.lr == 1e-6
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.model.target_modules == ["q_proj", "v_proj"]
    assert cfg.data.shuffle is False and cfg.reward.clip is None and cfg.actor.optim.betas == [0.8, 0.9]


@pytest.mark.parametrize("override, message", [
    ("trainer.total_step=3", "unknown config key `trainer.total_step`; did you mean `trainer.total_steps`?"),
    ("algorithm.adv_estimator=ppo", "`algorithm.adv_estimator` must be one of ['gae', 'grpo', 'rloo'], got 'ppo'"),
    ("trainer.total_steps=1.5", "`trainer.total_steps` must be an integer"),
    ("data.shuffle=maybe", "`data.shuffle` must be true or false"),
    ("actor.optim=3", "config section `actor.optim` must be a mapping"),
    ("total_steps", "must look like key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    """A wrong key or value fails with one sentence that names it (and the nearest valid key)."""
    with pytest.raises(config.ConfigError) as e:
        config.load_config(f"{REPO}/configs.yaml", [override])
    assert message in str(e.value)


def test_missing_config_file():
    with pytest.raises(config.ConfigError, match="config file nope.yaml does not exist"):
        config.load_config("nope.yaml")


def test_help_lists_every_key():
    """`python ppo.py --help` prints each key with its default and description, and exits 0."""
    out = subprocess.run([sys.executable, "ppo.py", "--help"], cwd=REPO, capture_output=True, text=True, check=True)
    assert f"trainer.total_steps ({config.Config().trainer.total_steps}) — PPO steps" in out.stdout
    assert all(key in out.stdout for key in config.all_keys(config.Config))
