"""vLLM general plugin entry point (placeholder until the gloo engine lands)."""


def register() -> None:
    return None
