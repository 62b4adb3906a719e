import sys

from uring_kv.cli import main

if __name__ == "__main__":  # (not in a child process started by spawn, which imports this module again)
    sys.exit(main())
