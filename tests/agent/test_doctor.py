"""`grpo-agent doctor template` on the tiny model's real tokenizer folder."""
from __future__ import annotations

from grpo_agent.cli.doctor import app
from grpo_agent.rollout.chat_template import choose_training_template
from typer.testing import CliRunner

runner = CliRunner()


def test_reports_divergence_and_the_patched_training_template(tiny_tokenizer):
    result = runner.invoke(app, ["template", tiny_tokenizer.name_or_path])
    assert result.exit_code == 0, result.output
    assert "not prefix-preserving: adding message 5" in result.output
    assert "patched qwen3 training template" in result.output
    # the gateway renders a multi-turn chat without tools with the patched template too
    chat = result.output.split("multi-turn chat without tools")[1]
    assert "adding message 3 of the chat without tools" in chat
    assert "patched qwen3 training template" in chat
    assert "HermesToolCallParser" in result.output


def test_a_prefix_preserving_template_is_kept(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(choose_training_template(tiny_tokenizer).template)
    result = runner.invoke(app, ["template", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.count("model template:    prefix-preserving") == 2  # tools and none


def test_an_unfixable_template_exits_2_and_a_missing_one_exits_1(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    drops_history = "{% for m in messages %}{% if loop.last %}{{ m.role }}:{{ m.content }}\n{% endif %}{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(drops_history)
    result = runner.invoke(app, ["template", str(tmp_path)])
    assert result.exit_code == 2 and "no patched template for this family" in result.output
    (tmp_path / "chat_template.jinja").unlink()
    result = runner.invoke(app, ["template", str(tmp_path)])
    assert result.exit_code == 1


def test_a_template_that_forks_only_without_tools_exits_2(tiny_tokenizer, tmp_path):
    """A gateway agent's multi-turn chat without tools renders with the training template too
    (the gateway's ConversationRenderer), so its forks count."""
    tiny_tokenizer.save_pretrained(tmp_path)
    forks_without_tools = ("{% for m in messages %}{% if tools or loop.last %}{{ m.role }}:"
                           "{{ m.content }}\n{% endif %}{% endfor %}")
    (tmp_path / "chat_template.jinja").write_text(forks_without_tools)
    result = runner.invoke(app, ["template", str(tmp_path)])
    assert result.exit_code == 2, result.output
    tools, chat = result.output.split("multi-turn chat without tools")
    assert "model template:    prefix-preserving" in tools
    assert "adding message 2 of the chat without tools" in chat
    assert "no patched template for this family" in chat


def test_a_missing_folder_and_bad_json_are_one_line_errors_with_exit_1(tiny_tokenizer, tmp_path, capsys):
    """Not transformers' traceback about Hub repo ids, and not exit 2 (which means "forks")."""
    import pytest
    from grpo_agent.cli.main import main

    for args, says in ([str(tmp_path / "nope")], "no such folder"), (
            [tiny_tokenizer.name_or_path, "--chat-template-kwargs", "enable_thinking=false"], "not valid JSON"), (
            # valid JSON, but no object: "cannot convert dictionary update sequence element #0"
            [tiny_tokenizer.name_or_path, "--chat-template-kwargs", "[1]"], "must be a JSON object"), (
            [tiny_tokenizer.name_or_path, "--chat-template-kwargs", "5"], "must be a JSON object"):
        with pytest.raises(SystemExit) as exited:
            main(["doctor", "template", *args])
        assert exited.value.code == 1
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err


def test_the_console_script_exposes_doctor_template(tiny_tokenizer):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("grpo-agent")
    result = subprocess.run(
        [str(script), "doctor", "template", tiny_tokenizer.name_or_path,
         "--chat-template-kwargs", '{"enable_thinking": false}'],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "patched qwen3 training template" in result.stdout


def test_a_path_that_exists_but_is_no_model_folder_is_not_called_missing(tmp_path, capsys):
    """"no such folder" only for a path that does not exist: an existing path transformers
    cannot load (a file; an empty folder, where transformers raises a ValueError about
    sentencepiece) gets transformers' reason, still one line with exit 1."""
    import pytest
    from grpo_agent.cli.main import main

    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "notes.txt", tmp_path / "empty"):
        with pytest.raises(SystemExit) as exited:
            main(["doctor", "template", str(path)])
        assert exited.value.code == 1
        err = capsys.readouterr().err
        assert "Cannot load a tokenizer from" in err and "no such folder" not in err, err
