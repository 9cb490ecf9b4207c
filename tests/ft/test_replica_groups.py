"""TorchFT replica groups on CPU / gloo: a group dies (also inside the gradient all-reduce), the other keeps committing,
the restarted group heals from it and both end bit-identical; the same with DDP inside each group; a second launch of
a live replica id is refused.

Groups run tests/scripts/resumable.py. `SLOW_WHILE` holds group 0 back (a sleep per step) while the test stages the
faults, so every restart meets a live group 0; the test then lets it run to the end at full speed.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

from perdure.checkpoints.commit import read_pointer
from tests.ft.groups import assert_same_state, final_state, ft_record, launch, sidecar, wait_until
from tests.runs import free_port, run, run_dir

pytest.importorskip("torchft", reason="the ft extra is not installed (pip install 'perdure[ft]')")
pytestmark = pytest.mark.timeout(240)

STEPS = 400
ARGS = ("--steps", str(STEPS), "--ckpt.interval", "20", "--log.interval", "10", "--eval.interval", "100")


def quorum_sizes(root, replica):
    return [(change["step"], change["participants"]) for change in ft_record(root, replica).get("quorum_changes", [])]


def alone_after_a_pair(root, replica):
    """Whether the group went on alone after it had trained with the other: a quorum of one after one of two. (The
    step of that quorum is the last one committed before the death, wherever the other group joined.)"""
    sizes = [size for _, size in quorum_sizes(root, replica)]
    return 2 in sizes and 1 in sizes[len(sizes) - sizes[::-1].index(2) :]


def healed_from_peer(root, replica, after_step=-1):
    return [h for h in ft_record(root, replica).get("heals", []) if h["source"] == "peer" and h["to_step"] > after_step]


def died(group) -> bool:
    """Every rank of a group launch that kills itself (KILL_AFTER_STEPS) ended: SIGKILLed, or, when its rank 0 (which
    serves the group's manager) died first, stopped by the failed quorum, as torchrun would stop it."""
    codes = group.wait()
    assert codes[0] == -signal.SIGKILL and all(code in (-signal.SIGKILL, 1) for code in codes[1:]), codes
    return True


def in_a_quorum(root, group):
    """Wait until `group`, replica 0, has joined a quorum. A group launched before that may start first, train its
    steps alone and die before replica 0 ever joins it, so the two never train as a pair (seen on a loaded machine)."""

    def joined() -> bool:
        return any(root.glob("*/*/sidecar.json")) and bool(quorum_sizes(root, 0))

    wait_until(joined, "group 0 in a quorum", [group])


def held_back(tmp_path):
    """(workspace root, the hold file, the environment that slows a group down while the hold file exists)."""
    hold = tmp_path / "hold"
    hold.touch()
    # 0.15 s a step: the held group cannot run out its budget while a restart of the other is still importing torch
    # on a loaded two-core machine; once let go it finishes at full speed.
    return tmp_path / "runs", hold, {"SLOW_WHILE": str(hold), "STEP_SLEEP": "0.15"}


def test_a_group_dies_twice_the_other_keeps_committing_and_the_restarts_heal(tmp_path, lighthouse):
    root, hold, slow = held_back(tmp_path)
    slow["TEACHER"] = "1"  # a momentum teacher of the program's own (`self.checkpointed`): a heal must carry it too
    final = str(tmp_path / "final{replica}.pt")
    group0 = launch(root, lighthouse, 0, *ARGS, FINAL_STATE=final, **slow)
    in_a_quorum(root, group0)
    # Group 1 dies at the 10th step it trains (SIGKILL in its forward pass; it may have healed past step 10 first).
    first = launch(root, lighthouse, 1, *ARGS, name="a", KILL_AFTER_STEPS="10", **slow)
    assert first.wait() == [-signal.SIGKILL], first.output()[-3000:]
    wait_until(lambda: alone_after_a_pair(root, 0), "group 0 alone", [group0])
    alone_from = max(step for step, size in quorum_sizes(root, 0) if size == 1)

    # While group 0 trains: a second launch of replica 0 is refused, so is a plain launch of the same run.
    twin = launch(root, lighthouse, 0, *ARGS, name="twin")
    assert twin.wait() != [0]
    assert re.search(r"replica group 0 of run .* is already training \(pid \d+", twin.output()), twin.output()
    plain = run("resumable.py", root, *ARGS)
    assert plain.returncode != 0 and "is in use by pid" in plain.stderr, plain.stderr

    # Restarted, group 1 heals from group 0 (which committed steps alone meanwhile), then dies again, this time right
    # inside the cross-group gradient all-reduce: group 0 survives it.
    second = launch(root, lighthouse, 1, *ARGS, name="b", FAULT="allreduce:20", **slow)
    assert second.wait() == [-signal.SIGKILL], second.output()[-3000:]
    heal = healed_from_peer(root, 1)
    assert heal and heal[0]["from_step"] < heal[0]["to_step"], ft_record(root, 1)
    assert heal[0]["to_step"] > alone_from, "group 0 committed no step while group 1 was dead"
    healed_at = heal[0]["to_step"]
    wait_until(lambda: any(size == 1 and step > healed_at for step, size in quorum_sizes(root, 0)), "alone", [group0])
    assert "Connection closed by peer" in group0.output() or "did not commit" in group0.output()

    # The third launch heals again; then group 0 is let go, and both finish the budget.
    third = launch(root, lighthouse, 1, *ARGS, name="c", FINAL_STATE=final, **slow)
    wait_until(lambda: healed_from_peer(root, 1, healed_at), "the second heal", [group0, third])
    hold.unlink()
    group0.assert_ok()
    third.assert_ok()

    a, b = final_state(tmp_path / "final0.pt"), final_state(tmp_path / "final1.pt")
    assert a["step"] == STEPS
    assert_same_state(a, b)  # parameters and optimizer state (a heal serves the live state, not a stale one)
    # The teacher follows the model identically in both groups (its random centre is each group's own draw).
    assert a["teacher"]["updates"] == b["teacher"]["updates"] == STEPS
    assert all(torch.equal(a["teacher"]["net"][key], b["teacher"]["net"][key]) for key in a["teacher"]["net"])
    record = sidecar(root)
    assert record["step"] == STEPS and record["status"] == "completed"
    assert read_pointer(run_dir(root) / "checkpoints", "latest") == f"ckpt-s{STEPS:012d}"
    replicas = sorted(attempt["replica"] for attempt in record["attempts"])
    assert replicas == [0, 1, 1, 1]
    # Every step of the budget was committed once: by group 0, but for the steps it healed past if group 1 was first.
    skipped = sum(h["to_step"] - h["from_step"] for h in ft_record(root, 0)["heals"])
    assert ft_record(root, 0)["steps_committed"] + skipped == STEPS


def two_rank_groups_killed_and_healed(tmp_path, lighthouse, *args, kill_after: int):
    """2 groups x 2 ranks: group 1 dies at its `kill_after`-th step, group 0 goes on alone, a relaunch of group 1
    heals from it, both finish. Returns (workspace root, group 0, the step group 0 went on alone from)."""
    root, hold, slow = held_back(tmp_path)
    final = str(tmp_path / "final{replica}-{rank}.pt")
    group0 = launch(root, lighthouse, 0, *args, ranks=2, FINAL_STATE=final, **slow)
    in_a_quorum(root, group0)
    first = launch(root, lighthouse, 1, *args, ranks=2, name="a", KILL_AFTER_STEPS=str(kill_after), **slow)
    assert died(first), first.output()[-3000:]
    wait_until(lambda: alone_after_a_pair(root, 0), "group 0 alone", [group0])
    died_at = max(step for step, size in quorum_sizes(root, 0) if size == 1)
    again = launch(root, lighthouse, 1, *args, ranks=2, name="b", FINAL_STATE=final, **slow)
    # The first launch may have healed too: wait for the heal of *this* launch, past the step group 0 went on alone.
    wait_until(lambda: healed_from_peer(root, 1, died_at), "the heal", [group0, again])
    hold.unlink()
    group0.assert_ok()
    again.assert_ok()
    return root, group0, died_at


def test_ddp_inside_each_group(tmp_path, lighthouse):
    """2 groups x 2 ranks: group 1 (both ranks) dies, group 0 keeps committing, the restart heals, all four agree."""
    args = (*ARGS[2:], "--steps", "200", "--ckpt.backend", "file")
    root, _, died_at = two_rank_groups_killed_and_healed(tmp_path, lighthouse, *args, kill_after=8)
    states = [final_state(tmp_path / f"final{replica}-{rank}.pt") for replica in (0, 1) for rank in (0, 1)]
    assert states[0]["step"] == 200
    for other in states[1:]:
        assert_same_state(states[0], other)
    heal = healed_from_peer(root, 1, died_at)
    assert heal and heal[0]["to_step"] > died_at and sidecar(root)["step"] == 200, ft_record(root, 1)


def test_fsdp_inside_each_group_is_hsdp_across_groups(tmp_path, lighthouse):
    """stack=parallel, 2 groups x 2 ranks (FSDP2 inside each group): group 1 dies, group 0 keeps committing, the
    restart heals shard by shard from the same ranks of group 0, and rank r of both groups ends with the same shards."""
    # 240 steps, 0.15 s each while held: group 0 must not finish while group 1 starts, dies, restarts and heals on a
    # loaded machine (at 120 it once ran out its budget first).
    steps = 240
    args = (*ARGS[2:], "--steps", str(steps), "--stack", "parallel", "--dist.timeout", "60")
    root, group0, _ = two_rank_groups_killed_and_healed(tmp_path, lighthouse, *args, kill_after=6)
    assert "parallel: shard 2 (2 ranks)" in group0.output()
    for rank in (0, 1):
        a, b = (final_state(tmp_path / f"final{replica}-{rank}.pt") for replica in (0, 1))
        assert a["step"] == steps
        assert_same_state(a, b)
    record = sidecar(root)
    assert record["step"] == steps and record["status"] == "completed"
    assert read_pointer(run_dir(root) / "checkpoints", "latest") == f"ckpt-s{steps:012d}"


def test_bad_lighthouse_fails_at_the_first_step(tmp_path):
    """A lighthouse nobody listens on: the group stops with a message naming it, no hang."""
    address = f"http://127.0.0.1:{free_port()}"
    ft = ("--ft.enabled", "true", "--ft.lighthouse", address, "--ft.timeout", "3")
    result = run("resumable.py", tmp_path, *ARGS, *ft, timeout=120)
    assert result.returncode != 0
    assert f"could not reach the lighthouse at {address}" in result.stderr, result.stderr[-3000:]
    assert "perdure ft lighthouse" in result.stderr
    assert sidecar(tmp_path)["attempts"][-1]["status"] == "failed"
