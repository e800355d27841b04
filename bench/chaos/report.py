"""Counts of a chaos run per victim and phase: each client request is charged to the kill whose
window (from the SIGKILL to the cluster serving again) it overlaps, the rest to "between kills".

Invariant: every request is counted exactly once, and `failures` names every way the run broke a
promise (a cascade, a dead prefill worker, a wrong token, a hang, a leak, no recovery, a request lost
to a prefill worker's death).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Sequence

from bench.chaos.load import HANG_S, LOST, OUTCOMES, Result, classify
from bench.chaos.phases import Kill
from bench.lib.report import cell, markdown_table

BETWEEN = ("-", "between kills")


def charge(kills: Sequence[Kill], results: Sequence[Result], expected: dict[str, str]) -> dict[tuple, Counter]:
    """Outcome counts per (victim, phase); each kill's own requests go to it directly."""
    counts: dict[tuple, Counter] = {BETWEEN: Counter()}
    for kill in kills:
        counts.setdefault((kill.victim, kill.phase), Counter())
        for result, baseline in kill.own:
            counts[(kill.victim, kill.phase)][classify(result, baseline)] += 1
    for result in results:
        owner = next((k for k in kills if _overlaps(k, result)), None)
        key = BETWEEN if owner is None else (owner.victim, owner.phase)
        counts[key][classify(result, expected[result.class_name])] += 1
    return counts


def _overlaps(kill: Kill, result: Result) -> bool:
    until = kill.recovered_s if kill.recovered_s is not None else kill.killed_s + HANG_S
    return result.done_s >= kill.killed_s and result.sent_s <= until


def rows(kills: Sequence[Kill], counts: dict[tuple, Counter]) -> list[dict]:
    table = []
    for key in sorted(k for k in counts if k != BETWEEN) + [BETWEEN]:
        mine = [k for k in kills if (k.victim, k.phase) == key]
        if key == BETWEEN and not sum(counts[key].values()):
            continue
        recovery = [k.recovery_s for k in mine if k.recovery_s is not None]
        table.append({
            "victim": key[0], "phase": key[1], "kills": len(mine), "forced": sum(k.forced for k in mine),
            **{outcome: counts[key][outcome] for outcome in OUTCOMES},
            "kills_leaking": sum(bool(k.leaked) for k in mine), "survivors_failed": sum(bool(k.survivors_failed)
                                                                                        for k in mine),
            "prefill_deaths": sum(k.prefill_died for k in mine), "not_recovered": len(mine) - len(recovery),
            "agent_restarts": sum(k.agent_restarts for k in mine),
            "recovery_s_median": statistics.median(recovery) if recovery else None,
            "recovery_s_max": max(recovery) if recovery else None,
        })
    return table


def failures(kills: Sequence[Kill], table: Sequence[dict]) -> list[str]:
    found = []
    for kill in kills:
        what = f"{kill.victim}/{kill.phase} ({kill.process})"
        if kill.survivors_failed:
            found.append(f"{what}: survivors failed: {kill.survivors_failed}")
        if kill.prefill_died:
            found.append(f"{what}: the prefill worker died:\n{kill.prefill_log_tail[-2000:]}")
        if kill.leaked:
            found.append(f"{what}: blocks held after the lease: {kill.leaked}")
        if kill.recovered_s is None:
            found.append(f"{what}: no recovery: {kill.note}")
    for row in table:
        where = f"{row['victim']}/{row['phase']}"
        for outcome in ("wrong", "hang"):
            if row[outcome]:
                found.append(f"{where}: {row[outcome]} {outcome}")
        if row["victim"] in ("prefill", "-") and row[LOST]:
            found.append(f"{where}: {row[LOST]} requests lost with a decode worker alive")
    return found


def format_table(table: Sequence[dict]) -> str:
    keys = ("victim", "phase", "kills", "forced", "ok", "cut", "lost", "wrong", "hang", "kills_leaking",
            "survivors_failed", "prefill_deaths")
    return markdown_table(
        ["victim", "phase", "kills", "forced", "ok", "cut", "lost", "wrong", "hang", "leaking", "survivors failed",
         "P deaths", "agent restarts", "recovery s (median / max)"],
        [(*(row[key] for key in keys), row.get("agent_restarts", 0),
          f"{cell(row['recovery_s_median'], '.1f')} / {cell(row['recovery_s_max'], '.1f')}") for row in table])
