"""Entry point of the `grpo-agent` console script (filled in by the CLI module)."""


def main() -> None:
    raise SystemExit("grpo-agent CLI is not built yet")
