"""An emulated tiered cluster on one Linux machine (docs/benchmarking.md): a network namespace per node (its ranks on
its unshaped loopback), a bridge per node group and a top bridge, tbf-shaped veths at the inter-node and inter-group
rates; all of it inside `unshare --net --mount --pid`, so that the kernel removes it whatever happens to the runner.

Modules: `isolation` (the host's preconditions and the re-execution in fresh namespaces) and `network` (what gets
built, whether it fits this machine, the network and the ranks run on it).
"""
