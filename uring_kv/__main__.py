import sys

from uring_kv.cli import main

sys.exit(main())
