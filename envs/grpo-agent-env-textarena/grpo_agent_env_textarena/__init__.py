"""TextArena's single-player text games as a grpo-agent env: `--env textarena --env-arg game=...`.

Design decision: the game is played through one tool, `move(action)`, so every move is a tool
call the rollout records and a multi-turn episode is one rollout; the tool returns what the
game said (board, feedback, invalid-move warnings) since the last move. The reward is
TextArena's own outcome for player 0 when the game ends (1 for a win, the game's partial score
or penalty otherwise); a game left unfinished when the rollout stops scores 0. Rows are seeds,
so a split is reproducible. textarena is imported lazily: plugins load at CLI start-up.
"""
from __future__ import annotations

from grpo_agent import Option, environment, hookimpl

from grpo_agent_env_textarena.games import GAMES, hanoi_moves

INSTRUCTION = "\n\nPlay with the `move` tool: call it once per move, with the move as its argument."


def seed_rows(game: str, size: int, seed: int):
    """`size` rows, one game seed each (`seed`, `seed + 1`, ...)."""
    from datasets import Dataset

    if size < 1:
        raise ValueError(f"textarena dataset size must be at least 1, got {size}.")
    return Dataset.from_dict({"seed": list(range(seed, seed + size))})


def solve(env: TextArenaEnv, row: dict) -> None:
    """Gold play for `grpo-agent env check`: the optimal Tower of Hanoi solution."""
    from grpo_agent.plugins.check import NoGoldAnswer

    if not env.game.startswith("TowerOfHanoi"):
        raise NoGoldAnswer(f"no solver for {env.game}; only the TowerOfHanoi games ship one")
    for source, target in hanoi_moves(len(env.arena.state.game_state["towers"]["A"])):
        env.move(f"[{source} {target}]")


@environment(
    "textarena",
    version=1,
    dataset=seed_rows,
    tool_examples={"move": {"action": "[A C]"}},
    gold=solve,
    options=[
        Option("game", str, "TowerOfHanoi-v0", "TextArena single-player game id", choices=GAMES),
        Option("size", int, 1000, "rows (game seeds) in the dataset"),
        Option("seed", int, 0, "first game seed"),
    ],
    description="TextArena single-player text games (--env-arg game=ID); every move is a move() tool call.",
)
class TextArenaEnv:
    """One TextArena game per rollout, played move by move through the `move` tool."""

    def __init__(self, game: str = "TowerOfHanoi-v0", size: int = 1000, seed: int = 0):
        self.game = game

    def reset(self, seed: int, **row) -> str:
        import textarena as ta

        self.arena = ta.wrappers.ActionFormattingWrapper(ta.make(f"{self.game}-raw"))
        self.arena.reset(num_players=1, seed=seed)
        self.done = False
        return self._news() + INSTRUCTION

    def get_reward(self) -> float:
        return float(self.arena.state.rewards[0]) if self.done else 0.0

    def move(self, action: str) -> str:
        """
        Make one move in the game and return what the game answers.

        Args:
            action: The move, in the notation the game's rules give (for example `[A C]`).

        Returns:
            The game's feedback and board after the move, and the outcome when the game ends.
        """
        if self.done:
            raise RuntimeError("The game is over; no more moves are accepted.")
        self.done, _ = self.arena.step(action)
        news = self._news()
        if self.done:
            reason = self.arena.state.game_info[0].get("reason", "")
            news += f"\nGame over: {reason} Reward: {self.arena.state.rewards[0]}"
        return news

    def _news(self) -> str:
        """Messages since the last call, without the echo of the player's own move."""
        from textarena import ObservationType

        _, observations = self.arena.get_observation()
        news = []
        for parts in observations:  # (sender, text, kind); some games pass them out of order
            if ObservationType.PLAYER_ACTION not in parts:
                news += [part.strip() for part in parts if isinstance(part, str)]
        return "\n".join(news).strip()


@hookimpl
def register_environments(register):
    register(TextArenaEnv)
