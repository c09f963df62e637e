"""Fuzz harnesses (atheris + hypothesis + seeded mutations) for pdproto.wire and the legacy parsers.

Reading order: ``targets.py`` (what is fuzzed, found by name; seed corpora from
valid encodings), ``harness.py`` (one input -> ok / typed error / crash, time
bound, saved findings, mutation engine), ``atheris_main.py`` (coverage-guided,
one subprocess per target), ``run.py`` (the command line and the table),
``messages.py`` (fills any protobuf message from its descriptor; also used by
tests/test_wire.py). ``make fuzz`` runs 100,000 inputs per target;
``test_fuzz.py`` runs a short version under ``make test``.
"""
