"""An emulated tiered cluster on one Linux machine (docs/benchmarking.md): `network` (the topology from a cluster
description, its namespaces, bridges and tbf-shaped veths, the ranks run on it) inside the fresh namespaces that
`isolation` re-executes a command in, so that the kernel removes everything whatever happens to the runner."""
