import sys

from numbaccum.cli import main

sys.exit(main())
