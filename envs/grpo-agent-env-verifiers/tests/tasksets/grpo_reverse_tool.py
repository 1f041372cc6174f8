"""A verifiers 0.4.0 taskset whose task has a tool server (`vf.Toolset`, the ToolEnv of 0.1.x):
reverse a word with the `words_reverse` tool; `exact` (weight 1) when the last reply is the
reversed word."""
import verifiers.v1 as vf
from grpo_reverse_tool_server import ReverseToolset

WORDS = ["hello", "world"]


class ReverseData(vf.TaskData):
    answer: str


class ReverseToolTask(vf.Task[ReverseData]):
    @classmethod
    def toolsets(cls, config):
        return [ReverseToolset(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class ReverseToolConfig(vf.TasksetConfig):
    pass


class ReverseToolTaskset(vf.Taskset[ReverseToolTask, ReverseToolConfig]):
    def load(self):
        return [ReverseToolTask(ReverseData(prompt=f"Reverse the word {word} with the reverse tool.",
                                            answer=word[::-1]), self.config.task) for word in WORDS]


__all__ = ["ReverseToolTaskset"]
