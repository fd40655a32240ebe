import sys

from wsinfer.launch import main

sys.exit(main())
