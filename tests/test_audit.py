"""A trainer's spot checks of slot peers (node/roles/audit.py): the judgement of a dispute, and
the check with a real PeerScores, its peers answering as honest peers and as liars do."""

import asyncio
import random
import time

import pytest
import torch

from node.net.rpc import PeerScores, TransportConfig
from node.roles.attacks import AnswerAttack
from node.roles.audit import Auditor, SizeBook, distance, judge, log_size

pytestmark = pytest.mark.timeout(30)


def honest(x: torch.Tensor, drift: float = 0.0, seed: int = 0) -> list[torch.Tensor]:
    """A residual block's answer to `x`, as a peer whose weights drifted by `drift` gives it."""
    g = torch.Generator().manual_seed(seed)
    w = torch.eye(x.size(-1)) * 0.5 + drift * torch.randn(x.size(-1), x.size(-1), generator=g) / x.size(-1) ** 0.5
    return [x + x @ w]


def test_distance_of_equal_zeroed_scaled_and_unrelated_answers():
    a = [torch.randn(4, 8, 16)]
    assert distance(a, a) == 0.0
    assert distance(a, [torch.zeros(4, 8, 16)]) == pytest.approx(1.0)
    assert distance(a, [a[0] * 1000]) == pytest.approx(0.999)
    assert 1.2 < distance(a, [torch.randn(4, 8, 16)]) < 1.6


def test_a_third_peer_decides_by_agreement():
    x = torch.randn(2, 8, 16)
    answers = {"a": [(honest(x), 1)], "b": [(honest(x, 0.05, 1), 1)], "liar": [([torch.randn_like(x) * 1.5], 1)]}  # noise of the honest size
    verdict = judge(answers, {}, None)
    assert set(verdict.liars) == {"liar"} and "agreed with none of 2 other peers" in verdict.liars["liar"]
    # three answers none of which agree: undecided by agreement, and nothing else to go on
    spread = {p: [([torch.randn_like(x)], 1)] for p in "abc"}
    assert judge(spread, {}, None).open and not judge(spread, {}, None).liars


def test_a_peer_that_answers_the_same_call_differently_lies():
    x = torch.randn(2, 8, 16)
    noise = AnswerAttack("noise", seed=3)
    first, again = noise.apply("y", honest(x)[0]), noise.apply("y", honest(x)[0])
    verdict = judge({"h": [(honest(x), 3), (honest(x), 3)], "n": [([first], 7), ([again], 7)]}, {}, None)
    assert set(verdict.liars) == {"n"} and "twice from the same weights" in verdict.liars["n"]
    # answers from weights that changed between the asks (a step, a sync), or not known: no proof
    changed = {"h": [(honest(x), 3), (honest(x, 2.0, 9), 4)], "n": [([first], 7), ([again], 8)]}
    assert judge(changed, {}, None).open
    assert judge({"h": [(honest(x), 3), (honest(x), 3)], "n": [([first], 0), ([again], 0)]}, {}, None).open


def test_replays_are_caught_by_asking_again():
    replay = AnswerAttack("replay")
    calls = [torch.randn(2, 8, 16) for _ in range(3)]
    answers = [replay.apply("y", honest(x)[0]) for x in calls]  # each call: the one before's answer
    assert torch.equal(answers[1], honest(calls[0])[0]) and torch.equal(answers[2], honest(calls[1])[0])
    x = calls[2]
    again = replay.apply("y", honest(x)[0])  # the same call again: now the answer to the first ask
    verdict = judge({"h": [(honest(x), 1), (honest(x), 1)], "r": [([answers[2]], 5), ([again], 5)]}, {}, None)
    assert set(verdict.liars) == {"r"}


@pytest.mark.parametrize("kind", ["scaled", "zero"])
def test_consistent_lies_are_judged_by_their_size_once_honest_sizes_are_known(kind):
    x = torch.randn(2, 8, 16)
    lie = AnswerAttack(kind).apply("y", honest(x)[0])
    answers = {"h": [(honest(x), 2), (honest(x), 2)], "l": [([lie], 4), ([lie], 4)]}
    sizes = {p: log_size(a[0][0], x) for p, a in answers.items()}
    assert judge(answers, sizes, None).open  # no honest sizes yet: nothing decides
    book = SizeBook()
    for seed in range(4):
        y = torch.randn(2, 8, 16)
        book.note("stage 1 forward", log_size(honest(y, 0.05, seed), y))
    verdict = judge(answers, sizes, book.median("stage 1 forward"))
    assert set(verdict.liars) == {"l"} and "the size honest answers have" in verdict.liars["l"]


def test_honest_drift_is_no_dispute():
    x = torch.randn(4, 8, 16)
    assert distance(honest(x, 0.0), honest(x, 0.1, 5)) < 0.5


def run_check(auditor, peers, first, answers_of, x, versions=None):
    """Auditor.check with peers that answer by `answers_of[peer](x)`, from weights of version
    `versions[peer]()` (default 1); the calls each got."""
    asked: list[str] = []
    version = lambda p: versions[p]() if versions else 1  # noqa: E731

    async def ask(peer):
        asked.append(peer)
        return answers_of[peer](x), version(peer)

    result = asyncio.run(auditor.check("stage 1 forward", peers, first, (answers_of[first](x), version(first)), x, ask))
    return result, asked


def test_a_check_bans_the_liar_with_its_reason_and_goes_on_with_the_honest_answer():
    scores = PeerScores(TransportConfig())
    auditor = Auditor(1.0, scores, "trainer", random.Random(0))
    noise = AnswerAttack("noise", seed=1)
    answers_of = {"honest": lambda x: honest(x), "liar": lambda x: [noise.apply("y", honest(x)[0])]}
    x = torch.randn(2, 8, 16)
    (peer, answer), asked = run_check(auditor, ["honest", "liar"], "liar", answers_of, x)
    assert peer == "honest" and torch.equal(answer[0], honest(x)[0])
    assert sorted(asked) == ["honest", "honest", "liar"]  # the second peer, then both again
    assert scores.banned("liar", time.monotonic()) > 0 and not scores.banned("honest", time.monotonic())
    (ban,) = scores.bans(time.monotonic())
    assert ban["peer_id"] == "liar" and "caught by a check" in ban["reason"] and "twice" in ban["reason"]
    assert auditor.counts == {"checked": 1, "agreed": 0, "disputes": 1, "open": 0, "caught": 1}


def test_a_peer_whose_weights_move_between_asks_is_asked_again_and_an_honest_one_is_never_banned():
    scores = PeerScores(TransportConfig())
    auditor = Auditor(1.0, scores, "trainer", random.Random(0))
    steps = {"a": 0}

    def stepping(x):  # an honest peer early in training: every answer from new weights, far apart
        steps["a"] += 1
        return [torch.randn_like(x) * float(honest(x)[0].norm() / x.norm())]

    answers_of = {"a": stepping, "b": lambda x: honest(x)}
    versions = {"a": lambda: steps["a"] + 1, "b": lambda: 1}
    (peer, _), asked = run_check(auditor, ["a", "b"], "a", answers_of, torch.randn(2, 8, 16), versions)
    assert peer == "a" and asked.count("a") == 2 and asked.count("b") == 2  # a: ASKS in all, none from one version
    assert auditor.counts["open"] == 1 and not scores.bans(time.monotonic())


def test_agreeing_peers_are_noted_and_a_banned_peer_is_not_asked():
    scores = PeerScores(TransportConfig())
    auditor = Auditor(1.0, scores, "trainer", random.Random(0))
    answers_of = {p: (lambda x, s=s: honest(x, 0.02, s)) for s, p in enumerate("abc")}
    scores.penalize("c", 10.0, time.monotonic(), "test")
    for _ in range(5):
        (peer, _), asked = run_check(auditor, ["a", "b", "c"], "a", answers_of, torch.randn(2, 8, 16))
        assert peer == "a" and asked == ["b"]
    assert auditor.counts["agreed"] == 5 and auditor.book.median("stage 1 forward") is not None
    # alone in its slot (the others banned or none): nothing to check against
    (peer, _), asked = run_check(auditor, ["a", "c"], "a", answers_of, torch.randn(2, 8, 16))
    assert peer == "a" and asked == []


def test_due_follows_the_fraction():
    auditor = Auditor(0.25, PeerScores(TransportConfig()), "trainer", random.Random(1))
    assert 200 < sum(auditor.due() for _ in range(1000)) < 300
    assert not any(Auditor(0.0, None, "t").due() for _ in range(100))


def test_a_first_stages_answers_are_sized_by_themselves():
    """Its input is token ids: an answer's size is its root mean square, and a scaled liar's is
    still far from the honest ones'."""
    tokens = torch.randint(0, 256, (2, 8))
    y = torch.randn(2, 8, 16)
    assert log_size([y], tokens) == pytest.approx(float(y.double().pow(2).mean().sqrt().log()), rel=1e-9, abs=1e-12)
    book = SizeBook()
    for seed in range(4):
        book.note("stage 0 forward", log_size([torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed))], tokens))
    lie = AnswerAttack("scaled").apply("y", y)
    answers = {"h": [([y], 1), ([y], 1)], "l": [([lie], 2), ([lie], 2)]}
    verdict = judge(answers, {p: log_size(a[0][0], tokens) for p, a in answers.items()}, book.median("stage 0 forward"))
    assert set(verdict.liars) == {"l"}
