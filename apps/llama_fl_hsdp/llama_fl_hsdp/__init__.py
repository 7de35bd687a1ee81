"""llama_fl_hsdp: a Flower app where each client is a whole FSDP/HSDP group of flwr_sharded."""
