"""A task domain for the multi-host RL test: any policy, even an untrained one, earns graded
rewards on it, so nearly every group carries signal and the run advances a version per group.

The reward is the share of the completion's letters that are vowels; the prompts ask for
exactly that. Imported by name (`multihost_domain:VowelsDomain`) in the actors' processes,
which get this folder on their PYTHONPATH.
"""

from __future__ import annotations

from reinforge.envs.domain import TaskSpec, Tier, Verdict, check_tier

WORDS = ("apple", "river", "stone", "cloud", "ember", "ocean", "tiger", "maple")


class VowelsDomain:
    name = "vowels"
    description = "write a word heavy in vowels (graded: the share of vowels)"
    resource = "cpu"
    multi_turn = False
    tiers = (Tier(level=0, name="one", description="one word"),)

    def sample_task(self, rng, tier):
        check_tier(self, tier)
        return self.task_from_row({"word": rng.choice(WORDS)}, where="generated")

    def load_tasks(self, path):
        return []

    def task_from_row(self, row, *, where):
        word = str(row["word"])
        return TaskSpec(task_id=f"vowels-{word}", domain=self.name, tier=0,
                        prompt=f"Write a word like {word}, with as many vowels as you can.",
                        spec={"word": word}, reference="aeiou")

    def prompt(self, task):
        return task.prompt

    async def verify(self, task, completion):
        letters = [c for c in completion.lower() if c.isalpha()]
        share = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
        return Verdict(reward=share, outcome="pass" if share >= 0.5 else "fail",
                       reason=f"{share:.2f} of the letters are vowels")
