"""bench/soak_record.py (pure): memory growth counted from the end of the warm-up, peaks over
the whole run, per kind of process."""

from bench.soak_record import Record, loss_at_equal_samples, loss_curve, summarize


def sample(t: float, coord_rss: int, replica_rss: list[int], fds: int = 40, disk: float = 3.0) -> dict:
    procs = {"coordinator": {"rss_mib": coord_rss, "open_files": fds, "threads": 10}}
    procs.update({f"r{i}": {"rss_mib": r, "open_files": fds + i, "threads": 20 + i} for i, r in enumerate(replica_rss)})
    return {"t": t, "procs": procs, "disk": {"coordinator": disk, "r0": disk / 2}}


def test_growth_is_the_most_one_process_grew_from_the_warmups_end_and_peaks_are_from_the_start():
    samples = [sample(0, 100, [900, 300]), sample(600, 200, [400, 400], fds=90), sample(1200, 210, [440, 400], disk=8.0)]
    out = summarize(samples, warmup_s=600)
    assert out["coordinator"] == {"rss_growth": 0.05, "rss_mib_after_warmup": 200, "rss_mib_at_end": 210, "grew_most": "coordinator", "open_files_max": 90, "threads_max": 10}
    # the replicas: r0 grew 10 % after the warm-up (its 900 before it does not count), r1 not at all
    assert (out["replica"]["rss_growth"], out["replica"]["grew_most"], out["replica"]["rss_mib_after_warmup"]) == (0.1, "r0", 400)
    assert out["replica"]["open_files_max"] == 91 and out["replica"]["threads_max"] == 21 and out["disk_mib_max"] == 8.0


def entry(step: int, loss: float, inner: int = 10, **extra) -> dict:
    return {"outer_step": step, "val_loss": loss, "inner_steps": inner, **extra}


def test_the_loss_curve_counts_the_samples_of_averaged_rounds_only():
    a = [{"outer_step": 0, "val_loss": 5.5, "start": True}, entry(1, 5.0), entry(2, 4.0), entry(3, 3.6)]
    b = [entry(1, 5.0), entry(2, 4.2, inner=6), entry(3, 3.6, caught_up_from=2)]  # a state taken from a peer trained nothing here
    assert loss_curve([a, b]) == [(20, 5.0), (36, 4.1), (46, 3.6)]


def test_the_loss_at_equal_samples_reads_the_clean_curve_between_its_points_over_the_faulted_curves_second_half():
    clean = [(10, 5.0), (20, 4.0), (30, 3.0), (40, 2.0)]
    faulted = [(8, 5.5), (15, 4.4), (25, 3.5), (35, 2.75)]
    # (25, 3.5) against 3.5 and (35, 2.75) against 2.5: the mean of 1.0 and 1.1
    assert loss_at_equal_samples(faulted, clean) == 1.05
    assert loss_at_equal_samples([(50, 2.0), (60, 1.0)], clean) is None  # past the clean curve's end: nothing to read


def test_the_record_keeps_entries_a_stats_file_dropped_and_finds_a_step_with_two_hashes():
    r = Record()
    r.take("r0", "replica", {"history": [{"outer_step": 0, "state_hash": "s", "start": True}, entry(1, 5.0, state_hash="a"), entry(2, 4.0, state_hash="b")]})
    r.take("r0", "replica", {"history": [entry(3, 3.0, state_hash="c")]})  # (the file kept its newest entry only)
    r.take("r1", "replica", {"history": [{"outer_step": 2, "state_hash": "b", "caught_up_from": 1}, entry(3, 3.0, state_hash="X")]})
    assert sorted(r.replicas["r0"]) == [0, 1, 2, 3] and r.split() == [3] and r.progress() == {"outer_steps": 3}


def test_the_record_tags_a_slot_servers_syncs_with_the_slot_it_held_then():
    r = Record()
    sync = lambda n, h, group=2: {"sync": n, "state_hash": h, "group": group}  # noqa: E731
    r.take("s0", "server", {"stage": 0, "history": [{"start": True}, sync(10, "a"), sync(11, "b")]})
    r.take("s1", "server", {"stage": 0, "history": [{"start": True}, sync(10, "a"), sync(11, "b"), sync(12, "c", group=1)]})
    # s0 moved to stage 1: the syncs after its new start are stage 1's, those before stay stage 0's
    r.take("s0", "server", {"stage": 1, "history": [sync(10, "a"), sync(11, "b"), {"start": True}, sync(13, "d")]})
    r.take("s2", "server", {"stage": 1, "history": [{"start": True}, sync(13, "e")]})
    assert r.slots[("stage 0", 11)] == {"s0": "b", "s1": "b"} and ("stage 0", 12) not in r.slots  # (alone: no group)
    assert r.split() == [["stage 1", 13]]
    r.take("t", "trainer", {"history": [{"micro_batches": 8, "loss": 5.0}, {"micro_batches": 16, "loss": 4.0}]})
    r.take("t", "trainer", {"history": [{"micro_batches": 16, "loss": 4.0}, {"micro_batches": 24, "loss": 3.5}]})
    assert r.loss_curve() == [(8, 5.0), (16, 4.0), (24, 3.5)] and r.progress() == {"micro_batches": 24, "syncs_of_two_or_more": 3}
