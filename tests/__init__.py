import kernels  # noqa: F401  (sets the OpenMP wait policy before torch loads libgomp)
