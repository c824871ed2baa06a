"""A verifiers SingleTurnEnv (verifiers 0.3.1) to train on as it is, the README's example of the verifiers route:
"What is i + 1?", its rubric paying the exact answer (weight 1), a short one (0.5) and one turn (0.25). Its rows:
`python tools/prepare_data.py --task verifiers:examples/verifiers_add_one.py --output data/add_one`; the run:
`accelerate launch ppo.py --config examples/verifiers_add_one.yaml`.
"""
import verifiers as vf
from datasets import Dataset

def load_environment():
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    def exact(completion, answer, **kwargs):
        return float(completion[-1]["content"].strip() == answer)
    def short(completion, **kwargs):
        return float(len(completion[-1]["content"]) <= 2)
    def answered(completion, **kwargs):
        return float(len(completion) == 1)
    rubric = vf.Rubric(funcs=[exact, short, answered], weights=[1.0, 0.5, 0.25])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:4]),
                            system_prompt="Answer with the number.", rubric=rubric)
