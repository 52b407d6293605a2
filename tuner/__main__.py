"""Entry point for `python -m tuner`."""

from tuner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
