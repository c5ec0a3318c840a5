"""CuTe DSL kernels of kquant-cute. Never imports kquant_cute.planners or the API."""
