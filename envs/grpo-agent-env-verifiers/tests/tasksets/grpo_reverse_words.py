"""A verifiers 0.4.0 taskset for the tests (imported by verifiers in its venv, by id).

Reverse a word; `exact` (weight 1) when the reply is the reversed word, `brevity` (weight 0.5)
falls from 1 to 0 as the reply grows to 40 characters, so a reply's reward tells both rewards
and their weights arrived (and a group's replies of different lengths score differently).
"""
import verifiers.v1 as vf

WORDS = ["hello", "world", "policy"]


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return max(0.0, 1.0 - len(trace.last_reply) / 40)


class ReverseConfig(vf.TasksetConfig):
    pass


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        return [ReverseTask(ReverseData(prompt=f"Reverse the word {word}. Reply with it only.",
                                        answer=word[::-1]), self.config.task) for word in WORDS]


__all__ = ["ReverseTaskset"]
