"""A Flower client's long-lived FSDP/HSDP group: the runtime (`runtime`), one round (`round`), the server path's
export and apply (`server_path`). Run it with `torchrun ... -m flwr_sharded.flower.group`."""
