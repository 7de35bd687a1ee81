"""Flower integration: each Flower client is a whole FSDP/HSDP group (see docs/flower.md).

- `protocol`: instructions/replies and the run settings shared by both ends (no torch);
- `client`: the thin ClientApp's helpers: find or launch the group, forward messages (no torch);
- `group`: the long-lived group runtime, a torchrun entry point (`python -m flwr_sharded.flower.group`);
- `rendezvous`: per-round federation process groups between groups (an authenticated store per shard index);
- `strategy`: `DecentralizedFedAvg`, config-only messages on Flower's Message API;
- `server_aggregation`: the server path's streaming, validated shard aggregator (see docs/server-path.md);
- `processes`: process liveness checks (no torch);
- `superlink`: `flwr-sharded stop-superlink`, one Flower home's local SuperLink stopped by pid (no torch).

Nothing is imported here, so that `import flwr_sharded.flower.client` stays free of torch.
"""
