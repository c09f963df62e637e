# Every target sets itself up first (idempotent), so a fresh clone needs only `make demo` / `make test`.
PY := .venv/bin/python
SETUP := bash scripts/setup.sh

.PHONY: setup gen gates test test-fast demo bench fuzz reliability baseline clean

setup:
	@$(SETUP)

## Regenerate pdproto/v1 (messages, stubs, __init__) from protos/ (commit the result).
gen: setup
	@$(PY) scripts/gen_protos.py

## Schema and type gates: buf lint/format/breaking, regen diff, mypy --strict.
gates: setup
	@bash scripts/gates.sh

## Every gate, then every test. Two pytest workers, one test file each at a time: most tests
## wait on subprocesses and engines, so two workers halve the wall time on two cores, and a
## file's tests (which share module fixtures) stay in one worker, in order. Files go out in
## collection order, which starts the long ones (tests/conftest.py); xdist's own order, most
## tests first, left the 3-test SGLang harness to run alone at the end.
TEST_WORKERS ?= 2
## .venv-vllm finishes building meanwhile; tests/vllm runs last and waits for it.
test:
	@PDPROTO_VLLM_LATER=1 $(SETUP)
	@bash scripts/gates.sh
	@bash scripts/run_tests.sh -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

## The pure tests only, for quick iteration: no gates, and no test marked `process`
## (subprocesses, gRPC servers, engines; tests/conftest.py enforces the marker).
test-fast: setup
	@bash scripts/run_tests.sh -m "not process"

## The end-to-end demo: real processes, real engines, every byte checked.
demo: setup
	@$(PY) -m pdproto_server.cli demo

## Benchmarks, reported as ratios against a baseline measured in the same run.
bench: setup
	@$(PY) -m bench

## Long fuzz run (100,000+ inputs per target).
fuzz: setup
	@$(PY) -m tests.fuzz.run --runs 100000

## Fault injection, version skew, limits and load; prints one table.
reliability: setup
	@$(PY) -m tests.reliability.run

## Rebuild the buf breaking baseline (only on a deliberate compatibility decision).
baseline: setup
	@.venv/bin/buf build --exclude-source-info -o '-#format=json' | $(PY) -m json.tool --indent 1 > compat/pdproto.v1.baseline.json

clean:
	rm -rf .venv .venv-vllm .venv-vllm.lock .pytest_cache .mypy_cache .hypothesis
