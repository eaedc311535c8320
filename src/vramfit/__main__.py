"""`python -m vramfit`: the same command line as `vramfit`."""

from .cli import main

if __name__ == "__main__":
    main()
