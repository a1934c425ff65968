import sys

from specfit.cli import main

sys.exit(main())
