"""The one error type that reaches the user as a single line and exit code 2."""


class KvbenchError(Exception):
    """Bad input or an unusable environment: printed as one line, exit code 2."""


def require(condition: bool, message: str) -> None:
    """Raise KvbenchError(message) unless condition holds."""
    if not condition:
        raise KvbenchError(message)
