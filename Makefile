# `make serve` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the trained tiny model shipped in the package (service/assets/tiny-trained); `make tiny-model` writes a random one
MODEL_DIR ?= service/assets/tiny-trained
RANDOM_MODEL_DIR ?= .models/tiny
HOST ?= 127.0.0.1
PORT ?= 8000
REPLICAS ?= 2

.PHONY: install serve lint test test-slow test-gpu tiny-model generate clean

$(STAMP): pyproject.toml Makefile scripts/install_tools.sh
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU machines get the CPU build of torch; machines with a CUDA driver get the default build.
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	else $(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu; fi
	$(BIN)/pip install -q -e '.[test]'
	bash scripts/install_tools.sh $(VENV)
	touch $(STAMP)

install: $(STAMP)

$(RANDOM_MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/hybrid-serve make-tiny-model $(RANDOM_MODEL_DIR)

tiny-model: $(RANDOM_MODEL_DIR)/config.json

serve: install
	$(BIN)/hybrid-serve serve --model-path $(MODEL_DIR) --host $(HOST) --port $(PORT) --replicas $(REPLICAS) \
		--reasoning-parser nemotron_3 --tool-call-parser qwen3_coder

generate: install
	$(BIN)/hybrid-serve generate --model-path $(MODEL_DIR) --chat --prompt "What is 482+357?" --max-tokens 48 \
		--temperature 0

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The default run leaves out tests marked slow (each has a bounded version in the default run); test-slow runs them.
# TEST_WORKERS pytest-xdist processes share the tests; those that start Ray or a server run on one of them
# (tests/conftest.py schedules them as one unit). -x: the first failure stops the run.
TEST_WORKERS ?= 2
test: install lint
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --durations=15 -m "not slow" tests

test-slow: install
	$(BIN)/python -m pytest -q -m "slow and not gpu" tests

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .models
