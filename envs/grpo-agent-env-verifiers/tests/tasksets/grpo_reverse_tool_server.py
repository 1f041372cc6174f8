"""The test taskset's tool server, a verifiers `Toolset` in a module of its own.

verifiers 0.4.0 starts a task's toolset per rollout as `python -m <the Toolset class's module>`
in the rollout's runtime and waits (180 s) for the server to write its port to a file, so the
module must start the server when run as a program: the `__main__` block below, as `vf init
--add-tool` writes it. A Toolset defined in the taskset module, which has no such block, exits
at once and the episode ends with `toolset_error` "server did not report its port".
"""
import verifiers.v1 as vf


class ReverseToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "words"

    @vf.tool
    def reverse(self, word: str) -> str:
        """Return the word reversed."""
        return word[::-1]


if __name__ == "__main__":
    ReverseToolset.run()
