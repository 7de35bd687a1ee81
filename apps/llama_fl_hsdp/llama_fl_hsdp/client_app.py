"""The thin ClientApp: forwards each message to this node's long-lived FSDP/HSDP group (it never imports torch).

Deployment: the SuperNode names its group with `--node-config 'group-address="127.0.0.1:7100"
group-authkey-file="/path/authkey"'`. Simulation: the first message launches the group on this machine.
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_sharded.flower import client, protocol

app = ClientApp()


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Set up (or reuse) the group for this run; reply with its layout, fingerprint and rendezvous offer."""
    return client.handle(msg, context, protocol.HELLO)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """K sync periods of A local steps, syncing shards with the members the ServerApp named."""
    return client.handle(msg, context, protocol.TRAIN)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Held-out loss and perplexity of the group's current weights."""
    return client.handle(msg, context, protocol.EVALUATE)


@app.query("apply")
def apply(msg: Message, context: Context) -> Message:
    """Server path: adopt the server's average of the facilities (each rank reads only its own rows)."""
    return client.handle(msg, context, protocol.APPLY)


@app.query("pull")
def pull(msg: Message, context: Context) -> Message:
    """Server path: rows of the shards this node's group exported in this round (the server pulls them in chunks)."""
    return client.handle(msg, context, protocol.PULL)


@app.query("finish")
def finish(msg: Message, context: Context) -> Message:
    """End of the run: shut a launched group down (simulation), or let the group drop the run (deployment)."""
    return client.handle(msg, context, protocol.FINISH)
