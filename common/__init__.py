"""Code every voxpipe process shares: messages, sockets, settings, the launcher."""

__version__ = (
    "0.1.0"  # pyproject.toml's version (tests/test_cli_refuses_clearly_and_exits_2.py checks they agree)
)
