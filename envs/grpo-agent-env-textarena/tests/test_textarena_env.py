"""The textarena env: TextArena's own games and outcomes, every move through the `move` tool."""
from __future__ import annotations

import pytest
from grpo_agent.plugins import OptionError, load_environment
from grpo_agent_env_textarena import TextArenaEnv
from grpo_agent_env_textarena.games import GAMES, hanoi_moves

pytest.importorskip("textarena")

# The first four optimal moves put the largest disk on C; then disk 1 shuttles between A and B.
# TowerOfHanoi-v0 ends after its 15th move (max_turns=14 is checked before the turn counts).
HANOI_PARTIAL = [("A", "C"), ("A", "B"), ("C", "B"), ("A", "C")] + [("B", "A"), ("A", "B")] * 5 + [("B", "A")]


@pytest.mark.parametrize("game", GAMES)
def test_every_offered_game_resets_offline_and_answers_a_move(game):
    env = TextArenaEnv(game=game)
    prompt = env.reset(seed=7)
    assert len(prompt) > 40 and "move` tool" in prompt, prompt
    reply = env.move("[1 1]")  # legal or not, the game answers (an invalid move is feedback)
    assert isinstance(reply, str) and reply, game


def test_gold_play_through_the_registry_wins_with_reward_1():
    spec = load_environment("textarena", size=3, seed=5)
    rows = spec.load_dataset()
    assert rows["seed"] == [5, 6, 7]
    env = spec()
    assert "Tower of Hanoi with 3 disks" in env.reset(**rows[0])
    assert env.get_reward() == 0.0  # nothing played yet
    spec.gold(env, rows[0])
    assert env.done and env.get_reward() == 1.0
    assert len(hanoi_moves(3)) == 7 and len(hanoi_moves(4)) == 15
    with pytest.raises(RuntimeError, match="The game is over"):
        env.move("[A C]")


def test_turn_limit_gives_textarenas_partial_score_and_invalid_moves_its_penalty():
    env = TextArenaEnv()
    env.reset(seed=0)
    replies = [env.move(f"[{a} {b}]") for a, b in HANOI_PARTIAL]  
    assert "Game over" in replies[-1] and "33%" in replies[-1]
    assert env.get_reward() == pytest.approx(1 / 3)  # the largest disk sits on C

    env.reset(seed=0)
    env.move("[A C]")
    warned = env.move("[A C]")  # a larger disk onto a smaller one: a warning first
    assert "invalid move" in warned and not env.done
    assert "Game over" in env.move("[A C]") and env.get_reward() == 0.0


def test_unfinished_game_scores_zero_and_unknown_games_are_refused():
    env = TextArenaEnv(game="TowerOfHanoi-v0")
    env.reset(seed=0)
    for a, b in hanoi_moves(3)[:-1]:
        env.move(f"{a} {b}")  # brackets added by TextArena's ActionFormattingWrapper
    assert not env.done and env.get_reward() == 0.0
    env.move("A C")
    assert env.get_reward() == 1.0
    with pytest.raises(OptionError, match="Option 'game' of environment 'textarena' has no choice 'Wordle-v0'"):
        load_environment("textarena", game="Wordle-v0")


def test_env_list_and_show_through_the_cli(capsys):
    from grpo_agent.cli.main import main

    def cli(*args: str) -> str:
        with pytest.raises(SystemExit) as done:
            main(list(args))
        out = capsys.readouterr().out
        assert not done.value.code, out
        return out

    assert "textarena-v1 (alias textarena)  [grpo-agent-env-textarena]" in cli("env", "list")
    out = cli("env", "show", "textarena", "--env-arg", "game=Mastermind-v0", "--env-arg", "size=5")
    assert "game (str, default 'TowerOfHanoi-v0'): TextArena single-player game id  [now 'Mastermind-v0']" in out
    assert "TowerOfHanoi-v0, TowerOfHanoi-v0-medium, GuessTheNumber-v0" in out
    assert "dataset: 5 rows, columns: seed" in out and '"name": "move"' in out
