"""Which TextArena games the env offers, and the one gold solver it ships.

GAMES are TextArena 0.7.4's single-player games that run offline (checked by the package's
tests): Wordle, Hangman, WordLadder, SpellingBee and other word games are left out because
they download NLTK corpora at reset, and multi-player games need opponents.
"""
from __future__ import annotations

GAMES = (
    "TowerOfHanoi-v0", "TowerOfHanoi-v0-medium", "GuessTheNumber-v0", "Mastermind-v0",
    "Minesweeper-v0-small", "Minesweeper-v0", "FifteenPuzzle-v0", "LightsOut-v0",
    "Sudoku-v0-very-easy", "Sudoku-v0", "FrozenLake-v0", "Sokoban-v0", "Countdown-v0",
    "Cryptarithm-v0", "PegJump-v0", "RushHour-v0", "Slitherlink-v0", "Bandit-v0",
    "Blackjack-v0", "Secretary-v0", "Crosswords-v0", "LogicPuzzle-v0",
)


def hanoi_moves(disks: int, source: str = "A", spare: str = "B", target: str = "C") -> list[tuple[str, str]]:
    """The optimal 2**disks - 1 moves that carry `disks` disks from `source` to `target`."""
    if disks == 0:
        return []
    return [*hanoi_moves(disks - 1, source, target, spare), (source, target),
            *hanoi_moves(disks - 1, spare, source, target)]
