"""``python -m kvbench.selfcheck.gpu_check [ARGS]``: the GPU checks (main.py says what they are)."""
import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
