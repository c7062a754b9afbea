"""Label decoding (egomem.trigger.decode) on hand-made sequences, and the span metrics."""

import numpy as np
import pytest

from egomem.trigger.decode import decode_sessions, sessions_to_labels
from egomem.trigger.metrics import count_matches, evaluate, jaccard


def seq(s: str) -> np.ndarray:
    return np.array([int(c) for c in s.replace(" ", "")])


@pytest.mark.parametrize(
    "labels, expected",
    [
        ("0000", []),
        ("0122223000", [(1, 6)]),
        ("1223 0000 1222223", [(0, 3), (8, 14)]),
        ("0130", []),  # R6: two steps < min_len 3
        # R1 adjacent starts: a user switch without an end label
        ("0122212223000", [(1, 4), (5, 9)]),
        # R2 an end without a start: the 2s before it opened the session (R3)
        ("000222230", [(3, 7)]),
        # R2 a lone end after 0s is a one-step session, dropped by min_len
        ("0003000", []),
        # R3 in-session run without a start, never ended: closed at its last step (R5)
        ("0022222", [(2, 6)]),
        # R5 start without end at the chunk boundary
        ("00122222", [(2, 7)]),
        # R5 start without end, then trailing no-dialog: closed at the last non-0 step
        ("0122200000000000000000", [(1, 4)]),
        # R6 isolated short blips are dropped
        ("0010000000000000000200000", []),
    ],
)
def test_decode_rules(labels, expected):
    assert decode_sessions(seq(labels), max_gap=4, min_len=3) == expected


def test_short_zero_flicker_is_absorbed_long_gap_splits():
    flicker = seq("1222" + "000" + "2223")  # 3 zeros < max_gap 4
    assert decode_sessions(flicker, max_gap=4) == [(0, 10)]
    split = seq("1222" + "00000" + "2223")  # 5 zeros >= max_gap: the first part ends at its last 2
    assert decode_sessions(split, max_gap=4) == [(0, 3), (9, 12)]


def test_end_then_start_right_away():
    assert decode_sessions(seq("12231223"), min_len=1) == [(0, 3), (4, 7)]


def test_round_trip_random_clean_spans():
    rng = np.random.default_rng(0)
    for _ in range(50):
        T, t, spans = 300, 0, []
        while True:
            t += int(rng.integers(0, 20))
            n = int(rng.integers(3, 40))
            if t + n > T:
                break
            spans.append((t, t + n - 1))
            t += n
        assert decode_sessions(sessions_to_labels(spans, T), max_gap=13, min_len=3) == spans


def test_rejects_bad_labels():
    with pytest.raises(ValueError, match="0, 1, 2, 3"):
        decode_sessions(np.array([0, 5, 2]))


def test_metrics_exact_and_shifted():
    gold = [[(10, 50), (60, 100)]]
    assert evaluate(gold, gold)["span_match@0"]["f1"] == 1.0
    assert evaluate(gold, gold)["jaccard"] == 1.0
    shifted = [[(13, 50), (60, 106)]]
    m = evaluate(shifted, gold)
    assert m["span_match@0"]["f1"] == 0.0
    assert m["span_match@5"]["precision"] == 0.5 and m["span_match@5"]["recall"] == 0.5
    assert m["span_match@10"]["f1"] == 1.0
    assert m["jaccard"] == pytest.approx(79 / 88)  # overlap 38 + 41 steps, union 82 + 85 - 79


def test_metrics_one_to_one_and_empty():
    assert count_matches([(0, 10), (1, 10)], [(0, 10)], 5) == 1  # a gold span matches once
    assert jaccard([], []) == 1.0
    m = evaluate([[(0, 5)]], [[]])
    assert m["span_match@5"]["precision"] == 0.0 and m["jaccard"] == 0.0


def _onehot_logp(labels: str, p: float = 0.9) -> np.ndarray:
    lab = seq(labels)
    lp = np.full((len(lab), 4), np.log((1 - p) / 3))
    lp[np.arange(len(lab)), lab] = np.log(p)
    return lp


def test_viterbi_keeps_clean_sequences_and_repairs_broken_ones():
    from egomem.trigger.decode import viterbi_labels

    clean = "0012222300012300"
    np.testing.assert_array_equal(viterbi_labels(_onehot_logp(clean)), seq(clean))
    # a stray, unsure start inside a session is no split (a split would also need an end label),
    # while per-step argmax + decode_sessions would cut the session in two
    lp = _onehot_logp("00122222222300")
    lp[7] = np.log([0.05, 0.5, 0.4, 0.05])
    assert decode_sessions(lp.argmax(1), min_len=1) == [(2, 6), (7, 11)]
    assert decode_sessions(viterbi_labels(lp), min_len=1) == [(2, 11)]
    # in-session run without start or end still becomes one well-formed session
    out = viterbi_labels(_onehot_logp("00022222000"))
    assert len(decode_sessions(out, min_len=1)) == 1
    # every output is well-formed: decoding it then re-encoding gives it back
    rng = np.random.default_rng(0)
    for _ in range(20):
        lp = np.log(rng.dirichlet(np.ones(4), size=200))
        out = viterbi_labels(lp)
        np.testing.assert_array_equal(sessions_to_labels(decode_sessions(out, max_gap=10**9, min_len=1), 200), out)


def test_viterbi_min_gap_keeps_short_pauses_inside_one_session():
    from egomem.trigger.decode import viterbi_labels

    def logp(labels: str) -> np.ndarray:
        """A tagger's log-probabilities: 0.7 on the given label; start/end are rare otherwise."""
        p = np.tile([0.1, 0.05, 0.15, 0.05], (len(labels), 1))
        p[np.arange(len(labels)), [int(c) for c in labels]] = 0.7
        return np.log(p)

    # a tagger that hesitates: an end, 5 steps of no dialog, a start, inside what is one conversation
    labels = "0" * 3 + "1" + "2" * 8 + "3" + "0" * 5 + "1" + "2" * 8 + "3" + "0" * 30 + "1" + "2" * 6 + "3" + "00"
    lp = logp(labels)
    plain = decode_sessions(viterbi_labels(lp), min_len=1)
    assert len(plain) == 3  # min_gap 1: the 5-step pause splits the first conversation
    gapped = decode_sessions(viterbi_labels(lp, min_gap=10, min_len=8), min_len=1)
    assert len(gapped) >= 2 and gapped[-1] == (58, 65)  # the 30-step gap is a real gap
    for (_a0, a1), (b0, _b1) in zip(gapped, gapped[1:]):  # sessions touch (a switch) or are >= 10 steps apart
        assert b0 == a1 + 1 or b0 - a1 - 1 >= 10
    assert all(b - a + 1 >= 8 for a, b in gapped)  # none shorter than min_len
    # a tagger that sees the pause as dialog (uncertain, not rare labels): one conversation
    unsure = logp(labels)
    unsure[13:18] = np.log([0.4, 0.05, 0.5, 0.05])
    assert decode_sessions(viterbi_labels(unsure, min_gap=10, min_len=8), min_len=1)[0] == (3, 27)
    # an end followed at once by a start (a user switch) stays two sessions whatever the gap rule
    switch = "01" + "2" * 5 + "31" + "2" * 5 + "30"
    assert decode_sessions(viterbi_labels(logp(switch), min_gap=10, min_len=5), min_len=1) == [(1, 7), (8, 14)]
    assert decode_sessions(viterbi_labels(logp(switch), min_len=8), min_len=1) == [(1, 14)]  # too short apart
    out = viterbi_labels(lp, min_gap=10, min_len=8)  # still a well-formed sequence
    assert decode_sessions(out, min_len=1) == decode_sessions(out, max_gap=10**6, min_len=1)


def test_viterbi_short_gap_cost_lets_a_sure_tagger_place_a_short_gap():
    from egomem.trigger.decode import viterbi_labels

    def logp(labels: str, sure: float) -> np.ndarray:
        p = np.tile([(1 - sure) / 3] * 4, (len(labels), 1))
        p[np.arange(len(labels)), [int(c) for c in labels]] = sure
        return np.log(p)

    # two users 6 steps apart: shorter than min_gap 10, so the hard rule cannot decode that gap
    two = "01" + "2" * 10 + "3" + "0" * 6 + "1" + "2" * 10 + "30"
    hard = decode_sessions(viterbi_labels(logp(two, 0.9), min_gap=10, min_len=5), min_len=1)
    assert hard != [(1, 12), (19, 30)]
    for cost in (0.0, 8.0):  # a sure tagger pays a moderate price for the short gap
        soft = viterbi_labels(logp(two, 0.9), min_gap=10, min_len=5, short_gap_cost=cost)
        assert decode_sessions(soft, min_len=1) == [(1, 12), (19, 30)]
    # an unsure tagger (0.4 on its labels) does not pay a high price: the gap stays inside one session
    # or becomes adjacency, as with the hard rule
    unsure = viterbi_labels(logp(two, 0.4), min_gap=10, min_len=5, short_gap_cost=50.0)
    np.testing.assert_array_equal(unsure, viterbi_labels(logp(two, 0.4), min_gap=10, min_len=5))
    # the price is paid only for gaps under min_gap: a long gap decodes the same at any cost
    far = "01" + "2" * 10 + "3" + "0" * 12 + "1" + "2" * 10 + "30"
    for cost in (0.0, 8.0, float("inf")):
        assert decode_sessions(viterbi_labels(logp(far, 0.9), min_gap=10, min_len=5, short_gap_cost=cost),
                               min_len=1) == [(1, 12), (25, 36)]


def _spread(T: int, sessions: list[tuple[int, int]], starts: dict[int, float], ends: dict[int, float]) -> np.ndarray:
    """Log-probabilities [T, 4] of a tagger sure of the sessions' insides but spreading each boundary's
    probability as given ({step: p} for start / end labels); the rest of a step's mass on in/out."""
    inside = np.zeros(T, bool)
    for a, b in sessions:
        inside[a:b + 1] = True
    p = np.where(inside[:, None], [0.02, 0.0, 0.98, 0.0], [0.98, 0.0, 0.02, 0.0])
    for col, marks in ((1, starts), (3, ends)):
        for t, q in marks.items():
            p[t] *= 1 - q
            p[t, col] = q
    return np.log(np.clip(p, 1e-6, None))


def test_refine_boundaries_moves_a_late_start_to_where_the_start_probability_lies():
    from egomem.trigger.decode import refine_boundaries

    # the tagger spreads the start over steps 20-28 with its single highest step at 28 (what the Viterbi
    # path picks): the window of +-3 steps holding the most start probability is centred on 23
    starts = {20: 0.3, 21: 0.35, 22: 0.4, 23: 0.4, 24: 0.35, 25: 0.3, 26: 0.1, 27: 0.1, 28: 0.5}
    lp = _spread(100, [(20, 70)], starts, {70: 0.9})
    assert refine_boundaries([(28, 70)], lp, window=3, search=10, min_len=5) == [(23, 70)]
    assert refine_boundaries([(28, 70)], lp, window=0, search=10, min_len=5) == [(28, 70)]  # off
    assert refine_boundaries([(28, 70)], lp, window=3, search=2, min_len=5) == [(26, 70)]  # searched +-2 only
    # a sharp boundary keeps its exact step (not the edge of its window's flat top)
    sharp = _spread(100, [(20, 70)], {20: 0.9}, {70: 0.9})
    assert refine_boundaries([(20, 70)], sharp, window=5, search=20, min_len=5) == [(20, 70)]
    # a boundary moves only for a gain: here its window gains 1.17 of start probability
    assert refine_boundaries([(28, 70)], lp, window=3, search=10, min_len=5, min_gain=1.0) == [(23, 70)]
    assert refine_boundaries([(28, 70)], lp, window=3, search=10, min_len=5, min_gain=1.5) == [(28, 70)]
    # a start the path placed on its peak, with a little mass after it: a small gain (0.28) moves it
    # into that mass unless min_gain asks for more
    lp_peak = _spread(100, [(20, 70)], {20: 0.6, 23: 0.2, 24: 0.2, 25: 0.2, 26: 0.2}, {70: 0.9})
    assert refine_boundaries([(20, 70)], lp_peak, window=4, search=10, min_len=5)[0][0] > 20
    assert refine_boundaries([(20, 70)], lp_peak, window=4, search=10, min_len=5, min_gain=0.5) == [(20, 70)]
    # an end spread before the path's step is pulled back the same way: 64-70 holds 2.1, 63-69 1.6
    lp = _spread(100, [(20, 70)], {20: 0.9}, {64: 0.3, 65: 0.35, 66: 0.4, 67: 0.35, 68: 0.1, 69: 0.1, 70: 0.5})
    assert refine_boundaries([(20, 70)], lp, window=3, search=10, min_len=5) == [(20, 67)]


def test_refine_boundaries_keeps_order_gaps_and_lengths():
    from egomem.trigger.decode import refine_boundaries, viterbi_labels

    # two adjacent sessions (a user switch at 40): the shared boundary moves as one, end at c - 1
    starts = {10: 0.9, 33: 0.3, 34: 0.4, 35: 0.4, 36: 0.3, 40: 0.45}
    lp = _spread(80, [(10, 60)], starts, {32: 0.3, 33: 0.4, 34: 0.4, 35: 0.3, 60: 0.9})
    out = refine_boundaries([(10, 39), (40, 60)], lp, window=2, search=10, min_len=5)
    assert out[0][1] + 1 == out[1][0] and 33 <= out[1][0] <= 36
    # a start never moves onto the session before it (a gap of one step at least stays), nor past
    # min_len before its own end; an end never reaches the next session
    starts = {t: 0.5 for t in range(0, 30)}
    lp = _spread(60, [(0, 10), (12, 40)], starts, {t: 0.5 for t in range(10, 60)})
    out = refine_boundaries([(0, 10), (12, 40)], lp, window=3, search=20, min_len=8)
    (a0, b0), (a1, b1) = out
    assert a1 >= b0 + 2 and b0 - a0 + 1 >= 8 and b1 - a1 + 1 >= 8 and b1 <= 59
    # whatever the probabilities, sessions stay sorted, apart or adjacent, and at least min_len long
    rng = np.random.default_rng(1)
    for _ in range(30):
        lp = np.log(rng.dirichlet(np.ones(4) * 0.5, size=300))
        path = decode_sessions(viterbi_labels(lp, min_gap=10, min_len=8, short_gap_cost=2.0), min_len=1)
        out = refine_boundaries(path, lp, window=4, search=15, min_len=8)
        assert len(out) == len(path)
        assert all(b - a + 1 >= 8 for a, b in out) and all(0 <= a and b < 300 for a, b in out)
        for (_, b), (a, _) in zip(out, out[1:]):
            assert a == b + 1 or a >= b + 2


def test_configured_decode_refines_within_the_configured_window():
    from egomem.config import TriggerConfig
    from egomem.trigger.decode import configured_decode, viterbi_labels

    starts = {20: 0.3, 21: 0.35, 22: 0.4, 23: 0.4, 24: 0.35, 25: 0.3, 26: 0.1, 27: 0.1, 28: 0.5}
    lp = _spread(100, [(28, 70)], starts, {70: 0.9})  # sure of the session from 28 on: the path starts there
    cfg = TriggerConfig(min_gap_steps=10, min_session_steps=8, short_gap_cost=4.0, boundary_window_steps=3,
                        boundary_search_steps=10)
    path = viterbi_labels(lp, 10, 8, 4.0)
    assert decode_sessions(path) == [(28, 70)]
    assert decode_sessions(configured_decode(lp, cfg)) == [(23, 70)]
    np.testing.assert_array_equal(configured_decode(lp, cfg, boundary_window=0), path)


