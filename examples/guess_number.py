"""The environment of the environment demo (make env): guess a secret whole number from a range of ten, told higher
or lower after each guess. A whole file of what adding an environment takes (environments.py has the contract).

    python tools/prepare_data.py --task guess-number --output data/guess_number     # rows: the range, the secret
    accelerate launch ppo.py --config examples/guess_number.yaml

The reward is strict, so that it cannot be gamed: 1 at the turn that names the secret, nothing else; a turn that is
not one bare whole number ends the game unrewarded (a reply that lists several numbers wins nothing).
"""
import re

from environments import Step


class GuessNumber:
    def reset(self, row):
        game = row["extra_info"]
        self.secret, self.lo, self.hi, self.guesses = game["secret"], game["lo"], game["hi"], 0
        return None  # the row's prompt (data.make_guess_number) is the first message

    def step(self, text):
        if not re.fullmatch(r"\d{1,3}", text.strip()):
            return Step([], reward=0.0, done=True, info={"won": False, "valid": False})
        guess, self.guesses = int(text.strip()), self.guesses + 1
        info = {"won": guess == self.secret, "valid": True, "in_range": self.lo <= guess <= self.hi}
        if guess == self.secret:
            return Step([], reward=1.0, done=True, info=info)
        return Step([{"role": "user", "content": "higher" if guess < self.secret else "lower"}], info=info)
