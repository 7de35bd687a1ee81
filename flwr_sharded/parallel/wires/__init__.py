"""The shard sync's wire dtypes, one module each (`flwr_sharded.parallel.wire` registers every module here)."""
