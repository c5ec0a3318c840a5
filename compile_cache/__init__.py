"""Memory + disk cache of compiled kernel specializations; imports neither kernels nor planners."""
