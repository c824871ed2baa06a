"""Scorers beyond the rule and the function, off by default (reward.sources): a reward model (model.py), an LLM judge
(judge.py), a remote reward server (remote.py); and a reward function's step rewards on tokens (steps.py).
rewards.SCORERS (and STEP_REWARDS) names each on one line; the default step never reads this folder."""
