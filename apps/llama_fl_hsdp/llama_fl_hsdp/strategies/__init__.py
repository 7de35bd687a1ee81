"""Strategies of one's own for sharded groups, written the Flower way: subclass, override a hook. They live in the
app's package, so `flwr run` ships them to the SuperLink with the app; select one with
`--run-config 'strategy="llama_fl_hsdp.strategies.<module>:<Class>"'`."""
