"""kvferry: fault-tolerant KV-cache transfer for P/D disaggregated serving."""

import os

# BLAS results differ in their last bits between thread counts: P, D and any reference must agree, so
# every kvferry process computes single-threaded unless told otherwise (set before numpy loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"
