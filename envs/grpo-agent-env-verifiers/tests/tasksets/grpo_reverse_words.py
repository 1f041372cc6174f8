"""A verifiers 0.4.0 taskset for the tests (imported by verifiers in its venv, by id).

Reverse a word; `exact` (weight 1) when the reply is the reversed word, `short` (weight 0.5)
when the reply has at most 8 characters, so a reply's reward tells both rewards arrived.
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
    async def short(self, trace: vf.Trace) -> float:
        return float(0 < len(trace.last_reply) <= 8)


class ReverseConfig(vf.TasksetConfig):
    pass


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        return [ReverseTask(ReverseData(prompt=f"Reverse the word {word}. Reply with it only.",
                                        answer=word[::-1]), self.config.task) for word in WORDS]


__all__ = ["ReverseTaskset"]
