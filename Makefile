# The two commands a user needs: `make run` and `make test`. Both create or update .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: run test test-fast browser lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

## make run: start a local multi-node Vigil (Ray head + 2 workers, agents, controller, dashboard) and the demo job
run: $(STAMP)
	$(VENV)/bin/vigil up

## make test: the whole suite (unit, integration with real Ray / PostgreSQL / Chromium, end-to-end).
## Most tests run on two pytest-xdist workers; those marked slow (real Ray clusters whose detectors judge
## timings) or timing (durations compared) run one at a time after them, so no other test's load skews them,
## and so do those marked links (they change the host's network links, which makes the browser tests'
## Chromium abort its requests). Slow tests marked beside (no timing judged, mostly waiting) run first among
## the parallel ones instead.
test: $(STAMP) browser lint
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "((not slow and not timing) or beside) and not links" -n 2 --durations=15
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "((slow or timing) and not beside) or links" --durations=60

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

# Debian's Chromium and its driver for the dashboard's real-browser tests (never a tool's own download).
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  echo "installing Debian chromium + chromium-driver"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	    || echo "could not install chromium; the browser tests will say why they skip"; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check agent controller dashboard vigil trainer migrations tests examples ops

clean:
	rm -rf $(VENV) .vigil .pytest_cache
