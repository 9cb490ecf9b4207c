"""`open_weight_slices` lives in the read path (`read.py`); imported from here still by code changed elsewhere."""

from perdure.checkpoints.read import open_weight_slices as open_weight_slices
