"""An emulated tiered cluster on one Linux machine: network namespaces, bridges and tbf-shaped veth links.

A cluster description (the planner's YAML: `gpus_per_node`, `nodes`, `nodes_per_group`, `bandwidth`) becomes:

- one network namespace per node (`fsn<k>`), holding that node's ranks; ranks of one node talk over the namespace's
  own loopback, unshaped (the emulator's "NVLink");
- a fabric: the runner's own network namespace, with one bridge per node group (`fbg<g>`, the group switch) and a
  top bridge (`fbtop`);
- per node a veth pair `eth0` (in the node, address 10.77.<g>.<n+1>/16) <-> `vn<k>` (on its group bridge), shaped
  with tbf at the inter-node bandwidth on both directions;
- per group a veth pair `up<g>` (on the group bridge) <-> `dn<g>` (on the top bridge), shaped with tbf at the
  inter-group bandwidth on both directions (only with more than one group).

Everything runs inside `unshare --net --mount --pid --fork --kill-child` with a private tmpfs on /run (where
`ip netns` keeps its files): when the runner exits, even after a crash or SIGKILL, the kernel removes every
namespace, interface, qdisc and process it made. `run_isolated` re-executes a command that way; `Fabric` builds the
network inside and launches ranks (`RANK`, `WORLD_SIZE`, `MASTER_ADDR` = rank 0's node, `GLOO_SOCKET_IFNAME=eth0`).

Latency is not emulated (the kernel has no netem); `latency` in the description is ignored here.

Modules: `topology` (what gets built, from a cluster description, and whether it fits this machine), `isolation`
(the host's preconditions and the re-execution in fresh namespaces), `network` (the network and the ranks inside) and
`probe` (a TCP throughput measurement between two nodes).
"""
