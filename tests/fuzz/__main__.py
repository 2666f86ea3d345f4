"""`python -m tests.fuzz ...` is `python tests/fuzz/run_fuzz.py ...`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_fuzz import main

sys.exit(main())
