"""What an environment may send, checked in agents/multi_turn.py before the chat template renders it: the roles of
its messages (a role is written with the template's control tokens live, so a role string could forge a turn), their
size (a 20 MB message is refused, not tokenised) and its rewards (finite, within reward.max_abs_score).
"""
import json
import math
from typing import Optional

RESET_ROLES = ("system", "user", "assistant", "tool")  # an episode's first messages: a whole prompt
STEP_ROLES = ("user", "tool")  # what follows a turn: never a system turn
CHARS_PER_TOKEN = 32  # more characters a token than any tokenizer's: the bound of a message's text before tokenising


def check_messages(messages: list[dict], roles: tuple, room: int, key: str, tools: Optional[list] = None) -> None:
    """A ValueError in one sentence unless every message's role is one of `roles` and the messages (with the tools'
    schemas, which the template writes too) could fit in the `room` tokens left of `key`: at least one token a
    message and one for every CHARS_PER_TOKEN characters."""
    chars = len(json.dumps(tools, default=str)) if tools else 0
    for m in messages:
        if m["role"] not in roles:
            raise ValueError(f"a message's role is {m['role'][:80]!r}; here it must be one of {', '.join(roles)}")
        chars += len(m["content"])
    if len(messages) + chars // CHARS_PER_TOKEN > room:
        raise ValueError(f"{len(messages)} messages of {chars} characters cannot fit in the {room} tokens left of "
                         f"{key} (at most {CHARS_PER_TOKEN} characters a token); refused before tokenising")


def bounded(reward: float, max_abs_score: float) -> float:
    """`reward` when it is finite and within ±max_abs_score (reward.max_abs_score), else a ValueError."""
    if not math.isfinite(reward) or abs(reward) > max_abs_score:
        raise ValueError(f"the reward {reward:g} is not a finite number within reward.max_abs_score={max_abs_score:g}")
    return reward
