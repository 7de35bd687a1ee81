"""Flower integration: each Flower client is a whole FSDP/HSDP group (see docs/flower.md).

- `run_config`: the run's schema (`FlowerRun`), the app's run-config keys (no torch);
- `messages`: what the ServerApp, the ClientApp and a group say to each other (no torch);
- `clientapp`, `endpoint`, `launch`, `node_policy`: the thin ClientApp's side: find or launch the group, forward
  messages to it over an authenticated local endpoint (no torch);
- `group`: the long-lived group runtime, a torchrun entry point (`python -m flwr_sharded.flower.group`);
- `rendezvous`, `store_server`, `store_client`, `store_channel`: per-round federation process groups between groups,
  through an authenticated store per shard index;
- `server`: the ServerApp's strategies, `DecentralizedFedAvg` and the server path's `ServerShardFedAvg`;
- `shard_files`: the server path's shard files and the records that carry them (no torch);
- `check`, `superlink`: `flwr-sharded check` and `flwr-sharded stop-superlink` (no torch).

Nothing is imported here, so that the ClientApp's modules stay free of torch.
"""
