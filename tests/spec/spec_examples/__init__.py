"""The spec's code examples as modules, so the spawned rollout worker can import (unpickle)
their reward functions, tools, environments and loop classes by name. Each module says which
spec lines it copies and what it changes; `tests/spec/conftest.py` puts `tests/spec` on
`sys.path` (the spawned worker inherits it)."""
