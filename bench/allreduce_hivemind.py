"""bench/allreduce_peer.py's arm for hivemind's DecentralizedAverager."""

from __future__ import annotations

import os
import time

from bench.allreduce_arm import Arm, rel_error, wait_until

HIVEMIND_COMPRESSION = {"none": "NoCompression", "fp16": "Float16Compression", "int8": "Uniform8BitQuantization"}


class HivemindArm(Arm):
    """hivemind.averaging.DecentralizedAverager, set up as hivemind/benchmarks/benchmark_averaging.py does.

    Each round is one `averager.step()`, split at hivemind's own trigger: `prepare` runs the
    matchmaking until the group is assembled (AWAITING_TRIGGER), `go` triggers the all-reduce at
    the common start time, so the timed part is the all-reduce alone, like gloo's. The
    matchmaking time is reported separately.
    """

    def setup(self) -> dict:
        os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        import warnings

        warnings.simplefilter("ignore")
        import hivemind
        import hivemind.compression as hc
        from hivemind.averaging import DecentralizedAverager

        codec = self.cfg["codec"]
        if codec not in HIVEMIND_COMPRESSION:
            raise ValueError(f"no hivemind compression matches codec {codec!r}")
        compression = getattr(hc, HIVEMIND_COMPRESSION[codec])()
        ip = self.cfg["ip"]
        self.dht = hivemind.DHT(
            initial_peers=self.cfg.get("initial_peers") or None, host_maddrs=[f"/ip4/{ip}/tcp/0"], start=True
        )
        if self.cfg.get("hivemind_leader_log"):
            _log_hivemind_leaders(self.cfg["hivemind_leader_log"])  # before the averager forks: it inherits this
        self.averager = DecentralizedAverager(
            self.work,
            self.dht,
            prefix=f"bench_{codec}",
            target_group_size=self.n,
            # bench/allreduce.py: a round counts only with every peer in it; bench/faults.py: hivemind's default (2)
            min_group_size=self.cfg.get("hivemind_min_group_size") or self.n,
            min_matchmaking_time=self.cfg["hivemind_min_matchmaking_time"],
            request_timeout=self.cfg["hivemind_request_timeout"],
            allreduce_timeout=self.cfg["timeout"],
            next_chunk_timeout=self.cfg.get("hivemind_next_chunk_timeout"),  # None: hivemind's default (no timeout)
            compression=compression,
            bandwidth=self.cfg.get("hivemind_bandwidth"),
            start=True,
        )
        # wire ratio of the compression on one all-reduce part (hivemind sends parts of 512 KiB)
        from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

        sample = self.original[0].flatten()[: DEFAULT_PART_SIZE_BYTES // 4].contiguous()
        msg = compression.compress(sample, hc.CompressionInfo.from_tensor(sample))
        self.ratio = msg.ByteSize() / (sample.numel() * 4)
        self.ctrl = None
        return {"maddrs": [str(m) for m in self.dht.get_visible_maddrs()], "compression_ratio": self.ratio, "peer_id": str(self.dht.peer_id)}

    def prepare(self, rnd: int) -> dict:
        from hivemind.averaging.control import AveragingStage

        with self.averager.get_tensors() as tensors:
            for t, o in zip(tensors, self.original):
                t.copy_(o)
        t0 = time.monotonic()
        timeout = self.cfg["hivemind_matchmaking_timeout"]
        self.ctrl = self.averager.step(wait=False, require_trigger=True, weight=1.0, timeout=timeout)
        deadline = t0 + timeout + 5
        while self.ctrl.stage != AveragingStage.AWAITING_TRIGGER:
            if self.ctrl.done():
                self.ctrl.result(timeout=1)  # raises the matchmaking error
                raise RuntimeError("matchmaking ended without a group")
            if time.monotonic() > deadline:
                self.ctrl.cancel()
                raise TimeoutError(f"no group within {timeout} s")
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        if elapsed >= timeout - 0.5:
            # hivemind moves to AWAITING_TRIGGER even when its matchmaking timed out without a group
            self.abort()
            raise TimeoutError(f"no group within {timeout} s (hivemind matchmaking timed out)")
        return {"matchmaking_seconds": elapsed}

    def abort(self) -> dict:
        """Cancel a step that found its group but will not be triggered (another peer failed)."""
        ctrl, self.ctrl = self.ctrl, None
        if ctrl is not None and not ctrl.done():
            ctrl.cancel()
            try:
                ctrl.result(timeout=10)
            except BaseException:  # cancelled or failed: either way this step is over
                pass
        return {}

    def go(self, rnd: int, at: float) -> dict:
        ctrl, self.ctrl = self.ctrl, None
        wait_until(at)
        t0 = time.monotonic()
        ctrl.allow_allreduce()
        gathered = ctrl.result(timeout=self.cfg["timeout"])
        seconds = time.monotonic() - t0
        if gathered is None:
            raise RuntimeError("averager.step returned None (round failed)")
        return {"seconds": seconds, "start_lag": t0 - at, "members": len(gathered)}

    def check(self) -> dict:
        with self.averager.get_tensors() as tensors:
            return {"rel_error": rel_error(tensors, self.reference)}

    def reset(self) -> None:
        with self.averager.get_tensors() as tensors:
            for t, o in zip(tensors, self.original):
                t.copy_(o)

    def average_round(self, msg: dict) -> tuple[dict, list]:
        """One `step()` as hivemind's benchmark runs it (matchmaking, then all-reduce, retried
        within its matchmaking timeout), cancelled at the round's deadline."""
        from hivemind.averaging.control import AveragingStage

        wait_until(msg["at"])
        t0 = time.monotonic()
        ctrl = self.averager.step(wait=False, weight=1.0, timeout=self.cfg["hivemind_matchmaking_timeout"])
        deadline, matched = t0 + msg["timeout"], None
        while not ctrl.done():
            if matched is None and ctrl.stage == AveragingStage.RUNNING_ALLREDUCE:
                matched = time.monotonic() - t0
            if time.monotonic() > deadline:
                ctrl.cancel()
                try:
                    ctrl.result(timeout=10)
                except BaseException:  # cancelled or failed: either way this step is over
                    pass
                raise TimeoutError(f"no result within {msg['timeout']:.0f} s")
            time.sleep(0.005)
        gathered = ctrl.result(timeout=1)  # raises what failed the step
        seconds = time.monotonic() - t0
        if gathered is None:
            raise RuntimeError("averager.step returned None (round failed)")
        with self.averager.get_tensors() as tensors:
            result = [t.clone() for t in tensors]
        # hivemind says which group it formed, not whose data the average holds (a sender that
        # timed out is left out of it): no "members"
        out = {"seconds": seconds, "start_lag": t0 - msg["at"], "matchmaking_seconds": matched or 0.0,
               "group": sorted(str(p) for p in gathered), "leader": _last_hivemind_leader(self.cfg.get("hivemind_leader_log"))}
        return out, result

    def close(self) -> None:
        if getattr(self, "averager", None) is not None:
            self.averager.shutdown()
        if getattr(self, "dht", None) is not None:
            self.dht.shutdown()


_LEADER_EVENTS = (" - assembled group of ", " - follower assembled group with leader ")


def _log_hivemind_leaders(path: str) -> None:
    """Append one line per group hivemind's matchmaking assembles in this process or its forks:
    the leader's peer id. hivemind tells this only in debug records ("assembled group" on the
    leader, "follower assembled group with leader X" on the others); those are caught here and
    dropped, every other record goes on as before."""
    import logging

    def catch(record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG:
            return True
        text = record.getMessage()
        if _LEADER_EVENTS[0] in text:
            leader = text.split(" - ", 1)[0]
        elif _LEADER_EVENTS[1] in text:
            leader = text.rsplit(" ", 1)[-1]
        else:
            return False
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {leader}\n")
        return False

    logger = logging.getLogger("hivemind.averaging.matchmaking")
    logger.setLevel(logging.DEBUG)
    logger.addFilter(catch)


def _last_hivemind_leader(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path) as f:
            lines = f.read().split()
    except OSError:
        return None
    return lines[-1] if lines else None
