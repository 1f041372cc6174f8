"""`grpo-agent train`'s own rules before and around the run (train/run.py): which checkpoint a
resume names, the server it uses or starts, SIGTERM as an exit, the eval split's threshold and
the rows an agent program gets. No server starts: `ManagedVLLMServer` is the faked seam."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import ClassVar

import pytest
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.train import run


@pytest.mark.parametrize(("explicit", "configured", "expected"), [
    (None, "last", True), (None, "TRUE", True), (None, "False", None), (None, "none", None),
    (None, "", None), (None, "out/checkpoint-4", "out/checkpoint-4"), (True, None, True),
    ("out/checkpoint-2", "last", "out/checkpoint-2"), (False, "last", False),
])
def test_the_resume_argument(tmp_path, explicit, configured, expected):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), resume_from_checkpoint=configured)
    assert run._resume_arg(explicit, config) == expected


class _Recorded:
    started: ClassVar[list[dict]] = []

    def __init__(self, model, **kwargs):
        self.started.append(kwargs)
        self.base_url, self.pid, self.log_path = "http://127.0.0.1:1", 1, "/tmp/vllm-1.log"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.fixture
def servers(monkeypatch):
    from grpo_agent.sampler import server as server_module

    _Recorded.started = []
    monkeypatch.setattr(server_module, "ManagedVLLMServer", _Recorded)
    monkeypatch.setattr(server_module, "managed_max_model_len", lambda *args: 64)
    monkeypatch.setattr(run, "_core_split", lambda: None)
    return _Recorded.started


def test_a_given_server_url_is_used_and_none_is_started(tmp_path, servers):
    config = AsyncGRPOConfig(output_dir=str(tmp_path))
    with run._server(str(tmp_path), "http://gpu-box:8000", {"r": 8}, config) as url:
        assert url == "http://gpu-box:8000"
    assert servers == []


def test_starting_a_server_says_so_with_its_log_before_the_wait(tmp_path, servers, capsys):
    """The CLI prints no INFO logs: a server's minute-long start was silent, as if hung."""
    config = AsyncGRPOConfig(output_dir=str(tmp_path))
    with run._server(str(tmp_path), None, None, config):
        said = capsys.readouterr().err
        assert f"starting a vLLM server for {tmp_path}" in said and "its log: /tmp/vllm-1.log" in said
        assert "vLLM server ready at http://127.0.0.1:1 (pid 1)" in said
    with run._server(str(tmp_path), "http://gpu-box:8000", None, config):
        assert capsys.readouterr().err == ""


def test_a_lora_run_starts_its_server_with_room_for_every_live_adapter(tmp_path, servers):
    from grpo_agent.weight_sync.lora_needs import server_lora_rank

    config = AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=3)
    with run._server(str(tmp_path), None, {"r": 8}, config) as url:
        assert url == "http://127.0.0.1:1"
    assert servers[0]["enable_lora"] is True and servers[0]["max_loras"] == 3 + 2
    assert servers[0]["max_lora_rank"] == server_lora_rank(8)
    assert servers[0]["dtype"] == "float32" and servers[0]["max_model_len"] == 64
    with run._server(str(tmp_path), None, None, config):
        pass
    assert "enable_lora" not in servers[1]


def test_cores_are_split_only_for_a_cpu_server_without_the_users_binding(monkeypatch):
    import torch
    from grpo_agent.sampler.cpu_cores import OMP_BIND_ENV

    monkeypatch.setattr(run, "split_cores", lambda: "split")
    monkeypatch.delenv(OMP_BIND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run._core_split() == "split"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run._core_split() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(OMP_BIND_ENV, "0-3")
    assert run._core_split() is None


def test_sigterm_exits_like_ctrl_c_inside_the_run_and_is_restored_after():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited, run._exit_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode: it ends this sleep
    assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_sigterm_is_left_alone():
    seen = []

    def in_thread():
        with run._exit_on_sigterm():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == [before]


def test_a_threshold_set_in_the_config_beats_the_envs(tmp_path):
    task = {"success_threshold": 0.5, "eval_dataset": lambda: ["row"]}
    config = AsyncGRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=2,
                             eval_success_threshold=0.9)
    assert run._eval_split(task, config) == ["row"] and config.eval_success_threshold == 0.9


class _PromptOnlyEnv:
    """reset() writes the question; no tools, no get_reward: an agent can play it."""

    def reset(self, **row):
        return f"What is {row['n']} + 1?"


class _ScoredEnv(_PromptOnlyEnv):
    def answer(self, text: str) -> str:
        return text

    def get_reward(self) -> float:
        return 1.0


def _task(factory, dataset, eval_rows=None):
    return {"id": "probe-v1", "dataset": dataset, "environment_factory": factory,
            "eval_dataset": lambda: eval_rows}


def test_an_agent_gets_rows_with_the_prompt_reset_writes():
    rows = Dataset.from_dict({"prompt": [[{"role": "system", "content": "Be brief."}]], "n": [2]})
    evals = Dataset.from_dict({"n": [7]})
    task = run.agent_task(_task(_PromptOnlyEnv, rows, evals))
    assert task["dataset"][0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is 2 + 1?"}]
    assert task["eval_dataset"]()[0]["prompt"] == [{"role": "user", "content": "What is 7 + 1?"}]
    assert run.agent_task(_task(_PromptOnlyEnv, rows))["eval_dataset"]() is None
    bare = run.agent_task(_task(_PromptOnlyEnv, Dataset.from_dict({"n": [3]})))  # no 'prompt' column
    assert bare["dataset"][0]["prompt"] == [{"role": "user", "content": "What is 3 + 1?"}]


def test_an_env_without_a_factory_passes_rows_with_a_prompt_and_refuses_rows_without():
    rows = Dataset.from_dict({"prompt": ["2+2?"]})
    task = _task(None, rows)
    assert run.agent_task(task) is task
    with pytest.raises(run.AgentEnvError, match=r"has rows with columns \['question'\], no 'prompt'"
                                                r" column\. An agent program"):
        run.agent_task(_task(None, Dataset.from_dict({"question": ["2+2?"]})))


def test_an_env_whose_tools_or_routing_score_it_is_refused_naming_them():
    rows = Dataset.from_dict({"prompt": ["2+2?"], "n": [1]})
    with pytest.raises(run.AgentEnvError, match=r"reward comes from its own answer\(\) tool and "
                                                r"get_reward\(\)\..*Train 'probe-v1' without --agent"):
        run.agent_task(_task(_ScoredEnv, rows))
    with pytest.raises(run.AgentEnvError, match=r"its own environments \(a dict routing rows"):
        run.agent_task(_task({"a": _PromptOnlyEnv}, rows))


def test_a_model_without_a_stated_context_gets_the_wanted_server_length(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda path: transformers.PretrainedConfig())
    from grpo_agent.sampler import server

    assert server.managed_max_model_len("org/model", 16) == server.MANAGED_MAX_MODEL_LEN
    assert server.managed_max_model_len("org/model", 2048) == 2048 + server.PROMPT_ROOM


def test_an_env_without_a_dataset_and_without_max_steps_is_refused_before_a_server_starts(
        tmp_path, capsys, monkeypatch):
    """`grpo-agent train --env counter` (reset samples its own tasks) without max_steps started the
    managed server and loaded the model (2 minutes on a loaded 2-core box) before failing as "the
    run failed: ValueError: ... set max_steps > 0", with advice to read error.log."""
    from grpo_agent.cli.main import main
    from grpo_agent.plugins import manager

    monkeypatch.setenv(manager.LOAD_ENV, "counter")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "counter", "--output-dir", str(out),
              "--vllm-url", "http://127.0.0.1:9"])  # never contacted
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert ("The env 'counter-v1' has no dataset (its reset() samples its own tasks), so the run "
            "length is unknown: pass --set max_steps=N") in message, message
    assert "the run failed" not in message and not (out / "config.json").exists(), message


def test_a_model_folder_that_does_not_exist_is_refused_before_the_run_starts(tmp_path, capsys):
    """`train --model runs/x/final` failed as "the run failed: OSError: Repo id must be in the
    form 'repo_name' or 'namespace/repo_name'" after writing the run's config."""
    from grpo_agent.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "words", "--model", str(tmp_path / "x" / "final"), "--set",
              "max_steps=1", "--output-dir", str(out), "--vllm-url", "http://127.0.0.1:9"])
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert f"--model {tmp_path / 'x' / 'final'}: no such folder." in message, message
    assert "the run failed" not in message and not (out / "config.json").exists(), message


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_runs_output_directory_as_the_model_is_refused_before_the_run_starts(tmp_path, capsys,
                                                                              dry_run):
    """`train --model OUTPUT_DIR` (a run's folder, not its final/) failed as "the run failed:
    ValueError: Unrecognized model in OUTPUT_DIR. Should have a `model_type` key in its
    config.json" (the run's config.json) after writing the new run's config."""
    from grpo_agent.cli.main import main

    earlier, out = tmp_path / "earlier", tmp_path / "run"
    earlier.mkdir()
    (earlier / "config.json").write_text(AsyncGRPOConfig(output_dir=str(earlier)).to_json_string())
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "words", "--model", str(earlier), "--set", "max_steps=1",
              "--output-dir", str(out), "--vllm-url", "http://127.0.0.1:9",
              *(["--dry-run"] if dry_run else [])])
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert message.startswith(
        f"Error: --model {earlier} is a run's output directory, not a model: pass "
        f"{earlier / 'final'} (the model it saved at the end) or one of its checkpoint-N "
        "folders."), message
    assert not (out / "config.json").exists(), message


def test_a_final_save_cut_short_is_refused_as_the_model(tmp_path, capsys):
    """`OUTPUT_DIR/final.incomplete` (a final save that Ctrl-C or a kill cut short) may hold a
    model's config.json without its weights: refused by name, before the run starts."""
    from grpo_agent.cli.main import main

    partial, out = tmp_path / "earlier" / "final.incomplete", tmp_path / "run"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "words", "--model", str(partial), "--set", "max_steps=1",
              "--output-dir", str(out), "--vllm-url", "http://127.0.0.1:9"])
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert message.startswith(
        f"Error: --model {partial} is a final model save that was cut short (Ctrl-C, a kill), "
        "not a whole model: pass one of that run's checkpoint-N folders instead."), message
    assert not (out / "config.json").exists(), message


def _train_output(model, out, stderr_on_terminal: bool) -> str:
    """stdout and stderr of `grpo-agent train` loading `model` (then stopping: no server at
    --vllm-url), with stderr a pipe or a terminal (a pty)."""
    return _cli_output(["train", "--env", "words", "--model", str(model), "--vllm-url",
                        "http://127.0.0.1:9", "--set", "max_steps=1", "--set",
                        "vllm_server_timeout=1", "--output-dir", str(out)], stderr_on_terminal)


def _cli_output(args: list[str], stderr_on_terminal: bool) -> str:
    """stdout and stderr of `grpo-agent ARGS`, with stderr a pipe or a terminal (a pty)."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    command = [sys.executable, "-m", "grpo_agent.cli.main", *args]
    if not stderr_on_terminal:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600,
                              check=False)
        return proc.stdout + proc.stderr
    main_end, child_end = pty.openpty()
    # A new pty is 0 columns wide, where tqdm draws nothing: give it a terminal's size.
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(main_end, 65536)
            except OSError:  # EIO: the child's end is closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=child_end, env=env,
                          timeout=600, check=False)
    os.close(child_end)
    reader.join(30)
    os.close(main_end)
    return proc.stdout.decode() + b"".join(chunks).decode(errors="replace")


def test_library_progress_bars_are_off_when_stderr_is_no_terminal(tiny_model_path, tmp_path):
    """transformers' "Loading weights" (and "Writing model shards") bars printed into a piped
    run's output, each redraw a carriage return in one long line, beside the run's own plain
    progress lines; on a terminal they stay."""
    piped = _train_output(tiny_model_path, tmp_path / "piped", stderr_on_terminal=False)
    # the run got past loading the model: its start check refused the server (port 9)
    assert "ServerUnreachableError" in piped, piped[-3000:]
    assert "Loading weights" not in piped, piped[-3000:]
    on_terminal = _train_output(tiny_model_path, tmp_path / "tty", stderr_on_terminal=True)
    assert "Loading weights" in on_terminal, on_terminal[-3000:]


def test_tiny_model_writes_no_library_progress_bar_into_a_pipe(tmp_path):
    """`grpo-agent tiny-model DIR > log 2>&1` wrote save_pretrained's "Writing model shards"
    bar (carriage returns) into the log; on a terminal it stays."""
    piped = _cli_output(["tiny-model", str(tmp_path / "piped")], stderr_on_terminal=False)
    assert str(tmp_path / "piped") in piped, piped[-3000:]  # it built the model
    assert "Writing model shards" not in piped and "\r" not in piped, piped[-3000:]
    on_terminal = _cli_output(["tiny-model", str(tmp_path / "tty")], stderr_on_terminal=True)
    assert "Writing model shards" in on_terminal, on_terminal[-3000:]


def test_eval_turns_library_progress_bars_off_when_stderr_is_no_terminal(tmp_path, monkeypatch):
    """`grpo-agent eval --model HUB_ID` downloads the tokenizer through huggingface_hub, whose
    bars went into a piped log; eval quiets them as train does (stderr is a pipe under pytest).
    Checked on the libraries' switches: a download needs the network, which tests do not have."""
    import huggingface_hub.utils as hub_utils
    from grpo_agent.plugins import manager
    from grpo_agent.train.eval_run import run_eval
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv(manager.LOAD_ENV, "math")
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        with pytest.raises(ValueError, match="declares no eval split"):  # stops before a server
            run_eval("math", AsyncGRPOConfig(output_dir=str(tmp_path)))
        assert not hf_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def test_datasets_map_bar_is_off_when_stderr_is_no_terminal(capsys, monkeypatch):
    """An `--agent` run writes each row's prompt with `Dataset.map`, whose "Map: 100%|..." bar
    went into a piped run's log beside its plain progress lines (stderr is captured here, no
    terminal); HF_DATASETS_DISABLE_PROGRESS_BARS, when set, stays the user's choice."""
    import datasets.utils as ds_utils
    from datasets import Dataset
    from grpo_agent.train.reporting import quiet_library_bars_off_terminal

    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    was_disabled = ds_utils.are_progress_bars_disabled()
    ds_utils.enable_progress_bars()
    try:
        quiet_library_bars_off_terminal()
        Dataset.from_list([{"prompt": "a"}]).map(lambda row: {"prompt": row["prompt"] * 2})
    finally:
        (ds_utils.disable_progress_bars if was_disabled else ds_utils.enable_progress_bars)()
    assert "Map" not in capsys.readouterr().err


@pytest.mark.parametrize(("setting", "message"), [
    ("eval_num_generations=0", "eval_num_generations=0: set it to 1 or more."),
    ("per_device_eval_batch_size=0", "per_device_eval_batch_size=0: evaluation needs at least one"),
    ("eval_temperature=-1", "eval_temperature=-1 is out of range: set eval_temperature >= 0 (0 = greedy)."),
    ("metric_for_best_model=eval/pass@1", "metric_for_best_model / load_best_model_at_end are not"),
])
def test_eval_settings_that_cannot_work_are_refused_before_a_server_starts(
        tmp_path, capsys, monkeypatch, setting, message):
    """With the managed server these failed only after it started and the model loaded (minutes
    on a 2-core box), as "the run failed: ValueError ... read the traceback in error.log"."""
    from grpo_agent.cli.main import main
    from grpo_agent.plugins import manager

    monkeypatch.setenv(manager.LOAD_ENV, "counter")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "counter", "--set", "max_steps=1", "--set", "eval_on_start=true",
              "--set", setting, "--output-dir", str(out), "--vllm-url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert done.value.code == 1, err[-3000:]
    assert f"Error: {message}" in err, err
    assert "the run failed" not in err and not (out / "config.json").exists(), err


class _Unscored:
    """An env with no declared rewards and no get_reward."""

    def reset(self, **row):
        return "say hi"


class _SelfScored(_Unscored):
    def get_reward(self) -> float:
        return 1.0


def test_an_env_without_any_reward_source_is_refused_before_a_server_starts(tmp_path, capsys):
    """`train --env` on an env with neither rewards=[...] nor get_reward() ran with every group
    dropped as unscored until no_progress_timeout (30 min) stopped it."""
    from grpo_agent.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "tests.unit.test_train_run:_Unscored", "--set", "max_steps=1",
              "--output-dir", str(out), "--vllm-url", "http://127.0.0.1:9"])  # never contacted
    err = capsys.readouterr().err
    assert done.value.code == 1, err[-3000:]
    assert ("Error: The env '_Unscored' has no reward source: no "
            "rewards=[...] in its @environment(...) and no get_reward() method") in err, err
    assert "the run failed" not in err and not (out / "config.json").exists(), err
    import functools

    task = {"id": "unscored", "reward_funcs": [], "environment_factory": _Unscored}
    for factory in (_SelfScored, functools.partial(_SelfScored), {"a": _Unscored, "b": _SelfScored}):
        run._check_reward_source({**task, "environment_factory": factory})
    run._check_reward_source({**task, "reward_funcs": [len]})


class _AgentOnly(_SelfScored):
    """An env played by its own agent program (as verifiers' is)."""

    agent_only = "its-agent"


@pytest.mark.parametrize(("args", "message"), [
    (["--env", "counter"], ("The env 'counter-v1' has no dataset (its reset() samples its own "
                            "tasks), so the run length is unknown: pass --set max_steps=N")),
    (["--env", "words", "--set", "max_steps=1", "--model", "{tmp}/x/final"],
     "--model {tmp}/x/final: no such folder."),
    (["--env", "words", "--set", "max_steps=1", "--set", "eval_on_start=true"],
     "The env 'words-v1' declares no eval split, but the run evaluates"),
    (["--env", "counter", "--set", "max_steps=1", "--agent-cmd", "python agent.py"],
     ("The env 'counter-v1' has no dataset (its reset() draws each task) and its reward comes "
      "from its own increment() tool and get_reward().")),
    (["--env", "tests.unit.test_train_run:_AgentOnly", "--set", "max_steps=1"],
     ("The env '_AgentOnly' is played by its own agent program, not the built-in tool loop: add "
      "--agent its-agent")),
    (["--env", "words", "--set", "max_steps=1", "--set", "resume_from_checkpoint=last"],
     "Cannot resume: {tmp}/run has no complete checkpoint-N folder"),
    # a folder without rollout_state.json (a run's final/) was refused only once the server and
    # model were up (RolloutState.load)
    (["--env", "words", "--set", "max_steps=1", "--set", "resume_from_checkpoint={tmp}"],
     "Cannot resume from {tmp}: it holds no rollout_state.json, so it is no complete checkpoint"),
])
def test_a_dry_run_is_refused_where_the_real_run_is(tmp_path, capsys, args, message):
    """`train --dry-run` printed the config and exited 0 for runs that `train` refuses within
    seconds (counter without max_steps, a mistyped --model folder): it skipped those checks."""
    from grpo_agent.cli.main import main

    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    with pytest.raises(SystemExit) as done:
        main(["train", *args, "--output-dir", str(tmp_path / "run"), "--dry-run"])
    captured = capsys.readouterr()
    assert done.value.code == 1, captured.err[-3000:]
    assert f"Error: {message.replace('{tmp}', str(tmp_path))}" in captured.err, captured.err
    assert captured.out == "" and not (tmp_path / "run").exists()


@pytest.fixture
def interrupted_at_start(tmp_path, monkeypatch):
    """The output dir of an earlier run (its checkpoint-3), and Ctrl-C as training starts."""
    from transformers import Trainer

    checkpoint = tmp_path / "run" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rollout_state.json").write_text("{}")

    def ctrl_c(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", ctrl_c)
    return tmp_path / "run"


def test_an_interrupted_cli_run_advises_the_clis_resume_flag(interrupted_at_start, caplog):
    """Ctrl-C in `grpo-agent train` said `resume_from_checkpoint=last`, the Python spelling of no
    API (`trainer.train` reads a text as a folder), where every other CLI advice says --set."""
    from grpo_agent.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "words", "--set", "max_steps=1", "--output-dir",
              str(interrupted_at_start), "--vllm-url", "http://127.0.0.1:9"])  # never contacted
    assert done.value.code == 130  # typer's exit for Ctrl-C
    assert ("The run was interrupted (KeyboardInterrupt) at step 0: stopping the rollout worker "
            "at once. To go on, resume from checkpoint-3 with --set resume_from_checkpoint=last."
            ) in caplog.text, caplog.text


def _no_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_an_interrupted_python_run_advises_the_train_argument(interrupted_at_start, caplog):
    """The Python API's spelling: `trainer.train` resumes from the newest checkpoint on True."""
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.train.trainer import AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(interrupted_at_start), use_cpu=True, max_steps=1,
                           report_to="none", vllm_server_base_url="http://127.0.0.1:9")
    trainer = AsyncGRPOTrainer(str(build_tiny_model()), reward_funcs=[_no_reward], args=args,
                               train_dataset=Dataset.from_list([{"prompt": "hi"}]))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert ("To go on, resume from checkpoint-3 with trainer.train(resume_from_checkpoint=True)."
            in caplog.text), caplog.text
