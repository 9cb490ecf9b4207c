"""Sweeps: a job matrix in a directory that dispatchers on several machines drain safely, or SLURM arrays run.

`matrix` reads and expands a MATRIX.yaml into jobs; `state` keeps the sweep's rows in `DIR/sweep.json` under the
flock of `DIR/lock`; `launch` starts one job and reads what it reports; `liveness` tells whether a dispatcher or a
job process is alive; `dispatcher` runs jobs in local slots; `slurm` submits them as an sbatch array and runs one
array task; `status` builds the view `perdure sweep status` prints. See docs/sweeps.md.
"""

from perdure.sweep.matrix import Matrix, MatrixJob, SweepError, load_matrix
from perdure.sweep.state import JOB_STATES, SweepState, locked_state, read_state

__all__ = ["JOB_STATES", "Matrix", "MatrixJob", "SweepError", "SweepState", "load_matrix", "locked_state", "read_state"]
