"""Multi-turn rollouts, off by default (rollout.multi_turn): the loop over turns (multi_turn.py), the environments it
talks to (environments.py; the built-in tools, tools.py; verifiers', verifiers.py), each in a process of its own
(episodes.py). rollout.py reaches this folder by one table line; the default step never reads it."""
