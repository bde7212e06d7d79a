import sys

from leansft.cli import main

sys.exit(main())
