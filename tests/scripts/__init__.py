"""Scripts that tests launch as rank processes (`python -m scripts.<name> '<json parameters>'`): real
modules, importable and linted, each with a main(params) that prints `RESULT <json>` for the test to read.
tests/one_rank.py runs them."""
