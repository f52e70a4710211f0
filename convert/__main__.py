"""`python -m convert HF_DIR OUT_DIR [--dtype ...] [--overwrite]`."""

import os
import signal
import sys


def _leave(signum, frame):  # Ctrl-C while importing: nothing is written yet, leave at once
    print("convert: interrupted (nothing was written to OUT_DIR)", file=sys.stderr, flush=True)
    os._exit(130)


signal.signal(signal.SIGINT, _leave)

from convert.cli import main  # noqa: E402
from jdllm.process import exit_with  # noqa: E402

exit_with(main(own_process=True))
