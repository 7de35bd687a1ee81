"""The thin ClientApp: forwards each message to this node's long-lived FSDP/HSDP group (it never imports torch).

Deployment: the SuperNode names its group with `--node-config 'group-address="127.0.0.1:7100"
group-authkey-file="/path/authkey"'`. Simulation: the first hello launches the group on this machine.
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_sharded.flower import clientapp
from flwr_sharded.flower import messages as M

app = ClientApp()


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Set up (or reuse) the group for this run; reply with its layout, fingerprint and rendezvous offer."""
    return clientapp.handle(msg, context, M.HELLO)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Start one round in the group (K sync periods of A local steps with the members the ServerApp named)."""
    return clientapp.handle(msg, context, M.TRAIN)


@app.query("collect")
def collect(msg: Message, context: Context) -> Message:
    """The result of the round the train message started (it waits for it up to the message's timeout; then it
    replies that the round still runs, and the ServerApp sends another)."""
    return clientapp.handle(msg, context, M.COLLECT)


@app.query("abort")
def abort(msg: Message, context: Context) -> Message:
    """Members of a round are gone (the ServerApp knows): the group stops waiting for them at the rendezvous."""
    return clientapp.handle(msg, context, M.ABORT)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Held-out loss and perplexity of the group's current weights."""
    return clientapp.handle(msg, context, M.EVALUATE)


@app.query("apply")
def apply(msg: Message, context: Context) -> Message:
    """Server path: adopt the server's average of the facilities (each rank reads only its own rows)."""
    return clientapp.handle(msg, context, M.APPLY)


@app.query("pull")
def pull(msg: Message, context: Context) -> Message:
    """Server path: rows of the shards this node's group exported in this round (the server pulls them in chunks)."""
    return clientapp.handle(msg, context, M.PULL)


@app.query("finish")
def finish(msg: Message, context: Context) -> Message:
    """End of the run: shut a launched group down (simulation), or let the group drop the run (deployment)."""
    return clientapp.handle(msg, context, M.FINISH)
