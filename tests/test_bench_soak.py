"""bench/soak.py's summary (pure): memory growth counted from the end of the warm-up, peaks over
the whole run, per kind of process."""

from bench.soak import summarize


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
