"""What the ServerApp records of each round and of the run: the round record (token-weighted metrics, timings,
checksums), its log line, and the run's summary."""

from __future__ import annotations

import math
from logging import ERROR, INFO
from typing import Any

from flwr.supercore import log

from flwr_sharded.run_dir import perplexity


def round_record(server_round: int, members: list[int], ok: dict[int, dict[str, Any]],
                 rolled_back: dict[int, dict[str, Any]], dropped: dict[int, str], round_s: float, group_world: int,
                 rejoined: list[int], layouts: dict[str, str] | None = None) -> dict[str, Any]:
    """One round of the run: token-weighted per-step losses, throughput, timings of the slowest group, the groups'
    checksums after every sync (compared between groups of one `layouts`' "R x S"), and who failed why."""
    alive = {**ok, **rolled_back}
    tokens = {n: float(m.get("tokens", 0)) for n, m in alive.items()}
    total_tokens = sum(tokens.values())
    losses_by_node = {n: [float(x) for x in m.get("losses", [])] for n, m in alive.items()}
    steps = min((len(v) for v in losses_by_node.values()), default=0)
    weights = {n: (tokens[n] or 1.0) for n in alive}
    weight_sum = sum(weights.values()) or 1.0
    step_losses = [sum(weights[n] * losses_by_node[n][i] for n in alive) / weight_sum for i in range(steps)]
    if len({len(v) for v in losses_by_node.values()}) > 1:  # members of their own steps: each one's mean loss
        means = {n: sum(v) / len(v) for n, v in losses_by_node.items() if v}
        train_loss = sum(weights[n] * x for n, x in means.items()) / (sum(weights[n] for n in means) or 1.0)
    else:
        train_loss = sum(step_losses) / len(step_losses) if step_losses else float("nan")
    slowest = {key: max((float(m.get(key, 0)) for m in alive.values()), default=0.0)
               for key in ("train_s", "sync_s", "eval_s")}
    work_s = max((sum(float(m.get(k, 0)) for k in slowest) for m in alive.values()), default=0.0)
    evals = [float(m["eval_loss"]) for m in alive.values() if "eval_loss" in m]
    checksums = {str(n): [float(x) for x in m["checksums"]] for n, m in alive.items() if "checksums" in m}
    syncs = min((int(m.get("syncs", 0)) for m in alive.values()), default=0)
    record: dict[str, Any] = {
        "kind": "round", "round": server_round, "groups": len(ok), "rolled_back": len(rolled_back),
        "dropped": len(dropped), "members": [str(n) for n in members], "rejoined": [str(n) for n in rejoined],
        "synced": int(bool(ok) and not rolled_back and not dropped), "syncs": syncs, "steps": steps,
        "train_loss": train_loss, "train_ppl": perplexity(train_loss), "tokens": int(total_tokens),
        **timings(total_tokens, work_s, round_s), **slowest, "work_s": work_s,
        "checksums_equal": int(all(checksums_equal(same, syncs, world)
                                   for world, same in by_layout(checksums, layouts or {}, group_world))),
        "losses": step_losses, "checksums": checksums,
        "sync_bytes": {str(n): int(m["sync_bytes"]) for n, m in alive.items() if "sync_bytes" in m},
        "errors": {str(n): e for n, e in dropped.items()} | {
            str(n): str(m.get("sync_error", "")) for n, m in rolled_back.items()},
    }
    local = {str(n): int(m["local_steps"]) for n, m in alive.items() if "local_steps" in m}
    if len(set(local.values())) > 1:
        record["member_steps"] = local
    record.update(member_timings(alive))
    member_layouts = {str(n): (layouts or {}).get(str(n), "") for n in members}
    if len(set(member_layouts.values())) > 1:
        record["layouts"] = member_layouts
    if evals:
        record["eval_loss"] = sum(evals) / len(evals)
        record["eval_ppl"] = perplexity(record["eval_loss"])
    return record


def timings(tokens: float, work_s: float, round_s: float) -> dict[str, float]:
    """A round's wall time, throughput and orchestration overhead (its time beyond the slowest group's work)."""
    overhead = max(0.0, round_s - work_s)
    return {"round_s": round_s, "tokens_per_s": tokens / round_s if round_s > 0 else 0.0, "overhead_s": overhead,
            "overhead_pct": 100.0 * overhead / round_s if round_s > 0 else 0.0}


def member_timings(replies: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each member's pace (node -> seconds; {} with fewer than two that synced): `step_s` per inner step,
    `sync_period_s` per sync (steps and sync), `idle_s_per_sync` its sync time beyond the shortest member's (the
    syncs end together: the excess is how early it arrived)."""
    synced = {str(n): m for n, m in replies.items() if m.get("syncs") and m.get("steps")}
    if len(synced) < 2:
        return {}
    sync = {n: float(m.get("sync_s", 0.0)) / int(m["syncs"]) for n, m in synced.items()}
    shortest = min(sync.values())
    return {"step_s": {n: float(m.get("train_s", 0.0)) / int(m["steps"]) for n, m in synced.items()},
            "sync_period_s": {n: (float(m.get("train_s", 0.0)) + float(m.get("sync_s", 0.0))) / int(m["syncs"])
                              for n, m in synced.items()},
            "idle_s_per_sync": {n: x - shortest for n, x in sync.items()}}


def note_checkpoint_errors(server_round: int, replies: dict[int, dict[str, Any]], record: dict[str, Any]) -> None:
    """Log each group whose checkpoint write failed (it trains on) and record them in `checkpoint_errors`."""
    errors = {node: str(m["checkpoint_error"]) for node, m in replies.items() if m.get("checkpoint_error")}
    for node, error in errors.items():
        log(ERROR, "round %d: group on node %d could not write its checkpoint, it trains on: %s", server_round, node,
            error)
    if errors:
        record["checkpoint_errors"] = {str(n): e for n, e in errors.items()}


def checksums_equal(checksums: dict[str, list[float]], syncs: int, group_world: int) -> bool:
    """After each of the first `syncs` syncs, every group's rank holding shard s has the same checksum."""
    if len(checksums) < 2 or syncs == 0:
        return True
    vectors = [v[: syncs * group_world] for v in checksums.values()]
    if any(len(v) < syncs * group_world for v in vectors):
        return False
    return all(v == vectors[0] for v in vectors[1:])


def by_layout(checksums: dict[str, list[float]], layouts: dict[str, str],
              group_world: int) -> list[tuple[int, dict[str, list[float]]]]:
    """The checksums split by the groups' layouts ("R x S"), each with its world R x S (unknown: `group_world`)."""
    out: dict[str, dict[str, list[float]]] = {}
    for node, sums in checksums.items():
        out.setdefault(layouts.get(node, ""), {})[node] = sums
    return [(math.prod(int(x) for x in layout.split("x")) if layout else group_world, same)
            for layout, same in out.items()]


def log_round(r: dict[str, Any]) -> None:
    eval_part = f", eval ppl {r['eval_ppl']:.2f}" if "eval_ppl" in r else ""
    log(INFO, "round %d: train loss %.4f ppl %.2f%s | %.0f tokens/s | %d group(s), %d sync(s)%s | round %.2f s"
        " = groups' work %.2f s (train %.2f + sync %.2f + eval %.2f) + orchestration %.2f s (%.1f%%)",
        r["round"], r["train_loss"], r["train_ppl"], eval_part, r["tokens_per_s"], r["groups"] + r["rolled_back"],
        r["syncs"], "" if r["synced"] else " [SYNC FAILED: rolled back]", r["round_s"], r["work_s"],
        r["train_s"], r["sync_s"], r["eval_s"], r["overhead_s"], r["overhead_pct"])
    if r["syncs"] and not r["checksums_equal"]:
        log(ERROR, "round %d: the groups' shard checksums differ after a sync", r["round"])


def summary(history: list[dict[str, Any]], seconds: float, members: list[int],
            left_out: dict[int, str], layouts: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The run's summary record over its round records (None before any round)."""
    rounds = [h for h in history if h.get("kind") == "round"]
    if not rounds:
        return None
    round_s = sum(h["round_s"] for h in rounds)
    overhead = sum(h["overhead_s"] for h in rounds)
    tokens = sum(h["tokens"] for h in rounds)
    return {"kind": "summary", "rounds": len(rounds), "seconds": seconds, "round_s": round_s,
            "overhead_s": overhead, "overhead_pct": 100.0 * overhead / round_s if round_s else 0.0,
            "tokens": tokens, "tokens_per_s": tokens / round_s if round_s else 0.0,
            "final_train_loss": rounds[-1]["train_loss"], "final_train_ppl": rounds[-1]["train_ppl"],
            "final_eval_ppl": rounds[-1].get("eval_ppl"), "members": [str(m) for m in members],
            "left_out": {str(k): v for k, v in left_out.items()}, "layouts": dict(layouts or {})}


def log_summary(s: dict[str, Any], history: list[dict[str, Any]]) -> None:
    log(INFO, "")
    log(INFO, "Summary: %d round(s) in %.1f s (run %.1f s); orchestration overhead %.2f s = %.1f%% of round time;"
        " %.0f tokens/s", s["rounds"], s["round_s"], s["seconds"], s["overhead_s"], s["overhead_pct"],
        s["tokens_per_s"])
    if s.get("layouts"):
        log(INFO, "  groups (R x S): %s", ", ".join(f"node {n}: {layout}" for n, layout in s["layouts"].items()))
    log(INFO, "  round | train ppl | eval ppl | tokens/s | round s | work s | overhead")
    for h in history:
        if h.get("kind") == "round":
            log(INFO, "  %5d | %9.2f | %8s | %8.0f | %7.2f | %6.2f | %5.1f%%", h["round"], h["train_ppl"],
                f"{h['eval_ppl']:.2f}" if "eval_ppl" in h else "-", h["tokens_per_s"], h["round_s"], h["work_s"],
                h["overhead_pct"])
