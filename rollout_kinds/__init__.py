"""Rollout kinds beyond the two in rollout.py, off by default: a vLLM server process (server.py). rollout.KINDS names
each on one line; the default step never reads this folder."""
