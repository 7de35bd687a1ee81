"""A cluster description (the planner's YAML): tiers, bandwidths, latencies, memory and FLOP/s, parsed and validated."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.costmodel import BACKENDS, Calibration
from flwr_sharded_perf.placement import TIERS, Placement


@dataclass(frozen=True)
class Cluster:
    """A GPU cluster with a three-tier network: inside a node, between nodes of a group, between groups."""

    name: str
    gpus_per_node: int
    nodes: int
    nodes_per_group: int | None
    """Nodes per rack / cell / facility; None: all nodes in one group (no inter-group tier)."""
    bandwidth: dict[str, float]
    """Bandwidth per tier (intra_node, inter_node, inter_group) one flow of a ring collective gets, bits/s."""
    latency: dict[str, float]
    """Start-up latency of one sequential step of a collective per tier, seconds (0 if not given): the alpha term,
    always with a `calibration`, else only with `plan --latency`."""
    gpu_memory: float
    flops_per_gpu: float
    """Achievable (not peak) FLOP/s per GPU for training."""
    backend: str = "nccl"
    """Collective library: nccl, or gloo (whose reduce-scatter costs an all-reduce)."""
    shared: tuple[str, ...] = ()
    """Tiers whose bandwidth is one uplink per node (inter_node) or per node group (inter_group), divided among the
    flows leaving it at once (e.g. tbf-shaped links); other tiers give every flow their full bandwidth."""
    calibration: Calibration | None = None
    """The calibrated model's parameters (with it the latency per step always counts); None: the paper's model."""

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def placement(self, F: int, R: int, S: int) -> Placement:
        """Placement of an F x R x S mesh on this cluster."""
        return Placement(F=F, R=R, S=S, gpus_per_node=self.gpus_per_node, nodes_per_group=self.nodes_per_group)


_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BANDWIDTH = re.compile(rf"^{_NUMBER}\s*([kKMGT]?)(bit|bits|b|B|byte|bytes)(?:/s|ps)?$")
_MEMORY = re.compile(rf"^{_NUMBER}\s*([kKMGT]i?)?(B|bytes?)$")
_LATENCY = re.compile(rf"^{_NUMBER}\s*(s|ms|us|µs|ns)$")
_FLOPS = re.compile(rf"^{_NUMBER}\s*([kKMGTP]?)(?:FLOPS|FLOP/s|flops)?$")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _parse(value: Any, field: str, pattern: re.Pattern, scale: Any, example: str, allow_zero: bool = False) -> float:
    """A number, or a string matched by `pattern` whose groups `scale(match)` turns into the unit's multiplier."""
    amount = _number(value)
    if amount is None and isinstance(value, str):
        m = pattern.match(value.strip())
        if m:
            amount = float(m.group(1)) * scale(m)
    if amount is None or not math.isfinite(amount) or amount < 0 or (amount == 0 and not allow_zero):
        raise ConfigError(f"{field}: expected {example}, got {value!r}")
    return amount


def parse_bandwidth(value: Any, field: str = "bandwidth") -> float:
    """Bits/s from a number (bits/s) or a string: '200Gbit', '7.5Gbit/s', '100Mbps', '25GB/s' (bytes: x 8)."""
    return _parse(value, field, _BANDWIDTH, lambda m: _PREFIX[m.group(2)] * (8 if m.group(3).startswith("B") else 1),
                  "a positive bandwidth such as '200Gbit', '100Mbit/s', '25GB/s' or a number of bits/s")


def parse_memory(value: Any, field: str = "gpu_memory") -> float:
    """Bytes from a number or a string: '64GB' (decimal, 64e9), '64GiB' (binary)."""
    return _parse(value, field, _MEMORY, lambda m: _PREFIX[m.group(2) or ""],
                  "a positive size such as '64GB', '80GiB' or a number of bytes")


def parse_latency(value: Any, field: str = "latency") -> float:
    """Seconds from a number or a string: '5us', '2ms', '1e-6s'."""
    return _parse(value, field, _LATENCY, lambda m: _SECONDS[m.group(2)],
                  "a latency >= 0 such as '5us', '2ms' or a number of seconds", allow_zero=True)


def parse_flops(value: Any, field: str = "flops_per_gpu") -> float:
    """FLOP/s from a number or a string: '150T', '150TFLOPS', '5GFLOP/s'."""
    return _parse(value, field, _FLOPS, lambda m: _PREFIX[m.group(2)],
                  "a positive rate such as '150TFLOPS' or a number of FLOP/s")


def _count(data: dict, key: str, where: str, required: bool = True) -> int | None:
    value = data.get(key)
    if value is None and required:
        raise ConfigError(f"{where}: missing field '{key}' (a positive integer)")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _check_known(data: dict, known: set[str], where: str, beside: str = "", hint: str = "") -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}{beside}; known: {', '.join(sorted(known))}"
                          f"{hint}")


_CLUSTER_KEYS = {"name", "description", "gpus_per_node", "nodes", "nodes_per_group", "bandwidth", "latency",
                 "gpu_memory", "flops_per_gpu", "backend", "shared", "calibration"}
_SHAREABLE = ("inter_node", "inter_group")


def cluster_from_dict(data: Any, where: str = "cluster") -> Cluster:
    """Validate a cluster description (the YAML's mapping); ConfigError names the offending field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of cluster fields, got {type(data).__name__}")
    _check_known(data, _CLUSTER_KEYS, where)
    gpus_per_node = _count(data, "gpus_per_node", where)
    nodes = _count(data, "nodes", where)
    nodes_per_group = _count(data, "nodes_per_group", where, required=False)
    if nodes_per_group is not None and nodes_per_group > nodes:
        raise ConfigError(f"{where}: field 'nodes_per_group' ({nodes_per_group}) exceeds 'nodes' ({nodes})")
    needed = {"intra_node": gpus_per_node > 1, "inter_node": nodes > 1 and (nodes_per_group or nodes) > 1,
              "inter_group": nodes_per_group is not None and nodes_per_group < nodes}
    tables: dict[str, dict[str, float]] = {}
    for key, parse, required in (("bandwidth", parse_bandwidth, True), ("latency", parse_latency, False)):
        table = data.get(key) if required else data.get(key) or {}
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: field '{key}' must be a mapping of tiers ({', '.join(TIERS)}), "
                              f"got {table!r}")
        bad = sorted(set(table) - set(TIERS))
        if bad:
            raise ConfigError(f"{where}: {key}.{bad[0]}: unknown tier; use {', '.join(TIERS)}")
        tables[key] = {t: parse(v, f"{where}: {key}.{t}") for t, v in table.items()}
    for tier, need in needed.items():
        if need and tier not in tables["bandwidth"]:
            raise ConfigError(f"{where}: missing field 'bandwidth.{tier}' (this cluster's ranks use that tier)")
    for key in ("gpu_memory", "flops_per_gpu"):
        if data.get(key) is None:
            raise ConfigError(f"{where}: missing field '{key}'")
    backend = data.get("backend", "nccl")
    if backend not in BACKENDS:
        raise ConfigError(f"{where}: field 'backend' must be one of {', '.join(BACKENDS)}, got {backend!r}")
    shared = data.get("shared", [])
    if not isinstance(shared, list) or any(t not in _SHAREABLE for t in shared):
        raise ConfigError(f"{where}: field 'shared' must be a list of tiers among {', '.join(_SHAREABLE)}, "
                          f"got {shared!r}")
    for tier in shared:
        if tier not in tables["bandwidth"]:
            raise ConfigError(f"{where}: field 'shared' lists {tier} but 'bandwidth.{tier}' is not given")
    calibration = data.get("calibration")
    return Cluster(name=str(data.get("name", where)), gpus_per_node=gpus_per_node, nodes=nodes,
                   nodes_per_group=nodes_per_group, bandwidth=tables["bandwidth"],
                   latency={t: tables["latency"].get(t, 0.0) for t in TIERS},
                   gpu_memory=parse_memory(data["gpu_memory"], f"{where}: gpu_memory"),
                   flops_per_gpu=parse_flops(data["flops_per_gpu"], f"{where}: flops_per_gpu"), backend=backend,
                   shared=tuple(shared),
                   calibration=None if calibration is None else _calibration(calibration, f"{where}: calibration"))


def _calibration(data: Any, where: str) -> Calibration:
    """Validate a `calibration` mapping; ConfigError names the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    _check_known(data, {"tree_allreduce", "uplink", "efficiency", "overlap", "memory_bandwidth"}, where)
    for flag in ("tree_allreduce", "overlap"):
        if not isinstance(data.get(flag, False), bool):
            raise ConfigError(f"{where}.{flag}: expected true or false, got {data[flag]!r}")
    for key, allowed in (("uplink", _SHAREABLE), ("efficiency", TIERS)):
        table = data.get(key, {})
        if not isinstance(table, dict) or any(t not in allowed for t in table):
            raise ConfigError(f"{where}.{key}: expected a mapping of tiers among {', '.join(allowed)}, got {table!r}")
    uplink = {t: parse_bandwidth(v, f"{where}.uplink.{t}") for t, v in data.get("uplink", {}).items()}
    for tier, value in data.get("efficiency", {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"{where}.efficiency.{tier}: expected a share in (0, 1], got {value!r}")
    mem = data.get("memory_bandwidth", 0)
    return Calibration(tree_allreduce=data.get("tree_allreduce", False), uplink=uplink,
                       efficiency={t: float(v) for t, v in data.get("efficiency", {}).items()},
                       overlap=data.get("overlap", False),
                       memory_bandwidth=0.0 if mem == 0 else parse_bandwidth(mem, f"{where}.memory_bandwidth") / 8)


@dataclass(frozen=True)
class FacilityFederation:
    """Facilities of their own sizes and GPUs (one `Cluster` each, a single node group), joined by one network."""

    name: str
    facilities: tuple[Cluster, ...]
    """Each facility's nodes, GPUs and inner tiers, named (its `name`), in member order."""
    inter_group: float
    """Bits/s one flow between two facilities gets."""
    shared: bool = False
    """Whether each facility's flows to the others share one uplink of `inter_group` (`shared: [inter_group]`)."""

    @property
    def gpus(self) -> int:
        return sum(f.gpus for f in self.facilities)


_FEDERATION_KEYS = {"name", "description", "facilities", "bandwidth", "latency", "gpu_memory", "flops_per_gpu",
                    "backend", "shared"}
_FACILITY_KEYS = _CLUSTER_KEYS - {"nodes_per_group", "shared"}


def federation_from_dict(data: dict, where: str = "cluster") -> FacilityFederation:
    """Validate a federation (`facilities:` a list of facility mappings; the top level's `bandwidth.inter_group`
    between them, its other fields every facility's defaults); ConfigError names the facility and field."""
    _check_known(data, _FEDERATION_KEYS, where, " beside 'facilities'", " (a facility's nodes go in its own entry)")
    entries = data["facilities"]
    if not isinstance(entries, list) or len(entries) < 2:
        raise ConfigError(f"{where}: field 'facilities' must list at least two facilities, got {entries!r}")
    bandwidth = data.get("bandwidth") or {}
    if not isinstance(bandwidth, dict) or "inter_group" not in bandwidth:
        raise ConfigError(f"{where}: missing field 'bandwidth.inter_group' (between the facilities)")
    inter_group = parse_bandwidth(bandwidth["inter_group"], f"{where}: bandwidth.inter_group")
    shared = data.get("shared", [])
    if shared not in ([], ["inter_group"]):
        raise ConfigError(f"{where}: field 'shared' of a federation may list only inter_group, got {shared!r}")
    defaults = {k: v for k, v in data.items() if k in ("latency", "gpu_memory", "flops_per_gpu", "backend")}
    inner = {t: v for t, v in bandwidth.items() if t != "inter_group"}
    facilities, names = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: facilities[{i}]: expected a mapping of facility fields, got {entry!r}")
        name = str(entry.get("name", f"facility-{i}"))
        here = f"{where}: facility {name}"
        if name in names:
            raise ConfigError(f"{here}: two facilities have this name")
        names.add(name)
        _check_known(entry, _FACILITY_KEYS, here)
        own = entry.get("bandwidth") or {}
        if not isinstance(own, dict):
            raise ConfigError(f"{here}: field 'bandwidth' must be a mapping of tiers, got {own!r}")
        merged = {**defaults, **entry, "name": name, "bandwidth": {**inner, **own}}
        if "inter_group" in merged["bandwidth"]:
            raise ConfigError(f"{here}: bandwidth.inter_group is the federation's (top level), not a facility's")
        facilities.append(cluster_from_dict(merged, where=here))
    return FacilityFederation(name=str(data.get("name", where)), facilities=tuple(facilities),
                              inter_group=inter_group, shared=bool(shared))


def load_description(path: str | Path) -> Cluster | FacilityFederation:
    """Read and validate a cluster YAML file (examples/clusters/): a `FacilityFederation` if it lists `facilities`."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--cluster: cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--cluster: {path} is not valid YAML: {exc}") from exc
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": path.stem}
    if isinstance(data, dict) and "facilities" in data:
        return federation_from_dict(data, where=str(path))
    return cluster_from_dict(data, where=str(path))


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file of one cluster (not a federation of facilities)."""
    found = load_description(path)
    if isinstance(found, FacilityFederation):
        raise ConfigError(f"--cluster: {path} describes a federation of facilities; only `flwr-sharded plan` "
                          f"plans one")
    return found
