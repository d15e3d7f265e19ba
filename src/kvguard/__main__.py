import sys

from kvguard.cli import main

sys.exit(main())
