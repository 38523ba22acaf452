import sys

from paratrain.cli import main

sys.exit(main())
