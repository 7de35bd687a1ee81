"""What the ServerApp, the thin ClientApp and a group runtime say to each other. Torch-free.

    ServerApp --(Flower Message: ConfigRecord "config")--> ClientApp --(local endpoint: JSON)--> group rank 0

The ClientApp forwards the config's keys unchanged (adding what only its node knows); the group parses them into the
typed arguments below, and a key it does not know is an error reply, never dropped. Instruction `{"version", "verb",
"args"}`, reply `{"ok", "error", "result"}`. A round is a `train` message, answered at once, then `query.collect`
messages that wait for its result.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field
from typing import Any, Mapping

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.run_config import RoundOptions
from flwr_sharded.schema import option

PROTOCOL_VERSION = 2

# ----- verbs (the group endpoint) ----------------------------------------------------------------------------------
HELLO = "hello"
"""Set up (or reuse) the run's trainer; reply with the group's layout, fingerprint and rendezvous offer."""
TRAIN = "train"
"""K sync periods of A local steps, each followed by a shard sync with the named members (started detached)."""
COLLECT = "collect"
"""The result of a detached instruction (a round), waited for up to a timeout; answered off the main loop."""
ABORT = "abort"
"""Members of a round are gone: its rendezvous waits end at once; answered off the main loop."""
EVALUATE = "evaluate"
"""Held-out loss and perplexity of the group's current weights."""
STATUS = "status"
"""Liveness and progress; changes nothing."""
APPLY = "apply"
"""Server path: every rank adopts its own rows of the server's mean from the chunk files and steps the outer rule."""
PULL = "pull"
"""Server path, answered by the ClientApp alone: rows of the pieces its group exported this round."""
SAVE = "save"
"""Merge the group's shards and write a Hugging Face model directory."""
FINISH = "finish"
"""The run is over: drop the trainer (free memory), keep serving."""
SHUTDOWN = "shutdown"
"""Exit every rank of the group."""
VERBS = (HELLO, TRAIN, COLLECT, ABORT, APPLY, EVALUATE, STATUS, SAVE, FINISH, SHUTDOWN)

# ----- Flower message types (ClientApp routes) ---------------------------------------------------------------------
MSG_HELLO = "query.hello"
MSG_TRAIN = "train"
MSG_COLLECT = "query.collect"
MSG_ABORT = "query.abort"
MSG_EVALUATE = "evaluate"
MSG_APPLY = "query.apply"
MSG_PULL = "query.pull"
MSG_FINISH = "query.finish"

# ----- Flower record names -----------------------------------------------------------------------------------------
CONFIG = "config"
"""ConfigRecord the ServerApp sends."""
METRICS = "metrics"
"""MetricRecord of numbers (and lists of numbers) in a reply."""
INFO = "info"
"""ConfigRecord of strings/bools in a reply (ok, error, host, fingerprint, ...)."""

START_TIMEOUT_S = 60.0
"""How long a ClientApp waits for its group to take a detached instruction (the group is idle between rounds)."""
MAX_MESSAGE_BYTES = 64 << 20
"""Largest instruction or reply accepted on the local endpoint."""
MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in an endpoint message (the protocol itself needs 3)."""


class ProtocolError(RuntimeError):
    """A malformed instruction or reply on the local endpoint."""


def encode(obj: Mapping[str, Any], *, allow_nan: bool = True) -> bytes:
    """JSON bytes of `obj`; `allow_nan=False` (instructions) raises ValueError for NaN or infinite numbers."""
    return json.dumps(obj, allow_nan=allow_nan, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not accepted in an instruction")


def decode(data: bytes, *, allow_nan: bool = False) -> dict[str, Any]:
    """The JSON object in `data`; ProtocolError for anything else: not JSON, not an object, nested deeper than
    `MAX_DEPTH`, or (unless `allow_nan`: a group's reply may report a NaN loss) NaN or Infinity."""
    try:
        obj = json.loads(data.decode(), parse_constant=None if allow_nan else _no_constant)
    except (UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ProtocolError(f"not a JSON message: {exc}") from exc
    except RecursionError:
        raise ProtocolError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {type(obj).__name__}")
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"JSON nested deeper than {MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return obj


def instruction(verb: str, args: Mapping[str, Any] | None = None, *, detach: bool = False) -> dict[str, Any]:
    """An endpoint instruction; `detach`: the group answers at once with a job id and runs it (see COLLECT)."""
    if verb not in VERBS:
        raise ProtocolError(f"unknown verb {verb!r}; known: {', '.join(VERBS)}")
    out = {"version": PROTOCOL_VERSION, "verb": verb, "args": dict(args or {})}
    if detach:
        out["detach"] = True
    return out


def check_instruction(obj: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(verb, args) of a decoded instruction; ProtocolError for another version, an unknown verb or bad args."""
    verb, args = obj.get("verb"), obj.get("args", {})
    if obj.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {obj.get('version')!r}, this group speaks {PROTOCOL_VERSION}")
    if verb not in VERBS or not isinstance(args, dict):
        raise ProtocolError(f"malformed instruction: verb {verb!r}, args of type {type(args).__name__}")
    return verb, args


def reply_ok(result: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"ok": True, "error": "", "result": dict(result or {})}


def reply_error(error: str, result: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"ok": False, "error": error, "result": dict(result or {})}


# ----- typed arguments ---------------------------------------------------------------------------------------------
class ArgumentError(ValueError):
    """An instruction's arguments are missing, of the wrong type, or unknown."""


TRAIN_CONFIG = schema.Surface(lambda o: f"'{o.name}'", "train config ")
"""How a train config names its keys in messages."""


@dataclass
class TrainArgs:
    """One round's train instruction, as the ServerApp's train config carries it (keys with '-'): each field an option
    of the schema, so its type and bounds are checked as the run's options are."""

    server_round: int = option(ge=0)
    job: str = option()
    """Names the round: the collect message asks for this job's result."""
    members: list[str] = option()
    """The round's member nodes, in order; member 0 hosts the rendezvous."""
    member_index: int = option(ge=0)
    rendezvous_host: str = option()
    rendezvous_ports: list[int] = option(ge=1, le=65535)
    """One store port per shard index, on member 0's rank 0."""
    prefix: str = option()
    """Unique per round and facility: keys of the rendezvous stores."""
    rendezvous_timeout: float = option(gt=0)
    sync_timeout: float = option(gt=0)
    secret: str = field(repr=False)
    """Fresh per round and facility (the ServerApp's, over Flower's TLS channel): members prove it in the rendezvous
    store and sign what they exchange there; never logged. At least 32 characters."""
    evaluate: bool = True
    checkpoint: bool = False
    export: bool = False
    """Server path: the facility's first member exports its shards after the round."""
    catch_up: bool = False
    """A member (re)joined: every member adopts member 0's shards, outer state and step first."""
    member_shards: list[int] = option(factory=list, ge=1)
    """Every member's S, in member order, when they shard differently (the round syncs over the channels of their
    sync plan, `flwr_sharded.flower.group.channels`; `rendezvous_ports` are member 0's); empty: they shard alike."""
    member_steps: list[int] = option(factory=list, ge=1)
    """Every member's local steps per sync of this round, in member order (`group-steps speed`); empty: the round's
    A."""
    member_sites: list[str] = option(factory=list)
    """Every member's site (facility), in member order, where the round reduces in two levels: inside each site, then
    each member's share across sites (`flwr_sharded.parallel.sites`); empty: the flat ring."""
    round: RoundOptions = field(default_factory=RoundOptions)
    """The round options the strategy set for this round (the train config's `RoundOptions` keys)."""

    def local_steps(self, round_steps: int) -> int:
        """This member's local steps per sync in a round of A = `round_steps`."""
        return self.member_steps[self.member_index] if self.member_steps else round_steps

    def to_config(self) -> dict[str, Any]:
        out = {o.name: schema.get(self, o.path) for o in schema.options(type(self)) if o.path[0] != "round"
               and not (o.many and o.default == [] and not schema.get(self, o.path))}  # an empty list: unset
        return {**out, **self.round.to_config()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrainArgs:
        """Parse a train config; ArgumentError names a missing, mistyped or unknown key."""
        options = schema.by_name(cls)
        values: dict[tuple[str, ...], Any] = {}
        for key, value in config.items():
            if key in ROUTING_KEYS:
                continue
            if key not in options:
                raise ArgumentError(f"train config key '{key}' is not known to this group (known: "
                                    f"{', '.join(sorted(options))})")
            try:
                values[options[key].path] = options[key].check(value, TRAIN_CONFIG)
            except ConfigError as exc:
                raise ArgumentError(str(exc)) from None
        missing = [o.name for o in options.values() if o.default is MISSING and o.path not in values]
        if missing:
            raise ArgumentError(f"train config lacks {', '.join(missing)}")
        args = cls(**{p[0]: v for p, v in values.items() if len(p) == 1},
                   round=RoundOptions(**{p[1]: v for p, v in values.items() if p[0] == "round"}))
        if len(args.secret) < 32:
            raise ArgumentError("train config 'secret' must be a string of at least 32 characters")
        if not args.member_index < len(args.members):
            raise ArgumentError(f"member-index {args.member_index} of {len(args.members)} members")
        if len(set(args.members)) != len(args.members):
            raise ArgumentError(f"members {args.members} name a node twice")
        if args.member_shards and len(args.member_shards) != len(args.members):
            raise ArgumentError(f"member-shards {args.member_shards} must name the S of each of the "
                                f"{len(args.members)} members")
        if args.member_sites:
            _check_sites(args)
        if args.member_steps and len(args.member_steps) != len(args.members):
            raise ArgumentError(f"member-steps {args.member_steps} must name the local steps of each of the "
                                f"{len(args.members)} members")
        return args


def _check_sites(args: TrainArgs) -> None:
    """`member-sites`: a site per member for a round that can reduce in two levels
    (`flwr_sharded.parallel.sites.why_not_two_level`; the rule and restart are the strategy's to check)."""
    from flwr_sharded.parallel.sites import why_not_two_level

    why = why_not_two_level(args.member_sites, len(args.members), alike=not args.member_shards)
    if why:
        raise ArgumentError(f"member-sites {args.member_sites} of the {len(args.members)} members: {why}")


ROUTING_KEYS = ("timeout", "partition-id", "num-partitions", "node-data-dir", "node-facility")
"""Keys the ClientApp uses or adds itself, not the group's instruction."""


@dataclass
class GroupLayout:
    """What a group says about itself in its hello reply."""

    method: str
    replicas: int
    shards: int
    world: int
    rendezvous_host: str = ""
    rendezvous_ports: list[int] = field(default_factory=list)

    def mismatch(self, run: Any) -> str:
        """'' when this group can run `run` (a FlowerRun), else a sentence naming the difference."""
        p = run.train.parallel
        if (self.method, self.replicas, self.shards) == (p.method, p.replicas, p.shards):
            return ""
        hint = ("; on the decentralised path, partition iid-groups or document lets groups of any S sync together"
                if (self.method, self.replicas) == (p.method, p.replicas) and run.federation.aggregation ==
                "decentralized" else "")
        return (f"the run config asks for {p.method} with R={p.replicas} x S={p.shards} = {p.replicas * p.shards} "
                f"ranks per group, but this group runs {self.method} with R={self.replicas} x S={self.shards} = "
                f"{self.world} ranks; relaunch the group or change the run config{hint}")
