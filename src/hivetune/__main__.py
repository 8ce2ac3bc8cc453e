import os
import sys

from hivetune.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
    # A torchrun worker whose work is done (files closed, process group destroyed). The
    # interpreter's teardown can still meet a gloo thread that is joinable and abort with
    # "terminate called without an active exception" (3 times in ~330 2-process CPU runs):
    # leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
sys.exit(code)
