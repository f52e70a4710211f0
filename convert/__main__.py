"""`python -m convert HF_DIR OUT_DIR [--dtype ...] [--overwrite]`."""

import sys

from convert.cli import main

sys.exit(main())
