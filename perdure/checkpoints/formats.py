"""Every format perdure reads, registered with the read path (`read.py`): importing a format's module registers it,
and importing this module imports them all. `perdure/__init__` imports it, so every format is registered before
anything is read. A new format's module is added here."""

from perdure.checkpoints import dcp as dcp
from perdure.checkpoints import deepspeed_engine as deepspeed_engine
from perdure.checkpoints import file as file
from perdure.checkpoints import read as read  # the weight-file formats: pt, safetensors
