"""`torchrun --nproc-per-node R*S -m flwr_sharded.flower.group ...`: see `flwr_sharded.flower.group.runtime`."""

import os
import sys

from flwr_sharded import host_memory

host_memory.pin_thresholds()  # before torch's imports allocate: the allocator follows the tensors from the start
host_memory.no_flight_recorder()  # a process group per round: torch's recorder would keep some of each

from flwr_sharded.flower.group.runtime import main  # noqa: E402

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # no interpreter teardown: background store/accept threads must not delay the exit
