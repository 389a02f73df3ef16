"""The main test suite. A package so that its shared helpers import by one name from anywhere
(`from tests.helpers.vocab_helpers import ...`); the test folders below have no __init__, so each
test module keeps a unique bare name. pyproject's `pythonpath = ["."]` puts the repository root
(and so this package, and the checkout's own logitgate) first on sys.path."""
