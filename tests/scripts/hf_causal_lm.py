"""examples/hf_causal_lm.py, run as the user runs it (its directory on sys.path, for the padded_lm it imports)."""

import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
runpy.run_path(str(EXAMPLES / "hf_causal_lm.py"), run_name="__main__")
