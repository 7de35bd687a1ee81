"""A Flower client's long-lived FSDP/HSDP group: the runtime (`runtime`), what a round needs of it (`contract`), one
round (`round_context`, `channels`, `round`), a round's members gone (`aborts`), the server path's group side
(`server_path_shards`). Run it with `torchrun ... -m flwr_sharded.flower.group`."""
