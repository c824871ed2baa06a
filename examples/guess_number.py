"""The environment of the environment demo (make env): guess a secret whole number from a range of ten, told higher
or lower after each guess, and the numbers it can still be. A whole file of what adding an environment takes
(agents/environments.py has the contract).

    python tools/prepare_data.py --task guess-number --output data/guess_number     # rows: the range, the secret
    accelerate launch ppo.py --config examples/guess_number.yaml

The rewards are strict, so that they cannot be gamed: 1 at the turn that names the secret, and 0.1 at each turn
whose guess could still be the secret (inside the range and what the answers so far left of it): the skill the game
asks for, paid turn by turn, never more than a win. A turn that is not one bare whole number ends the game
unrewarded (a reply that lists several numbers wins nothing). info["won"] is logged as env/won, the share won.
"""
import re

from agents.environments import Step

CONSISTENT = 0.1  # a guess the answers so far allow; four of them pay less than one win


class GuessNumber:
    def reset(self, row):
        game = row["extra_info"]
        self.secret, self.low, self.high = game["secret"], game["lo"], game["hi"]  # what the secret can still be
        return None  # the row's prompt (data.make_guess_number) is the first message

    def step(self, text):
        if not re.fullmatch(r"\d{1,3}", text.strip()):
            return Step([], reward=0.0, done=True, info={"won": False, "valid": False})
        guess = int(text.strip())
        possible = self.low <= guess <= self.high
        info = {"won": guess == self.secret, "valid": True, "possible": possible}
        if guess == self.secret:
            return Step([], reward=1.0, done=True, info=info)
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        answer = "higher" if guess < self.secret else "lower"
        return Step([{"role": "user", "content": f"{answer}: {self.low} to {self.high}"}],  # what it can still be
                    reward=CONSISTENT if possible else 0.0, info=info)
