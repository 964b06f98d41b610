"""Entry point for ``python -m dist_convert`` and for ``torchrun dist_convert`` (the package directory
run as a script from the repository root)."""
import os
import sys

if not __package__:  # run as a directory: import the package, not its modules, from the repo root
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(here))

from dist_convert.cli import entry  # noqa: E402

if __name__ == "__main__":
    entry()
