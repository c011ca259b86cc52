"""Model formats, models, stages, sampling and scheduling: no Ray."""
import os

# torch's OpenMP workers spin-wait between ops by default, on the very cores that OpenBLAS
# (kernels/linear.py) then needs: make them sleep instead. Must happen before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
