"""`numbaccum bench`: workloads, NumPy baselines and the timing table."""
