"""Print docs/config.md, the reference of every RunnerConfig key, generated from the comments in RunnerConfig.__init__.

python scripts/config_reference.py > docs/config.md
"""

import sys

from perdure.config import RunnerConfig
from perdure.config_help import markdown_reference

if __name__ == "__main__":
    sys.stdout.write(markdown_reference(RunnerConfig))
