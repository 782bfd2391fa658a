"""Side-by-side benchmarks (scripts); shared workload modules are importable as `benchmarks.*`."""
