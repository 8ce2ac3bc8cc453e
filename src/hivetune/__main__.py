import sys

from hivetune.cli import main

sys.exit(main())
