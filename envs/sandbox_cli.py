"""Sub-commands of this package (placeholder: none yet)."""


def register(subparsers) -> None:
    """Add this package's sub-commands to the `reinforge` parser."""
