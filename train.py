"""Entry point for `accelerate launch train.py --recipe NAME [flags]` (same flags as `vramfit train`)."""
import sys

from vramfit.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
