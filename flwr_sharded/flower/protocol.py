"""What the thin ClientApp and a group runtime say to each other, and the run settings both ends share. Torch-free.

Two hops carry an instruction:

    ServerApp --(Flower Message: ConfigRecord "config")--> ClientApp --(local endpoint: JSON)--> group rank 0

The local endpoint is `multiprocessing.connection` (authkey challenge/response) carrying JSON bytes
(`send_bytes`/`recv_bytes`, never pickle). An instruction is `{"verb": ..., "args": {...}}`; a reply is
`{"ok": bool, "error": str, "result": {...}}`.

`RunSpec` holds the training settings of a Flower run (model, layout, schedule, data); it travels as JSON inside
the hello message, and the group turns it into a `TrainConfig` of one federation group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from flwr_sharded.config import METHODS, config_from_dict, default_data_dir, outer_rule, validate

from flwr_sharded.errors import ConfigError

PROTOCOL_VERSION = 1
AGGREGATIONS = ("decentralized", "server")

# ----- verbs ------------------------------------------------------------------------------------------------------
HELLO = "hello"
"""Set up (or reuse) the run's trainer; reply with the group's layout, fingerprint and rendezvous offer."""
TRAIN = "train"
"""K sync periods of A local steps, each followed by a shard sync with the named members."""
EVALUATE = "evaluate"
"""Held-out loss and perplexity of the group's current weights."""
STATUS = "status"
"""Liveness and progress; changes nothing."""
APPLY = "apply"
"""Server path: every rank assembles its own rows of the server's mean from the chunk files and steps the outer
rule."""
PULL = "pull"
"""Server path, answered by the ClientApp alone: rows of the pieces its group exported this round."""
SAVE = "save"
"""Merge the group's shards and write a Hugging Face model directory."""
FINISH = "finish"
"""The run is over: drop the trainer (free memory), keep serving."""
SHUTDOWN = "shutdown"
"""Exit every rank of the group."""
VERBS = (HELLO, TRAIN, APPLY, EVALUATE, STATUS, SAVE, FINISH, SHUTDOWN)

# ----- Flower message types (ClientApp routes) --------------------------------------------------------------------
MSG_HELLO = "query.hello"
MSG_TRAIN = "train"
MSG_EVALUATE = "evaluate"
MSG_APPLY = "query.apply"
MSG_PULL = "query.pull"
MSG_FINISH = "query.finish"

# ----- Flower record names ----------------------------------------------------------------------------------------
CONFIG = "config"
"""ConfigRecord the ServerApp sends."""
METRICS = "metrics"
"""MetricRecord of numbers (and lists of numbers) in a reply."""
INFO = "info"
"""ConfigRecord of strings/bools in a reply (ok, error, host, fingerprint, ...)."""

MAX_MESSAGE_BYTES = 64 << 20
"""Largest instruction or reply accepted on the local endpoint."""


class ProtocolError(RuntimeError):
    """A malformed instruction or reply on the local endpoint."""


def encode(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"not a JSON message: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def instruction(verb: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if verb not in VERBS:
        raise ProtocolError(f"unknown verb {verb!r}; known: {', '.join(VERBS)}")
    return {"version": PROTOCOL_VERSION, "verb": verb, "args": dict(args or {})}


def check_instruction(obj: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
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


# ----- addresses and keys -----------------------------------------------------------------------------------------
def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); the port may be 0 (pick a free one) only where a server listens."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {text!r} is not host:port")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_authkey(path: str | Path) -> bytes:
    """Create `path` (mode 0600) holding a fresh random key; returns the key bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    return key


def read_authkey(path: str | Path) -> bytes:
    """The key in `path` (surrounding whitespace stripped); refuses a missing, empty or world-readable file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"authkey file {path} does not exist")
    if path.stat().st_mode & (stat.S_IRWXO):
        raise ConfigError(f"authkey file {path} is accessible by other users; chmod 600 {path}")
    key = path.read_bytes().strip()
    if len(key) < 16:
        raise ConfigError(f"authkey file {path} holds {len(key)} bytes; use at least 16 (e.g. `openssl rand -hex 32`)")
    return key


# ----- run settings -----------------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    """Training settings of one Flower run, shared by the ServerApp (validation) and every group (training).

    Field names are the run-config keys with '-' replaced by '_'.
    """

    method: str = "fl-fsdp"
    """fl-fsdp (R = 1) or fl-hsdp (R > 1): how each group is laid out."""
    replicas: int = 1
    """R: replication groups inside each Flower group."""
    shards: int = 2
    """S: ranks one model replica is sharded over; each group has R*S ranks."""
    aggregate_every: int = 8
    """A: local optimizer steps between two shard syncs."""
    syncs_per_round: int = 4
    """K: sync periods per Flower round (one round = K*A local steps and K syncs)."""
    rounds: int = 3
    """N: Flower rounds; the learning-rate schedule spans rounds*K*A steps."""
    model: str = "tiny"
    """Model preset, Hugging Face id or local directory."""
    precision: str = "auto"
    """auto, fp32 or bf16."""
    dataset: str = "shakespeare"
    """shakespeare (embedded, offline), a Hugging Face dataset id, or a local file/directory."""
    dataset_config: str = ""
    """Hub dataset configuration name ('' for none)."""
    data_dir: str = ""
    """Prepared data directory; '' means the group's default (`$FLWR_SHARDED_DATA` or ~/.cache/flwr_sharded)."""
    tokenizer: str = ""
    """Tokenizer id or path; '' uses the one prepared in data_dir."""
    seq_len: int = 64
    """Tokens per training block."""
    batch_size: int = 4
    """Sequences per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    partition: str = "iid"
    """iid, iid-groups (disjoint for groups of different sizes: needed with facility-shards) or document."""
    max_train_blocks: int = 0
    """Use at most this many training blocks (0: all)."""
    eval_blocks: int = 16
    """Held-out blocks per evaluation."""
    optimizer: str = "adamw"
    lr: float = 3e-3
    """Peak learning rate."""
    warmup: float = 0.1
    """Warm-up: fraction of the total steps (< 1) or steps."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 42
    bucket_mb: float = 64.0
    """Shard-sync bucket size in MiB."""
    sync_dtype: str = "float32"
    """Wire dtype of the groups' shard all-reduce: float32, or bfloat16 (sends each group's weighted delta from the
    global model, half the bytes; every rank keeps the global shards in fp32)."""
    reset_optimizer_state: bool = False
    """Clear the inner optimizer's state after each sync."""
    outer: str = "fedavg"
    """How synced shards are combined: fedavg, fedavgm, nesterov (DiLoCo), fedadam, fedyogi, trimmed-mean."""
    outer_lr: float = 0.0
    """Outer learning rate (0: the rule's default)."""
    outer_momentum: float = -1.0
    """Outer momentum of fedavgm/nesterov (negative: the rule's default, 0.9)."""
    aggregation: str = "decentralized"
    """decentralized (groups all-reduce shards among themselves) or server (shards travel through the Flower server,
    for groups that share no network; groups of one facility still all-reduce among themselves)."""
    checkpoint_dir: str = ""
    """Each group checkpoints under <checkpoint-dir>/group-<partition id> (a path its nodes can write); '' for none."""
    checkpoint_every: int = 1
    """Checkpoint after every N-th round (and after the last one)."""
    resume: bool = False
    """Groups load their newest checkpoint at hello, and the run goes on after the round it holds."""
    facilities: str = ""
    """Server path: facility of each group by partition id, comma-separated (e.g. "a,a,b,b"); a SuperNode's node
    config `facility` overrides it; '' puts every group in a facility of its own."""
    facility_shards: str = ""
    """Server path: S of the groups of some facilities, e.g. "b=1" (others use `shards`); their ranks then hold
    other rows, which the server combines row by row. Needs partition iid-groups or document."""
    server_buffer_mb: float = 128.0
    """Server path: the largest chunk, in MiB of fp32 rows. The model travels in chunks of global rows (at most
    this, and at most a sixteenth of the model or 8 MiB, whichever is larger), each pulled, averaged and sent back
    before the next; server memory is a few chunks (Flower holds several copies of one while it moves it), whatever
    the model size and F. Each chunk costs one message per group (a few seconds in a deployment): smaller means
    less memory but slower."""

    # ----- conversions ----------------------------------------------------------------------------------------
    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSpec:
        """Pick this spec's keys out of a Flower run config (other keys are ignored); 'num-server-rounds' -> rounds.

        Raises ConfigError for a value of the wrong type.
        """
        values: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in run_config.items():
            name = "rounds" if key == "num-server-rounds" else key.replace("-", "_")
            if name not in fields:
                continue
            default = fields[name].default
            values[name] = _coerce(value, type(default), key)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"run spec has unknown keys {unknown}")
        return cls(**raw)

    @property
    def group_world(self) -> int:
        return self.replicas * self.shards

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: rounds * K * A (the span of the learning-rate schedule)."""
        return self.rounds * self.syncs_per_round * self.aggregate_every

    def train_config_dict(self) -> dict[str, Any]:
        """The nested dict (`config_from_dict` layout) of ONE federation group's TrainConfig for this run."""
        data: dict[str, Any] = {"dataset": self.dataset, "data_dir": self.data_dir or default_data_dir(),
                                "seq_len": self.seq_len, "partition": self.partition,
                                "eval_blocks": self.eval_blocks}
        if self.dataset_config:
            data["dataset_config"] = self.dataset_config
        if self.tokenizer:
            data["tokenizer"] = self.tokenizer
        if self.max_train_blocks:
            data["max_train_blocks"] = self.max_train_blocks
        return {
            "parallel": {"method": self.method, "federations": 1, "replicas": self.replicas, "shards": self.shards,
                         "aggregate_every": self.aggregate_every, "bucket_mb": self.bucket_mb,
                         "sync_dtype": self.sync_dtype,
                         "reset_optimizer_state": self.reset_optimizer_state, "outer": self.outer,
                         "outer_lr": self.outer_lr if self.outer_lr > 0 else None,
                         "outer_momentum": self.outer_momentum if self.outer_momentum >= 0 else None},
            "model": {"name": self.model, "precision": self.precision},
            "data": data,
            "optim": {"optimizer": self.optimizer, "lr": self.lr, "warmup": self.warmup,
                      "min_lr_ratio": self.min_lr_ratio, "weight_decay": self.weight_decay,
                      "grad_clip": self.grad_clip},
            "steps": self.total_steps, "batch_size": self.batch_size, "grad_accum": self.grad_accum,
            "seed": self.seed, "eval_every": 0, "progress": False,
        }

    def validate(self) -> None:
        """Check the settings without touching files; raises ConfigError naming the run-config key."""
        fl_methods = [m for m in METHODS if m.startswith("fl-")]
        if self.method not in fl_methods:
            raise ConfigError(f"run config 'method' must be one of {', '.join(fl_methods)} (each Flower client is "
                              f"one federation group); got {self.method!r}")
        for key, value in (("replicas", self.replicas), ("shards", self.shards),
                           ("aggregate-every", self.aggregate_every), ("syncs-per-round", self.syncs_per_round),
                           ("num-server-rounds", self.rounds), ("seq-len", self.seq_len),
                           ("batch-size", self.batch_size), ("grad-accum", self.grad_accum)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"run config '{key}' must be an integer >= 1, got {value!r}")
        if self.method == "fl-fsdp" and self.replicas != 1:
            raise ConfigError(f"run config: method fl-fsdp has no replication, so 'replicas' must be 1 "
                              f"(got {self.replicas}); use method fl-hsdp for R > 1")
        if not isinstance(self.checkpoint_every, int) or isinstance(self.checkpoint_every, bool) \
                or self.checkpoint_every < 1:
            raise ConfigError(f"run config 'checkpoint-every' must be an integer >= 1, got {self.checkpoint_every!r}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("run config 'resume' = true needs 'checkpoint-dir' (where the groups' checkpoints are)")
        if self.outer_lr < 0:
            raise ConfigError(f"run config 'outer-lr' must be > 0, or 0 for the rule's default; got {self.outer_lr!r}")
        if not isinstance(self.max_train_blocks, int) or self.max_train_blocks < 0:
            raise ConfigError(f"run config 'max-train-blocks' must be an integer >= 0 (0: all blocks); got "
                              f"{self.max_train_blocks!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"run config 'aggregation' must be one of {', '.join(AGGREGATIONS)}; "
                              f"got {self.aggregation!r}")
        if self.facilities and any(not f.strip() for f in self.facilities.split(",")):
            raise ConfigError(f"run config 'facilities' must be comma-separated non-empty names, one per partition "
                              f"id (e.g. \"a,a,b,b\"); got {self.facilities!r}")
        try:
            shards_by_facility = self.shards_by_facility()
        except ValueError:
            raise ConfigError(f"run config 'facility-shards' must be comma-separated facility=S pairs with S >= 1 "
                              f"(e.g. \"b=1\"); got {self.facility_shards!r}") from None
        if shards_by_facility and self.aggregation != "server":
            raise ConfigError("run config 'facility-shards' gives facilities their own S, which only the server path "
                              "can combine; set aggregation=\"server\"")
        if shards_by_facility and self.partition == "iid":
            raise ConfigError("run config 'facility-shards': with groups of different sizes, partition \"iid\" "
                              "would give some blocks to two groups; use partition=\"iid-groups\" or \"document\"")
        if not self.server_buffer_mb > 0:
            raise ConfigError(f"run config 'server-buffer-mb' must be > 0, got {self.server_buffer_mb!r}")
        if self.facilities and self.aggregation != "server":
            raise ConfigError("run config 'facilities' groups clients for the server path; set aggregation=\"server\" "
                              "or leave facilities empty")
        try:
            cfg = config_from_dict(self.train_config_dict())
            validate(cfg)
        except ConfigError as exc:
            raise ConfigError("run config: " + str(exc).replace("--", "")) from None
        if self.aggregation == "server":
            if not outer_rule(cfg.parallel).linear:
                raise ConfigError(f"run config 'outer' = {self.outer!r} needs every member's shards at once, but "
                                  f"aggregation=\"server\" streams a weighted mean; use a linear rule (fedavg, "
                                  f"fedavgm, nesterov, fedadam, fedyogi) or aggregation=\"decentralized\"")

    def checkpoint_due(self, server_round: int) -> bool:
        """Whether the groups checkpoint at the end of this round."""
        return bool(self.checkpoint_dir) and (server_round % self.checkpoint_every == 0 or server_round == self.rounds)

    def shards_by_facility(self) -> dict[str, int]:
        """`facility_shards` as a dict; ValueError if malformed."""
        out: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in self.facility_shards.split(","))):
            name, sep, value = item.partition("=")
            if not sep or not name.strip() or int(value) < 1:
                raise ValueError(item)
            out[name.strip()] = int(value)
        return out

    def for_group(self, partition_id: int, node_facility: str = "") -> RunSpec:
        """This spec with S set for the group of `partition_id` (its facility: the node config's, else the
        run config's `facilities`)."""
        facility = node_facility or self.facility_of(partition_id)
        shards = self.shards_by_facility().get(facility, self.shards)
        return self if shards == self.shards else dataclasses.replace(self, shards=shards)

    def facility_of(self, partition_id: int) -> str:
        """The facility named for a partition id by `facilities` ('' when not named there)."""
        names = [f.strip() for f in self.facilities.split(",")] if self.facilities else []
        return names[partition_id] if 0 <= partition_id < len(names) else ""


def _coerce(value: Any, typ: type, key: str) -> Any:
    """Run-config values arrive as TOML scalars: accept int for float, reject other mismatches."""
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if typ is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"run config '{key}' must be of type {typ.__name__}, got {value!r}")
    return value


@dataclass
class GroupLayout:
    """What a group says about itself in its hello reply."""

    method: str
    replicas: int
    shards: int
    world: int
    rendezvous_host: str = ""
    rendezvous_ports: list[int] = field(default_factory=list)

    def mismatch(self, spec: RunSpec) -> str:
        """'' when this group can run `spec`, else a sentence naming the difference."""
        if (self.method, self.replicas, self.shards) == (spec.method, spec.replicas, spec.shards):
            return ""
        return (f"the run config asks for {spec.method} with R={spec.replicas} x S={spec.shards} = "
                f"{spec.group_world} ranks per group, but this group runs {self.method} with R={self.replicas} x "
                f"S={self.shards} = {self.world} ranks; relaunch the group or change the run config")
