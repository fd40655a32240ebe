import sys

from wsinfer.cli import main

sys.exit(main())
