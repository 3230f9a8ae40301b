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

## make test: the whole suite (unit, integration with real Ray / PostgreSQL / Chromium, end-to-end), in three parts.
## 1. Most tests on two pytest-xdist workers (slow tests marked beside, which judge no timing and mostly wait,
##    start first among them).
## 2. The end-to-end tests (marked slow: real Ray clusters, real faults) in two streams at once, each one test at
##    a time on a cluster of its own: $(STREAM_A) in one (its report is printed after the other's), every
##    other slow module in the other. One end-to-end stream keeps about 60% of this machine's two cores busy
##    (torch and Ray start-ups, waits for detectors); two fill them.
## 3. Alone: the tests marked timing (they compare measured durations) and links (they change the host's network
##    links, which makes the browser tests' Chromium abort its requests), so no other test's load skews them.
PYTEST   := $(VENV)/bin/pytest -q -p no:cacheprovider
PAIRED   := slow and not timing and not links and not beside
STREAM_A := tests/e2e/test_faults.py tests/e2e/test_user_code.py

test: $(STAMP) browser lint
	$(PYTEST) -m "((not slow and not timing) or beside) and not links" -n 2 --durations=15
	@mkdir -p .vigil
	@echo "end-to-end tests in two streams: [$(STREAM_A)] and [every other slow module]"
	@$(PYTEST) -m "$(PAIRED)" $(STREAM_A) --durations=30 > .vigil/stream-a.log 2>&1 & a=$$!; \
	  $(PYTEST) -m "$(PAIRED)" $(foreach f,$(STREAM_A),--ignore=$(f)) tests --durations=30; b=$$?; \
	  wait $$a; a=$$?; echo "---- stream [$(STREAM_A)] ----"; cat .vigil/stream-a.log; \
	  echo "streams: [$(STREAM_A)] exit $$a, the other exit $$b"; test $$a -eq 0 && test $$b -eq 0
	$(PYTEST) -m "timing or links" --durations=20

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
