"""The openenv env: OpenEnv environments stepped in process, their JSON actions through `step`."""
from __future__ import annotations

import textwrap

import pytest
from grpo_agent.plugins import load_environment

pytest.importorskip("openenv.core")

from grpo_agent_env_openenv import OpenEnvEnv
from grpo_agent_env_openenv.guess import GuessNumberEnvironment

# A typed-action OpenEnv env (the shape of `openenv init`'s echo template): its Action class is
# found from step()'s annotation, and a reward comes with every step.
TYPED_ENV = textwrap.dedent('''
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class WordAction(Action):
        word: str
        repeat: int = 1

    class WordObservation(Observation):
        echoed: str = ""
        length: int = 0

    class WordEnvironment(Environment):
        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)

        def reset(self):
            self._state = State(step_count=0)
            return WordObservation(echoed="ready")

        def step(self, action: WordAction, timeout_s=None, **kwargs) -> WordObservation:
            self._state.step_count += 1
            echoed = action.word * action.repeat
            return WordObservation(echoed=echoed, length=len(echoed), reward=0.25,
                                   done=self._state.step_count >= 2)

        @property
        def state(self):
            return self._state
''')


@pytest.fixture
def typed_env(tmp_path, monkeypatch):
    (tmp_path / "word_env.py").write_text(TYPED_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "word_env:WordEnvironment"


def test_gold_play_through_the_registry_wins_the_shipped_mcp_env():
    spec = load_environment("openenv", size=3, seed=5)
    rows = spec.load_dataset()
    assert rows["seed"] == [5, 6, 7]
    env = spec()
    prompt = env.reset(**rows[0])
    assert "from 1 to 64" in prompt and '"name": "guess"' in prompt, prompt
    assert env.get_reward() == 0.0
    spec.gold(env, rows[0])
    assert env.done and env.get_reward() == 1.0
    with pytest.raises(RuntimeError, match="The episode is over"):
        env.step({"type": "call_tool", "tool_name": "guess", "arguments": {"number": 1}})


def test_mcp_tool_calls_answer_and_the_seed_fixes_the_secret():
    env = OpenEnvEnv()
    env.reset(seed=11)
    secret = env.backend.env.secret
    assert isinstance(env.backend.env, GuessNumberEnvironment)
    low = env.step({"type": "call_tool", "tool_name": "guess", "arguments": {"number": 0}})
    assert low == "higher" and not env.done and env.get_reward() == 0.0
    assert "unknown tool" in env.step({"type": "call_tool", "tool_name": "nope", "arguments": {}}).lower()
    env.reset(seed=11)
    assert env.backend.env.secret == secret and env.get_reward() == 0.0  # reset clears the episode
    # a JSON string is accepted too (a model may write the object as a string)
    reply = env.step(f'{{"type": "call_tool", "tool_name": "guess", "arguments": {{"number": {secret}}}}}')
    assert reply.startswith("correct") and "episode over, reward 1.0" in reply
    assert env.get_reward() == 1.0


def test_running_out_of_guesses_ends_the_episode_unscored():
    """8 wrong guesses end the game with reward 0: only finding the number is rewarded."""
    from grpo_agent_env_openenv.guess import MAX_GUESSES

    env = OpenEnvEnv()
    env.reset(seed=3)
    game = env.backend.env
    wrong = next(n for n in range(1, 65) if n != game.secret)
    replies = [env.step({"type": "call_tool", "tool_name": "guess", "arguments": {"number": wrong}})
               for _ in range(MAX_GUESSES)]
    assert env.done and replies[-1].endswith("(episode over, reward 0.0)")
    assert not any(reply.endswith("(episode over, reward 0.0)") for reply in replies[:-1])
    assert env.get_reward() == 0.0
    assert game._guess(game.secret) == "The game is over."  # no 9th guess, even the right one


def test_the_model_reads_a_lone_text_field_as_itself_and_other_fields_as_json():
    from grpo_agent_env_openenv import observation_text

    assert observation_text({"observation": {"task": "Find it."}, "done": False}) == "Find it."
    assert observation_text({"observation": {"n": 3}, "done": True, "reward": 1.0}) == (
        '{"n": 3}\n(episode over, reward 1.0)')


def test_typed_action_env_gets_its_schema_and_sums_its_rewards(typed_env):
    env = load_environment("openenv", env=typed_env)()
    prompt = env.reset(seed=0)  # reset() without a seed parameter is called without one
    assert '"echoed": "ready"' in prompt and '"word"' in prompt and "WordAction" in prompt, prompt
    assert env.step({"word": "ab", "repeat": 2}) == '{"echoed": "abab", "length": 4}'
    assert env.get_reward() == 0.25 and not env.done
    with pytest.raises(Exception, match="word"):
        env.step({"repeat": 2})  # openenv's own validation: the required field is named
    assert env.step({"word": "c"}).endswith("(episode over, reward 0.25)")
    assert env.done and env.get_reward() == 0.5


def test_bad_env_and_action_options_say_what_to_write(typed_env):
    with pytest.raises(ValueError, match="must be 'module:Class'"):
        load_environment("openenv", env="word_env")()
    with pytest.raises(ValueError, match="No module named 'no_such_module'"):
        load_environment("openenv", env="no_such_module:X")()
    with pytest.raises(ValueError, match="is not an openenv Environment class"):
        load_environment("openenv", env="json:JSONDecoder")()
    with pytest.raises(ValueError, match="is not an openenv Action class"):
        load_environment("openenv", env=typed_env, action="json:JSONDecoder")()


def test_env_list_show_and_check_through_the_cli(capsys):
    from grpo_agent.cli.main import main

    def cli(*args: str) -> str:
        with pytest.raises(SystemExit) as done:
            main(list(args))
        out = capsys.readouterr().out
        assert not done.value.code, out
        return out

    assert "openenv-v1 (alias openenv)  [grpo-agent-env-openenv]" in cli("env", "list")
    out = cli("env", "show", "openenv", "--env-arg", "size=5")
    assert "env (str, default 'grpo_agent_env_openenv.guess:GuessNumberEnvironment')" in out
    assert "dataset: 5 rows, columns: seed" in out and '"name": "step"' in out
    assert "all 9 steps passed" in cli("env", "check", "openenv")
