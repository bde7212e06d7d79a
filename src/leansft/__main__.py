import sys

from leansft.tools.cli import main

sys.exit(main())
