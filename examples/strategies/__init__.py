"""Strategies of one's own for sharded groups, written the Flower way: subclass, override a hook."""
