"""engine.kernels: Triton kernels with torch references, a first-party plugin package."""
